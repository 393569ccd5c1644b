"""A flow run by hand, as mitmproxy's Playbook: replies in, the next command out, no loop.

``Playbook(flow)``: ``start()`` gives the first command; ``send(reply)`` the next one (None
once the flow returned, its ``Outcome`` in ``outcome``). Also the call starts and the fakes the
flow tests share (a clock that advances 0.25 s per reading, a renderer with no capability
beyond ``render``, an exact-token family of Qwen's parser and vLLM's completions dialect).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capture_proxy.core.engine_formats import VllmCompletions
from capture_proxy.core.flow.call import Flow, Outcome
from capture_proxy.core.flow.captured import CallStart, captured_call
from capture_proxy.core.flow.commands import Command
from capture_proxy.core.fronts import FrontCodec
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.families.qwen3 import QwenHermesParser

CALL_ID = "call-flow1"
ROLLOUT_ID = "r1"
CREATED_AT = 1_700_000_000.0


class Playbook:
    def __init__(self, flow: Flow[Outcome]) -> None:
        self.flow = flow
        self.outcome: Outcome | None = None

    def start(self) -> Command | None:
        return self.send(None)

    def send(self, reply: Any) -> Command | None:
        try:
            return self.flow.send(reply)
        except StopIteration as stop:
            self.outcome = stop.value
            return None


class Clock:
    """0.0, 0.25, 0.5, ... seconds: latencies are multiples of 250 ms."""

    def __init__(self) -> None:
        self.now = -0.25

    def __call__(self) -> float:
        self.now += 0.25
        return self.now


class PlainRenderer:
    """A renderer of no capability beyond ``render`` (neither ``TailRenderer`` nor
    ``ContinuationRenderer``): rendering is asked for with ``Render`` commands only."""

    async def render(self, *args: Any, **kwargs: Any) -> list[int]:
        raise AssertionError("a flow never renders itself")


@dataclass
class FakeExact:
    """An exact-token family: Qwen's Hermes parser, vLLM's completions dialect."""

    renderer: Any = field(default_factory=PlainRenderer)
    parser: Any = field(default_factory=QwenHermesParser)
    dialect: Any = field(default_factory=VllmCompletions)
    end_of_turn_token: str = "<|im_end|>"
    full_render: bool = False
    decode: Any = None

    def close_ids(self, end_of_turn_ids: frozenset[int]) -> frozenset[int]:
        return end_of_turn_ids

    def opens_reasoning(self, prompt_token_ids: Any) -> bool:
        return False


def call_start(front: FrontCodec, body: dict[str, Any], exact: Any = None) -> CallStart:
    known = KnownMessages()
    return CallStart(
        front=front,
        front_request=front.parse(body, known=known),
        rollout_id=ROLLOUT_ID,
        call_id=CALL_ID,
        created_at=CREATED_AT,
        retry_count=None,
        notes=None,
        known=known,
        message_facts=None,
        exact=exact,
        routed_experts_expectation="off",
        clock=Clock(),
    )


def playbook(front: FrontCodec, body: dict[str, Any], exact: Any = None) -> Playbook:
    return Playbook(captured_call(call_start(front, body, exact)))
