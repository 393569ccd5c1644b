"""Tier 3: the real Codex CLI (0.169.0) compacts its history and resumes a session through the
proxy; the read API joins the chains by lineage, in both prompt modes.

The policy (``capture_proxy/policies/codex_lineage.json``) is ``codex.json``'s session plus
three rules: the compaction request (its last user message "You are performing a CONTEXT
CHECKPOINT COMPACTION...", codex-rs ``templates/compact/prompt.md``) is answered with a
summary; the rebuilt history (a user message "Another language model started to solve this
problem..." with the summary) with a short answer; "Say hello." with "Hello.".

Seen through the proxy: with ``model_auto_compact_token_limit = 1500`` Codex compacts after the
first tool call: it sends the history plus the compaction instruction (a child of the first
call: its tokens extend), then a new request of the task and one user message made of the
summary prefix and the summary (a root: the history was replaced). ``codex exec resume --last``
replays the stored session and appends the new user message: its tokens extend the last call's,
so it is a token link in the same chain, not a lineage edge. In backend-template mode the
summary request's link to the first call is refused (the engine re-renders the first answer's
reasoning): it is a root of its own, ``forked_from`` the first call (its history replayed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from capture_proxy.harnesses.codex import API_KEY, find_codex, run_codex
from capture_proxy.scripted_engine.policy import Policy
from harness_notes.codex import COMPACT_INSTRUCTION
from tests.e2e.harness_stack import (
    POLICIES,
    PROMPT_MODES,
    extends,
    harness_stack,
    make_project,
    run_harness,
)

CODEX = find_codex()

pytestmark = [
    pytest.mark.codex,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        CODEX is None, reason="Codex CLI not installed (run scripts/install-harnesses)"
    ),
]

TASK = "List the files, show notes.txt and mark its TODO as done."
COMPACT_LIMIT = {"model_auto_compact_token_limit": 1500, "model_context_window": 6000}


def _text(message: dict[str, Any]) -> str:
    c = message.get("content")
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [])


@pytest.mark.parametrize("prompt_mode", PROMPT_MODES)
async def test_compaction_is_an_edge_and_a_resume_a_token_link(
    qwen_tokenizer, tmp_path: Path, prompt_mode: str
):
    policy = Policy.load(POLICIES / "codex_lineage.json")
    rollout = f"e2e-codex-lineage-{prompt_mode}"
    async with harness_stack(
        qwen_tokenizer, tmp_path, policy=policy, prompt_mode=prompt_mode, proxy_token=API_KEY
    ) as stack:
        project, home = make_project(tmp_path), tmp_path / "home"
        base = stack.capture_root(rollout) + "/v1"
        for prompt, kw in [
            (TASK, {"top_level": COMPACT_LIMIT}),
            ("Say hello.", {"extra_args": ["resume", "--last"]}),
        ]:
            assert CODEX is not None
            result = await run_harness(
                run_codex, CODEX, base, project, prompt, timeout_s=120, home_dir=home, **kw
            )
            assert result.ok, result.describe()
        body = await stack.get(f"/captures/rollouts/{rollout}/chains")
        summary = await stack.get(f"/captures/rollouts/{rollout}")
        calls = {
            c["call_id"]: await stack.get(f"/captures/calls/{c['call_id']}")
            for chain in body["chains"]
            for c in chain["calls"]
        }
    assert body["unlinked_calls"] == []
    # the session evidence lineage checks (harness_notes.codex.SESSION): the compaction's
    # calls and the resumed turn name one thread in ``prompt_cache_key``
    assert len({c["request_received"]["prompt_cache_key"] for c in calls.values()}) == 1
    (summary_call,) = [
        c for c in calls.values() if COMPACT_INSTRUCTION in _text(c["request_messages"][-1])
    ]
    # The summary call's link is refused, so it starts a chain of its own, which replays the
    # first call's history. Backend-template mode: the engine re-renders the first answer (its
    # reasoning). Exact-token mode: Codex sends the summary request without the tools, which
    # the parent's tokens show in the prompt's head, so it is rendered whole, not spliced.
    first, summarised, after = body["chains"]
    assert summary_call["linking"]["verdict"] == "refused"
    if prompt_mode == "exact_tokens":
        assert (len(calls[first["chain_id"]]["request_tools"]), summary_call["request_tools"]) == (
            8,
            None,
        )
        refused = [d for d in summary_call["diagnostics"] if d["kind"] == "exact_prompt_refused"]
        assert [d["details"]["reason"] for d in refused] == [
            "the harness changed the tools since the parent's request: the prompt is rendered whole"
        ]
    assert summarised["chain_id"] == summary_call["call_id"]
    (replay,) = summarised["lineage"]
    assert (replay["kind"], replay["chain_id"], replay["from_call_id"]) == (
        "forked_from",
        first["chain_id"],
        first["chain_id"],
    )
    assert replay["evidence"]["rule"] == "generic.history_replayed"
    assert replay["evidence"]["next_role"] == "tool"
    assert summary_call["call_id"] in [c["call_id"] for c in summarised["calls"]]
    assert first["lineage"] == []
    (edge,) = after["lineage"]
    assert (edge["kind"], edge["chain_id"], edge["from_call_id"]) == (
        "compacted_from",
        summarised["chain_id"],
        summary_call["call_id"],
    )
    assert edge["evidence"]["rule"] == "codex.summary_request"
    assert edge["evidence"]["replaces_chain_id"] == summarised["chain_id"]
    carried = summary_call["response_message"]["content"]
    assert edge["evidence"]["num_chars"] == len(carried)
    assert carried in _text(
        calls[after["chain_id"]]["request_messages"][edge["evidence"]["message_index"]]
    )

    # the resumed turn continues the compacted session's chain by tokens
    hello = after["calls"][-1]
    assert _text(calls[hello["call_id"]]["request_messages"][-1]) == "Say hello."
    assert calls[hello["call_id"]]["response_message"]["content"] == "Hello."
    by_id = {c["call_id"]: c for c in after["calls"]}
    assert hello["parent_call_id"] in by_id and extends(hello, by_id[hello["parent_call_id"]])
    assert summary["lineage"]["compacted_from"] == 1
    assert sum(summary["lineage"].values()) == 2
