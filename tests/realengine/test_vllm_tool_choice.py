"""Tier 4, exact-token mode per ``tool_choice``: the proxy's tokens-in request, constrained as
vLLM's chat completions constrain it, makes the real engine generate what vLLM's own chat
completions generate for the same request, and the proxy answers what vLLM answers.

vLLM here serves ``--enable-auto-tool-choice --tool-call-parser hermes`` (no reasoning
parser); the proxy reads Hermes calls as that parser does (its ``qwen`` parser also reads a
think block, which none of these generations holds: a constrained one starts with its call).
Greedy sampling: with the same prompt ids and the same structural tag, the two paths sample
the same ids.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.realengine.conftest import RealStack
from tests.realengine.test_vllm import SYSTEM, TOOL_CALL_TEXT, TOOLS, USER, _direct

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(300)]

NAMED = {"type": "function", "function": {"name": "bash"}}


def _answer(message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {
        "content": message.get("content") or None,
        "calls": [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ],
        "finish_reason": finish,
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "required"},
        {"tool_choice": NAMED},
        {"tool_choice": "required", "parallel_tool_calls": False},
    ],
    ids=["required", "named", "required_single"],
)
async def test_a_constrained_tool_choice_generates_and_answers_as_vllm(
    real_exact: RealStack, fields: dict[str, Any]
):
    real = real_exact
    body = {
        "model": real.model,
        "messages": [SYSTEM, USER],
        "tools": TOOLS,
        "max_tokens": 40,
        "temperature": 0,
        **fields,
    }
    direct = _direct(real, body)
    resp = await real.chat("real-choice", body)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    choice, vllm = answer["choices"][0], direct["choices"][0]
    record = await real.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert record["generation_token_ids"] == vllm["token_ids"]
    assert _answer(choice["message"], choice["finish_reason"]) == _answer(
        vllm["message"], vllm["finish_reason"]
    )


async def test_tool_choice_none_answers_a_written_call_as_content(real_exact: RealStack):
    real = real_exact
    _, forced = real.forced(TOOL_CALL_TEXT)
    body = {
        "model": real.model,
        "messages": [SYSTEM, USER],
        "tools": TOOLS,
        "tool_choice": "none",
        "max_tokens": 64,
        **forced,
    }
    direct = _direct(real, body)["choices"][0]
    resp = await real.chat("real-choice-none", body)
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    assert _answer(choice["message"], choice["finish_reason"]) == _answer(
        direct["message"], direct["finish_reason"]
    )
    assert choice["message"]["content"] == TOOL_CALL_TEXT
