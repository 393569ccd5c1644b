"""Tier 2: lineage and linking across OpenCode sessions of one rollout, through the proxy
against the scripted engine, over chat completions as OpenCode 1.18.33 sends them: streamed,
its session named only in headers (``x-session-id``, and on a ``task`` sub-agent's requests
``x-parent-session-id``, the spawner's session; tests/fixtures/opencode/README.md), in both
prompt modes.

Two sessions whose main agents hand out the same two ``task`` prompts; session B's sub-agents
(each in a session of its own) start before session A's. Each sub-agent is ``spawned_by`` its
parent session's main call, one ``task`` tool call each (by text and arrival order alone,
B's took A's tool calls). Twin sessions whose calls are token-identical each keep their own
chain. The record keeps those two headers and no other."""

from __future__ import annotations

from typing import Any

import pytest

from capture_proxy.core.lineage.messages import text_sha256
from capture_proxy.scripted_engine import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.proxy.conftest import MakeStack, Stack
from tests.proxy.test_lineage_sessions import _lineage, assert_sub_agents_of_their_session

TASK = "Inspect notes.txt with helpers."
HELLO = "Say hello first."
SYSTEM = "You are opencode, an interactive CLI tool. Working directory: /workspace/project"
SUB_SYSTEM = "You are a general-purpose agent of opencode. Working directory: /workspace/project"
SUB_PROMPT = (
    "Use bash to count the lines of notes.txt with wc -l and report the number. Do not edit."
)
TASK_TOOL = {
    "type": "function",
    "function": {
        "name": "task",
        "description": "Launch a new agent to handle a task.",
        "parameters": {
            "type": "object",
            "properties": {
                "description": {"type": "string"},
                "prompt": {"type": "string"},
                "subagent_type": {"type": "string"},
            },
            "required": ["description", "prompt", "subagent_type"],
        },
    },
}
TASK_CALL = {
    "name": "task",
    "arguments": {"description": "count", "prompt": SUB_PROMPT, "subagent_type": "general"},
}
POLICY = Policy.model_validate(
    {
        "steps": [{"content": "", "tool_calls": [TASK_CALL, TASK_CALL]}],
        "final": "All done.",
        "rules": [
            {"when_first_user_message_contains": SUB_PROMPT, "step": {"content": "3 lines."}},
            {"when_last_user_message_contains": HELLO, "step": {"content": "Hello."}},
        ],
    }
)


def _headers(session: str, parent: str | None = None) -> dict[str, str]:
    """OpenCode 1.18.33's headers, in its order (the key is a dummy)."""
    headers = {
        "Authorization": "Bearer opencode-dummy-key",
        "User-Agent": "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14",
        "x-session-affinity": session,
        "x-session-id": session,
    }
    if parent is not None:
        headers["x-parent-session-id"] = parent
    return headers


def _body(system: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "scripted-qwen",
        "max_tokens": 256,
        "messages": [{"role": "system", "content": system}, *messages],
        "tools": [TASK_TOOL],
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _call(
    stack: Stack,
    rollout: str,
    body: dict[str, Any],
    session: str,
    parent: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """Send one streamed call; its call id and its stored record."""
    resp = await stack.chat(rollout, body, headers=_headers(session, parent))
    assert resp.status == 200, await resp.text()
    assert "data: [DONE]" in await resp.text()
    call_id = resp.headers["X-Capture-Call-Id"]
    return call_id, await stack.get_json(f"/captures/calls/{call_id}")


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_opencode_sub_agents_of_two_sessions_are_spawned_by_their_parent_sessions_call(
    make_stack: MakeStack, prompt_mode: str
):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY), prompt_mode=prompt_mode
    )
    task = [{"role": "user", "content": TASK}]
    main: dict[str, str] = {}
    tool_ids: dict[str, list[str]] = {}
    for session in ("ses_a", "ses_b"):
        main[session], record = await _call(stack, "many", _body(SYSTEM, task), session)
        tool_ids[session] = [c["id"] for c in record["response_message"]["tool_calls"]]
        assert len(tool_ids[session]) == 2
        assert record["session_headers"] == {"x-session-id": session}
    sub = [{"role": "user", "content": SUB_PROMPT}]
    subs: list[tuple[str, str]] = []
    for parent, session in (
        ("ses_b", "ses_b1"),
        ("ses_b", "ses_b2"),
        ("ses_a", "ses_a1"),
        ("ses_a", "ses_a2"),
    ):
        call_id, record = await _call(stack, "many", _body(SUB_SYSTEM, sub), session, parent)
        assert record["response_message"]["content"] == "3 lines."
        assert record["session_headers"] == {
            "x-parent-session-id": parent,
            "x-session-id": session,
        }
        subs.append((parent, call_id))

    # each parent session's sub-agents, in arrival order: its main call, one task call each
    assert_sub_agents_of_their_session(
        await _lineage(stack, "many"),
        subs,
        main,
        tool_ids,
        lambda parent: {
            "rule": "opencode.spawn_tool",
            "tool_name": "task",
            "field": "prompt",
            "message_index": 1,  # after the system message
            "text_sha256": text_sha256(SUB_PROMPT),
            "num_chars": len(SUB_PROMPT),
            "parent_session": parent,
        },
    )
    summary = await stack.get_json("/captures/rollouts/many")
    assert {k: n for k, n in summary["lineage"].items() if n} == {"spawned_by": 4}


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_twin_opencode_sessions_token_identical_calls_each_continue_their_own_chain(
    make_stack: MakeStack, prompt_mode: str
):
    # Two sessions of one task in one project dir, from a deterministic engine: their calls
    # are token-identical and only x-session-id tells them apart. Session B's second call
    # arrives before A's; by age alone it took A's first call as its parent.
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY), prompt_mode=prompt_mode
    )
    hello = [{"role": "user", "content": HELLO}]
    first: dict[str, str] = {}
    answer: dict[str, dict[str, Any]] = {}
    tokens: dict[str, list[int]] = {}
    for session in ("ses_a", "ses_b"):
        first[session], record = await _call(stack, "twins", _body(SYSTEM, hello), session)
        answer[session] = record["response_message"]
        tokens[session] = record["prompt_token_ids"] + record["generation_token_ids"]
    assert answer["ses_a"]["content"] == "Hello."
    assert (answer["ses_a"], tokens["ses_a"]) == (answer["ses_b"], tokens["ses_b"])
    second: dict[str, str] = {}
    for session in ("ses_b", "ses_a"):
        # as OpenCode echoes a text turn: no tool_calls key
        echoed = {"role": "assistant", "content": answer[session]["content"]}
        history = [*hello, echoed, {"role": "user", "content": TASK}]
        second[session], record = await _call(stack, "twins", _body(SYSTEM, history), session)
        assert (record["parent_call_id"], record["linking"]["verdict"]) == (
            first[session],
            "resolved",
        )
    chains = await stack.get_json("/captures/rollouts/twins/chains")
    assert sorted([c["call_id"] for c in chain["calls"]] for chain in chains["chains"]) == sorted(
        [[first[s], second[s]] for s in ("ses_a", "ses_b")]
    )
