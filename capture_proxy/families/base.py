"""What a model family is: the interfaces every family implements, and its errors.

A family is one object (``ModelFamily``) that knows a model's chat format: how vLLM renders a
conversation for it (normalisation, first prompt, the tail after a continued turn), how the
model writes a turn and how its generation parses back into a message (whole and streamed),
and which tokens stop and end a turn. Exact-token mode (``proxy.exact``) and the scripted
engine use the same objects. Pure: no aiohttp, no I/O after construction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, runtime_checkable

from capture_proxy.families.parsing import OutputParser


class RenderError(ValueError):
    """The conversation cannot be rendered (template error, engine refused); names the cause."""


class RendererUnavailable(RenderError):
    """The engine that renders could not be reached (or answered with a server error): the
    caller gets a 502, not a 400; the conversation itself may be fine."""


class ChatRenderer(Protocol):
    async def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation. Raises RenderError."""


@runtime_checkable
class TailRenderer(Protocol):
    """A renderer that renders only what follows a continued turn, on the caller's thread
    (small: the new messages and the context of ``hf_template.tail_context``)."""

    def render_tail_sync(
        self,
        context: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        end_of_turn_text: str,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int] | None:
        """Token ids after the end of ``context``'s last turn when ``new_messages`` follow it
        and the generation prompt closes it; None when the template does not allow it.
        Raises RenderError."""


def renders_tails(renderer: object) -> TypeGuard[TailRenderer]:
    """``isinstance(renderer, TailRenderer)``, decided once per class (a protocol check
    costs some microseconds, and every continued call asks)."""
    kind: type = type(renderer)
    return _class_renders_tails(kind)


@functools.cache
def _class_renders_tails(kind: type) -> bool:
    return callable(getattr(kind, "render_tail_sync", None))


@runtime_checkable
class ContinuationRenderer(Protocol):
    """A renderer that can leave the last message open for the model to continue (an
    Anthropic prefill, vLLM's ``continue_final_message``)."""

    async def render_continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the conversation, its last message left open. Raises RenderError."""


@dataclass(frozen=True)
class ModelFamily:
    """One model family.

    - ``renderer``: chat messages -> prompt ids as vLLM renders them (``render``,
      ``render_sync``, ``render_tail_sync``; vLLM's message normalisation applied);
    - ``parser``: generated text / ids -> assistant message, whole or streamed;
    - ``end_of_turn_token``: what ends a turn in the render (appended after a length stop);
    - ``close_tokens``: other sampled stop tokens that close the model's turn;
    - ``write``: the ids the model samples for an assistant message, closing token included
      (the scripted engine's output);
    - ``reasoning_tokens``: the (open, close) markers of a reasoning block, when the family
      has one; a prompt that ends inside an open block (Qwen3-2507 Thinking) makes the
      generation start as reasoning (``opens_reasoning``);
    - ``drops``: what the family's published template leaves out of history (documentation,
      and the class of a backend-mode refusal).
    """

    name: str
    renderer: Any  # LocalRenderer | HarmonyRenderer: render, render_sync, render_tail_sync
    parser: OutputParser
    end_of_turn_token: str
    close_tokens: tuple[str, ...]
    write: Callable[[Mapping[str, Any]], list[int]]
    reasoning_tokens: tuple[str, str] | None = None
    drops: str = ""

    def token_id(self, token: str) -> int:
        """The id of one of the family's tokens. Raises RenderError."""
        tid = self.renderer.token_id(token)
        if tid is None:
            raise RenderError(f"{token!r} is not one token of the {self.name} tokenizer")
        return int(tid)

    @property
    def end_of_turn_id(self) -> int:
        return self.token_id(self.end_of_turn_token)

    @property
    def close_ids(self) -> frozenset[int]:
        """Every sampled token that closes a turn (end of turn included)."""
        ids = {self.end_of_turn_id}
        for t in self.close_tokens:
            tid = self.renderer.token_id(t)
            if tid is not None:
                ids.add(int(tid))
        return frozenset(ids)

    def opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether ``prompt_token_ids`` end inside an open reasoning block (its open marker
        after the last close marker, within the generation prompt's last few tokens)."""
        return prompt_opens_reasoning(self.renderer, self.reasoning_tokens, prompt_token_ids)


#: how far back from the prompt's end an open reasoning marker counts (the generation
#: prompt: ``<|im_start|>assistant\n<think>\n`` is 5 tokens)
REASONING_LOOKBACK = 8


def prompt_opens_reasoning(
    renderer: Any, markers: tuple[str, str] | None, prompt_token_ids: Sequence[int]
) -> bool:
    """``ends_in_open_block`` with the ids of ``markers`` in ``renderer``'s vocabulary; False
    without markers or their ids."""
    if markers is None:
        return False
    open_id, close_id = renderer.token_id(markers[0]), renderer.token_id(markers[1])
    if open_id is None or close_id is None:
        return False
    return ends_in_open_block(prompt_token_ids, int(open_id), int(close_id))


def ends_in_open_block(prompt_token_ids: Sequence[int], open_id: int, close_id: int) -> bool:
    """True when the last ``REASONING_LOOKBACK`` ids hold ``open_id`` with no ``close_id``
    after it (the generation prompt opened a block the model is to close)."""
    tail = [int(t) for t in prompt_token_ids[-REASONING_LOOKBACK:]]
    if open_id not in tail:
        return False
    last_open = len(tail) - 1 - tail[::-1].index(open_id)
    return close_id not in tail[last_open:]
