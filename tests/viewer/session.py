"""A captured session for the viewer tests: one rollout with a refused link, one linked.

``refused`` (scripted engine with a character token split and routed experts): call 1 answers
with a tool call whose content tokens do not survive re-tokenisation; call 2 sends it back and
its link is refused (``retokenized``) so it starts a second chain; call 3 continues from call 2,
the engine fails it (500, stored failed) and the harness's retry replaces it (the first attempt
is superseded). ``linked`` (default policy): three calls
in one chain.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.state import FAILED_SO_FAR
from tests.proxy.conftest import MakeStack, Stack
from tests.proxy.test_capture import USER, _body
from tests.proxy.test_chains_rest import _echo
from tests.proxy.test_linking import SPLIT_POLICY
from tests.proxy.test_npz_and_retention import MOE


@dataclass
class Session:
    stack: Stack
    #: call ids of ``refused`` in arrival order: [first, refused child, superseded, retry]
    refused: list[str]
    linked: list[str]


async def _step(stack: Stack, rollout: str, messages: list, **kwargs) -> tuple[str, dict]:
    resp = await stack.chat(rollout, _body(messages), **kwargs)
    assert resp.status == 200, await resp.text()
    return resp.headers["X-Capture-Call-Id"], (await resp.json())["choices"][0]["message"]


def _tool_result(message: dict, content: str) -> dict:
    return {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": content}


async def capture_session(make_stack: MakeStack, **settings) -> Session:
    # the engine fails one chat request, the one after the count is set back to 0 below
    config = ScriptedEngineConfig(policy=SPLIT_POLICY, moe=MOE, fail_status=500, fail_first_n=1)
    stack = await make_stack(engine_config=config, **settings)
    failed_so_far = stack.engine_app[FAILED_SO_FAR]
    failed_so_far[0] = 1
    first, m1 = await _step(stack, "refused", list(USER))
    history = [*USER, _echo(m1), _tool_result(m1, "a.txt\nb.txt")]
    second, m2 = await _step(stack, "refused", history)
    history = [*history, _echo(m2), {"role": "user", "content": "Thanks. Once more?"}]
    failed_so_far[0] = 0
    failed = await stack.chat("refused", _body(history))
    assert failed.status == 500, await failed.text()
    third = failed.headers["X-Capture-Call-Id"]
    retry, _ = await _step(stack, "refused", history, headers={"x-stainless-retry-count": "1"})

    linked = []
    # A restart of the proxy on the same store (one proxy per store): the pages are read
    # through this one, which sees both rollouts.
    default = await make_stack(engine_config=ScriptedEngineConfig(), **settings)
    history = list(USER)
    for _ in range(3):
        call_id, message = await _step(default, "linked", history)
        linked.append(call_id)
        history = [*history, _echo(message)]
        if message.get("tool_calls"):
            history.append(_tool_result(message, "ok"))
        else:
            history.append({"role": "user", "content": "Go on."})
    return Session(default, [first, second, third, retry], linked)
