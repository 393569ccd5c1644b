"""Tier 2: lineage across harness sessions of one rollout, through the proxy against the
scripted engine, over Anthropic Messages as Claude Code 2.1.328 sends it (its session in
``metadata.user_id``; trial 11, findings 1 and 4), in both prompt modes.

Two sessions, each in its own project directory, whose main agents hand out the same two
``Agent`` prompts; session B's sub-agents start before session A's. Each sub-agent is
``spawned_by`` its own session's main call, one ``Agent`` tool call each. Then a session
killed while the model wrote its first answer is resumed (``claude --continue``): its
request replays the lost call's request, then "No response requested.", then the new
prompt; it is ``resumed_after_interrupt`` of the lost call."""

from __future__ import annotations

import json
from typing import Any

import pytest

from capture_proxy.core.lineage.messages import text_sha256
from capture_proxy.scripted_engine import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from harness_notes.claude_code import INTERRUPTED_TURN_TEXT
from tests.proxy.conftest import MakeStack, Stack

BASE = "/ng-rollout/{rollout}/training-token-capture/v1/messages?beta=true"
ANTHROPIC = {"anthropic-version": "2023-06-01"}
TASK = "Inspect notes.txt with helpers."
SUB_PROMPT = (
    "Use Bash to count the lines of notes.txt with wc -l and report the number. Do not edit."
)
AGENT_TOOL = {
    "name": "Agent",
    "description": "Launch a sub-agent.",
    "input_schema": {
        "type": "object",
        "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
    },
}
AGENT_CALL = {"name": "Agent", "arguments": {"description": "count", "prompt": SUB_PROMPT}}
POLICY = Policy.model_validate(
    {
        "steps": [{"content": "Delegating.", "tool_calls": [AGENT_CALL, AGENT_CALL]}],
        "final": "All done.",
        "rules": [
            {"when_first_user_message_contains": SUB_PROMPT, "step": {"content": "3 lines."}},
            {"when_last_user_message_contains": "Now say hello.", "step": {"content": "Hello."}},
        ],
    }
)


