"""Tier 3: the real Claude Code (2.1.328) starts sub-agents, a fork and a compaction through
the proxy; the read API joins the episode's chains by lineage edges, in both prompt modes.

The policy (``capture_proxy/policies/claude_code_lineage.json``): the main agent's first turn
calls ``Agent`` three times (two identical ``general-purpose`` counters and one ``fork``); each
sub-agent answers once; the main agent answers the background-task notifications. Then
``claude -p /compact --continue`` (the summary call answers ``<summary>...</summary>``) and
``claude -p "Now say hello." --continue`` after it (answered "Hello.").

What Claude Code sent (seen through the proxy): every ``Agent`` call runs in the background
("Async agent launched successfully"); a sub-agent's first user message is the tool input's
``prompt``; the fork replays the main history with the ``Agent`` turn as its tool_use blocks
alone (no text, no thinking), then the tool result "Fork started — that fork is you." and a
``<fork-boilerplate>`` user block (its link to the main call is refused: its system header
differs); ``/compact`` sends the history with a last user message "CRITICAL: Respond with TEXT
ONLY..." and the next conversation starts from the summary's body.

Expected edges, each with its evidence: the two counters ``spawned_by`` the main chain's first
call, one ``Agent`` tool call each (distinct tool call ids); the fork ``forked_from`` that call
(``claude_code.fork_marker``); the conversation after ``/compact`` ``compacted_from`` the
summary call (``claude_code.summary_tags``, replacing the main chain). The token links are the
proxy's own, unchanged: every kept link extends its parent token for token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.harnesses.claude_code import API_KEY, find_claude, run_claude
from capture_proxy.scripted_engine.policy import Policy
from tests.e2e.harness_stack import (
    POLICIES,
    PROMPT_MODES,
    extends,
    harness_stack,
    make_project,
    run_harness,
)

CLAUDE = find_claude()

pytestmark = [
    pytest.mark.claude_code,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        CLAUDE is None, reason="Claude Code not installed (run scripts/install-harnesses)"
    ),
]

POLICY_PATH = POLICIES / "claude_code_lineage.json"
TASK = "Use sub-agents to count the lines of notes.txt."
RUN_TIMEOUT_S = 150
COMPACT_INSTRUCTION = "CRITICAL: Respond with TEXT ONLY"


async def _claude(
    stack: Any, project: Path, home: Path, rollout: str, prompt: str, *args: str
) -> None:
    assert CLAUDE is not None
    result = await run_harness(
        run_claude,
        CLAUDE,
        stack.capture_root(rollout),
        project,
        prompt,
        timeout_s=RUN_TIMEOUT_S,
        home_dir=home,
        extra_args=list(args),
    )
    assert result.ok, result.describe()


def _first_user_text(call: dict[str, Any]) -> str:
    for m in call["request_messages"]:
        if m["role"] == "user":
            c = m["content"]
            return c if isinstance(c, str) else "".join(p.get("text", "") for p in c)
    return ""


def _text_of(message: dict[str, Any]) -> str:
    c = message.get("content")
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [])


def _session(call: dict[str, Any]) -> str:
    """The session id a Claude Code request names (``metadata.user_id``, a JSON string)."""
    return str(json.loads(call["request_received"]["metadata"]["user_id"])["session_id"])


def _last_text(call: dict[str, Any]) -> str:
    c = call["request_messages"][-1]["content"]
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [])


async def _details(stack: Any, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        c["call_id"]: await stack.get(f"/captures/calls/{c['call_id']}")
        for chain in body["chains"]
        for c in chain["calls"]
    }


@pytest.mark.parametrize("prompt_mode", PROMPT_MODES)
async def test_sub_agents_fork_and_compaction_are_lineage_edges(
    qwen_tokenizer, tmp_path: Path, prompt_mode: str
):
    policy = Policy.load(POLICY_PATH)
    rollout = f"e2e-cc-lineage-{prompt_mode}"
    async with harness_stack(
        qwen_tokenizer, tmp_path, policy=policy, prompt_mode=prompt_mode, proxy_token=API_KEY
    ) as stack:
        project, home = make_project(tmp_path), tmp_path / "home"
        await _claude(stack, project, home, rollout, TASK)
        await _claude(stack, project, home, rollout, "/compact", "--continue")
        await _claude(stack, project, home, rollout, "Now say hello.", "--continue")

        body = await stack.get(f"/captures/rollouts/{rollout}/chains")
        summary = await stack.get(f"/captures/rollouts/{rollout}")
        calls = await _details(stack, body)
    chains = {c["chain_id"]: c for c in body["chains"]}
    root = {cid: calls[cid] for cid in chains}
    # the session evidence lineage checks (harness_notes.claude_code.SESSION): every call of
    # the three `claude` runs names one session, the sub-agents', the fork's, the summary's
    # and those after `--continue` included
    assert len({_session(c) for c in calls.values()}) == 1

    # the main session: the root whose first user message is the task, with the Agent turn
    forks = [cid for cid, r in root.items() if "<fork-boilerplate>" in _last_text(r)]
    (main_id,) = [
        cid for cid, r in root.items() if _first_user_text(r) == TASK and cid not in forks
    ]
    main = root[main_id]
    agent_ids = [tc["id"] for tc in main["response_message"]["tool_calls"]]
    assert [tc["function"]["name"] for tc in main["response_message"]["tool_calls"]] == [
        "Agent"
    ] * 3
    counter_prompt = json.loads(main["response_message"]["tool_calls"][0]["function"]["arguments"])[
        "prompt"
    ]

    counters = sorted(
        (cid for cid, r in root.items() if _first_user_text(r) == counter_prompt),
        key=lambda cid: root[cid]["created_at"],
    )
    assert len(counters) == 2
    spawned = [chains[cid]["lineage"] for cid in counters]
    for (edge,) in spawned:
        assert edge["kind"] == "spawned_by"
        assert (edge["chain_id"], edge["from_call_id"]) == (main_id, main_id)
        assert edge["evidence"]["rule"] == "claude_code.spawn_tool"
        assert edge["evidence"]["tool_name"] == "Agent" and edge["evidence"]["field"] == "prompt"
        assert edge["evidence"]["num_chars"] == len(counter_prompt)
        assert edge["evidence"]["session"] == _session(main)
    # two identical sub-agents: one Agent tool call each
    assert sorted(e["evidence"]["tool_call_id"] for (e,) in spawned) == sorted(agent_ids[:2])

    assert len(forks) == 1
    (fork_edge,) = chains[forks[0]]["lineage"]
    assert (fork_edge["kind"], fork_edge["chain_id"], fork_edge["from_call_id"]) == (
        "forked_from",
        main_id,
        main_id,
    )
    # the fork replays the task and the Agent turn (its own tool call alone), then the marker
    fork = root[forks[0]]
    marker = "Fork started \u2014 that fork is you."
    (marker_at,) = [i for i, m in enumerate(fork["request_messages"]) if _text_of(m) == marker]
    head = main["prompt_token_ids"] + main["generation_token_ids"]
    pairs = zip(fork["prompt_token_ids"], head, strict=False)
    common = next(
        (i for i, (a, b) in enumerate(pairs) if a != b),
        min(len(head), len(fork["prompt_token_ids"])),
    )
    assert fork_edge["evidence"] == {
        "rule": "claude_code.fork_marker",
        "num_messages": 2,
        "common_prefix_tokens": common,
        "marker": marker,
        "message_index": marker_at,
        "session": _session(main),
    }

    # the summary call: the last one asked for TEXT ONLY; the conversation after it
    (summary_call,) = [c for c in calls.values() if COMPACT_INSTRUCTION in _last_text(c)]
    compacted = [
        cid for cid in chains if any(e["kind"] == "compacted_from" for e in chains[cid]["lineage"])
    ]
    assert len(compacted) == 1
    (edge,) = chains[compacted[0]]["lineage"]
    assert edge["from_call_id"] == summary_call["call_id"]
    assert edge["evidence"]["rule"] == "claude_code.summary_tags"
    assert edge["chain_id"] == edge["evidence"]["replaces_chain_id"]
    assert summary_call["call_id"] in [c["call_id"] for c in chains[edge["chain_id"]]["calls"]]

    # no other edge; the main chain has none
    assert chains[main_id]["lineage"] == []
    kinds = [e["kind"] for c in chains.values() for e in c["lineage"]]
    assert sorted(kinds) == ["compacted_from", "forked_from", "spawned_by", "spawned_by"]
    assert summary["lineage"] == {
        "spawned_by": 2,
        "forked_from": 1,
        "compacted_from": 1,
        "resumed_from": 0,
        "resumed_after_interrupt": 0,
        "retried_from": 0,
    }
    # token links are the proxy's: every kept link extends its parent token for token
    for chain in body["chains"]:
        by_id = {c["call_id"]: c for c in chain["calls"]}
        for c in chain["calls"]:
            if c["parent_call_id"] is not None:
                assert extends(c, by_id[c["parent_call_id"]]), c["call_id"]


async def test_two_unrelated_sessions_in_one_rollout_stay_unjoined(qwen_tokenizer, tmp_path: Path):
    """Two plain sessions of one task at once in one rollout (no sub-agent): two chains, no
    lineage edge between them."""
    import asyncio

    policy = Policy.load(POLICIES / "claude_code.json")
    rollout = "e2e-cc-unrelated"
    async with harness_stack(
        qwen_tokenizer, tmp_path, policy=policy, prompt_mode="exact_tokens", proxy_token=API_KEY
    ) as stack:
        sessions = []
        for i in range(2):
            (tmp_path / f"s{i}").mkdir()
            project = make_project(tmp_path / f"s{i}")
            sessions.append(
                _claude(stack, project, tmp_path / f"home{i}", rollout, "List the files.")
            )
        await asyncio.gather(*sessions)
        body = await stack.get(f"/captures/rollouts/{rollout}/chains")
        summary = await stack.get(f"/captures/rollouts/{rollout}")
    assert len(body["chains"]) == 2
    assert [c["lineage"] for c in body["chains"]] == [[], []]
    assert set(summary["lineage"].values()) == {0}
