"""Tier 3: two real OpenCode 1.18.33 sessions of one rollout, each handing the same task to a
``task`` sub-agent, through the proxy, in both prompt modes.

The policy (``capture_proxy/policies/opencode_subagent.json``): the main agent's first turn
calls ``task`` (a ``general`` sub-agent, the same prompt in both sessions); the sub-agent
answers once; the main agent then answers. The two ``opencode run`` processes run at once, each
in its own project directory and HOME, as the samples of a GRPO group do.

What OpenCode sent (seen through the proxy, and kept on each record as ``session_headers``):
every request ``x-session-id`` (and ``x-session-affinity``, the same id, not kept); the
sub-agent runs in a session of its own, and its requests add ``x-parent-session-id``, the main
session's id; the sub-agent's session sends no title request. Expected: each sub-agent's chain
is ``spawned_by`` the first call of its parent session's main chain (that call's ``task`` tool
call; evidence ``parent_session``), never the other session's, whichever started first; each
chain holds the calls of one session; the title and main chains have no edge.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.harnesses.opencode import find_opencode, run_opencode
from capture_proxy.scripted_engine.policy import Policy
from tests.e2e.harness_stack import (
    NOTES_TEXT,
    POLICIES,
    PROMPT_MODES,
    extends,
    harness_stack,
    run_harness,
)

OPENCODE = find_opencode()

pytestmark = [
    pytest.mark.opencode,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        OPENCODE is None,
        reason="OpenCode CLI not installed (run scripts/install-opencode, or set OPENCODE_BIN)",
    ),
]

POLICY_PATH = POLICIES / "opencode_subagent.json"
TASK = "Use a general sub-agent (the task tool) to count the lines of notes.txt."
SUB_PROMPT = "Count the lines of notes.txt and report the number. Do not edit anything."
ANSWER = "The helper says notes.txt has 3 lines."
RUN_TIMEOUT_S = 150
SESSIONS = 2


async def _opencode(stack: Any, tmp_path: Path, rollout: str, i: int) -> None:
    assert OPENCODE is not None
    project = (tmp_path / f"project{i}").resolve()
    project.mkdir()
    (project / "notes.txt").write_text(NOTES_TEXT, encoding="utf-8")
    result = await run_harness(
        run_opencode,
        OPENCODE,
        stack.capture_root(rollout) + "/v1",
        project,
        TASK,
        timeout_s=RUN_TIMEOUT_S,
        home_dir=tmp_path / f"home{i}",
    )
    assert result.ok, result.describe()
    assert ANSWER in result.stdout, result.describe()


def _first_user_text(call: dict[str, Any]) -> str:
    return next(m["content"] for m in call["request_messages"] if m["role"] == "user")


@pytest.mark.parametrize("prompt_mode", PROMPT_MODES)
async def test_each_sub_agent_is_spawned_by_its_parent_sessions_task_call(
    qwen_tokenizer, tmp_path: Path, prompt_mode: str
):
    policy = Policy.load(POLICY_PATH)
    rollout = f"e2e-oc-sessions-{prompt_mode}"
    async with harness_stack(
        qwen_tokenizer, tmp_path, policy=policy, prompt_mode=prompt_mode
    ) as stack:
        await asyncio.gather(*(_opencode(stack, tmp_path, rollout, i) for i in range(SESSIONS)))
        body = await stack.get(f"/captures/rollouts/{rollout}/chains")
        calls = {
            c["call_id"]: await stack.get(f"/captures/calls/{c['call_id']}")
            for chain in body["chains"]
            for c in chain["calls"]
        }
    chains = {c["chain_id"]: c for c in body["chains"]}
    assert body["unlinked_calls"] == [] and not body["incomplete"]

    # the headers each record keeps: x-session-id on every call, x-parent-session-id on the
    # sub-agents' only; nothing else
    session = {cid: c["session_headers"]["x-session-id"] for cid, c in calls.items()}
    parent = {cid: c["session_headers"].get("x-parent-session-id") for cid, c in calls.items()}
    for cid, call in calls.items():
        assert set(call["session_headers"]) <= {"x-session-id", "x-parent-session-id"}, cid
        assert session[cid].startswith("ses_"), cid
    subs = [cid for cid in chains if parent[cid] is not None]
    titles = [cid for cid in chains if not calls[cid]["request_tools"]]
    mains = [cid for cid in chains if cid not in subs and cid not in titles]
    assert (len(subs), len(titles), len(mains)) == (SESSIONS, SESSIONS, SESSIONS)
    main_sessions = {session[cid] for cid in mains}
    assert len(main_sessions) == SESSIONS
    assert {session[cid] for cid in titles} == main_sessions
    assert {parent[cid] for cid in subs} == main_sessions  # one sub-agent per session
    assert not main_sessions & {session[cid] for cid in subs}  # a session of its own

    # each chain is one session's calls; a main chain: the task call, then the answer
    for chain_id, chain in chains.items():
        ids = [c["call_id"] for c in chain["calls"]]
        assert {session[cid] for cid in ids} == {session[chain_id]}, chain_id
        for cid in ids[1:]:
            assert extends(calls[cid], calls[calls[cid]["parent_call_id"]]), cid
    for cid in mains:
        ids = [c["call_id"] for c in chains[cid]["calls"]]
        assert len(ids) == 2 and calls[ids[-1]]["response_message"]["content"] == ANSWER
        assert chains[cid]["lineage"] == []
    for cid in titles:
        assert chains[cid]["lineage"] == []

    # each sub-agent: spawned_by its parent session's task call, never the other session's
    main_of = {session[cid]: cid for cid in mains}
    for cid in subs:
        assert _first_user_text(calls[cid]) == SUB_PROMPT
        assert calls[cid]["response_message"]["content"] == "notes.txt has 3 lines."
        (edge,) = chains[cid]["lineage"]
        spawner = calls[main_of[parent[cid]]]
        (task_call,) = spawner["response_message"]["tool_calls"]
        assert task_call["function"]["name"] == "task"
        assert (edge["kind"], edge["chain_id"], edge["from_call_id"]) == (
            "spawned_by",
            spawner["call_id"],
            spawner["call_id"],
        )
        assert edge["evidence"] == {
            "rule": "opencode.spawn_tool",
            "tool_name": "task",
            "tool_call_id": task_call["id"],
            "field": "prompt",
            "message_index": 1,
            "text_sha256": edge["evidence"]["text_sha256"],
            "num_chars": len(SUB_PROMPT),
            "parent_session": parent[cid],
        }