def _body(session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    user_id = {"device_id": "75cb57be", "account_uuid": "", "session_id": session}
    return {
        "model": "scripted-qwen",
        "max_tokens": 256,
        # as each session's own project dir does, the sessions' prompts differ
        "system": f"You are a coding agent. Primary working directory: /work/{session}",
        "messages": messages,
        "tools": [AGENT_TOOL],
        "metadata": {"user_id": json.dumps(user_id)},
    }


async def _call(stack: Stack, rollout: str, session: str, messages: list[dict]) -> tuple[str, Any]:
    resp = await stack.client.post(
        BASE.format(rollout=rollout), json=_body(session, messages), headers=ANTHROPIC
    )
    assert resp.status == 200, await resp.text()
    return resp.headers["X-Capture-Call-Id"], await resp.json()


async def _lineage(stack: Stack, rollout: str) -> dict[str, list[dict[str, Any]]]:
    chains = await stack.get_json(f"/captures/rollouts/{rollout}/chains")
    return {c["chain_id"]: c["lineage"] for c in chains["chains"]}


def assert_sub_agents_of_their_session(
    lineage: dict[str, list[dict[str, Any]]],
    subs: list[tuple[str, str]],
    main: dict[str, str],
    tool_ids: dict[str, list[str]],
    evidence: Any,
) -> None:
    """Each session's sub-agent calls (``subs``: (session, call id), in arrival order) are
    ``spawned_by`` its main call (``main[session]``, a chain of its own with no edge), one per
    tool call of it in order (``tool_ids[session]``), with ``evidence(session)`` and the tool
    call's id as the edge's evidence."""
    got: dict[str, list[tuple[str, str, str]]] = {session: [] for session in main}
    for session, call_id in subs:
        (edge,) = lineage[call_id]
        tool_call_id = edge["evidence"]["tool_call_id"]
        got[session].append((edge["kind"], edge["from_call_id"], tool_call_id))
        assert edge["chain_id"] == main[session]
        assert edge["evidence"] == {**evidence(session), "tool_call_id": tool_call_id}
    assert got == {
        s: [("spawned_by", main[s], tool_ids[s][0]), ("spawned_by", main[s], tool_ids[s][1])]
        for s in main
    }
    assert all(lineage[call_id] == [] for call_id in main.values())


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_sub_agents_of_two_sessions_are_spawned_by_their_own_sessions_call(
    make_stack: MakeStack, prompt_mode: str
):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY), prompt_mode=prompt_mode
    )
    task = [{"role": "user", "content": TASK}]
    main: dict[str, str] = {}
    tool_ids: dict[str, list[str]] = {}
    for session in ("sess-a", "sess-b"):
        main[session], answer = await _call(stack, "many", session, task)
        tool_ids[session] = [b["id"] for b in answer["content"] if b["type"] == "tool_use"]
        assert len(tool_ids[session]) == 2
    sub = [{"role": "user", "content": [{"type": "text", "text": SUB_PROMPT}]}]
    subs = [(s, (await _call(stack, "many", s, sub))[0]) for s in ("sess-b",) * 2 + ("sess-a",) * 2]

    # each session's sub-agents, in arrival order: its main call, one Agent tool call each
    assert_sub_agents_of_their_session(
        await _lineage(stack, "many"),
        subs,
        main,
        tool_ids,
        lambda session: {
            "rule": "claude_code.spawn_tool",
            "tool_name": "Agent",
            "field": "prompt",
            "message_index": 1,  # after the system message
            "text_sha256": text_sha256(SUB_PROMPT),
            "num_chars": len(SUB_PROMPT),
            "session": session,
        },
    )


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_a_session_resumed_after_a_lost_turn_is_joined_to_the_lost_call(
    make_stack: MakeStack, prompt_mode: str
):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY), prompt_mode=prompt_mode
    )
    task = [{"role": "user", "content": "Read the notes."}]
    # the harness was killed before it got this answer (stored: the proxy saw it end)
    lost, _ = await _call(stack, "resume", "sess-k", task)
    placeholder = {
        "role": "assistant",
        "content": [{"type": "text", "text": INTERRUPTED_TURN_TEXT}],
    }
    resumed_messages = [*task, placeholder, {"role": "user", "content": "Now say hello."}]
    resumed, answer = await _call(stack, "resume", "sess-k", resumed_messages)
    assert answer["content"][0]["text"] == "Hello."

    record = await stack.get_json(f"/captures/calls/{resumed}")
    # the placeholder is no captured output: no token link, the history flagged
    assert record["linking"]["verdict"] == "unresolved"
    assert "foreign_turn_projected_portable" in [d["kind"] for d in record["diagnostics"]]
    lost_record = await stack.get_json(f"/captures/calls/{lost}")
    lost_tokens = lost_record["prompt_token_ids"] + lost_record["generation_token_ids"]
    common = 0
    for a, b in zip(record["prompt_token_ids"], lost_tokens, strict=False):
        if a != b:
            break
        common += 1
    assert common >= len(lost_record["prompt_token_ids"])  # the lost call's prompt, replayed
    lineage = await _lineage(stack, "resume")
    assert lineage == {
        lost: [],
        resumed: [
            {
                "kind": "resumed_after_interrupt",
                "chain_id": lost,
                "from_call_id": lost,
                "evidence": {
                    "rule": "claude_code.interrupted_turn",
                    "num_messages": 1,
                    "common_prefix_tokens": common,
                    "marker": INTERRUPTED_TURN_TEXT,
                    "message_index": 2,  # request_messages: system, user, placeholder
                    "session": "sess-k",
                },
            }
        ],
    }
    summary = await stack.get_json("/captures/rollouts/resume")
    assert summary["lineage"]["resumed_after_interrupt"] == 1


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_twin_sessions_token_identical_calls_each_continue_their_own_chain(
    make_stack: MakeStack, prompt_mode: str
):
    # Two sessions of one task in one project dir, from a deterministic engine: their calls
    # are token-identical. Session B's second call arrives before A's; by age alone it took
    # A's first call as its parent (trial 11: chains holding calls of two sessions). The link
    # is token-exact either way; the session each request names breaks the tie.
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY), prompt_mode=prompt_mode
    )
    task = [{"role": "user", "content": TASK}]
    first: dict[str, str] = {}
    answer: dict[str, Any] = {}
    for session in ("sess-a", "sess-b"):
        body = {**_body(session, task), "system": "You are a coding agent."}
        resp = await stack.client.post(BASE.format(rollout="twins"), json=body, headers=ANTHROPIC)
        assert resp.status == 200, await resp.text()
        first[session], answer[session] = resp.headers["X-Capture-Call-Id"], await resp.json()
    second: dict[str, str] = {}
    for session in ("sess-b", "sess-a"):
        results = [
            {"type": "tool_result", "tool_use_id": b["id"], "content": "notes.txt has 3 lines."}
            for b in answer[session]["content"]
            if b["type"] == "tool_use"
        ]
        history = [
            *task,
            {"role": "assistant", "content": answer[session]["content"]},
            {"role": "user", "content": results},
        ]
        body = {**_body(session, history), "system": "You are a coding agent."}
        resp = await stack.client.post(BASE.format(rollout="twins"), json=body, headers=ANTHROPIC)
        assert resp.status == 200, await resp.text()
        second[session] = resp.headers["X-Capture-Call-Id"]
    chains = await stack.get_json("/captures/rollouts/twins/chains")
    assert sorted([c["call_id"] for c in chain["calls"]] for chain in chains["chains"]) == sorted(
        [[first[s], second[s]] for s in ("sess-a", "sess-b")]
    )
    for s in ("sess-a", "sess-b"):
        record = await stack.get_json(f"/captures/calls/{second[s]}")
        assert (record["parent_call_id"], record["linking"]["verdict"]) == (first[s], "resolved")
