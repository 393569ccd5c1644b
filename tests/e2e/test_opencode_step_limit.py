"""Tier 3: the real OpenCode CLI hits its step limit through the proxy (``agent.build.steps: 3``).

Same stack as ``test_opencode_e2e.py`` (scripted engine, real proxy, temporary SQLite store),
with ``capture_proxy/policies/opencode_step_limit.json``: the scripted model calls a tool on
every step, so OpenCode appends its step-limit note (an assistant message the model never
wrote) as the last message of the 3rd agent request. The proxy forwards the note to the engine
as a USER message; the policy's rule answers it with text, which ends the turn.

A ``run -c`` follow-up then carries the model's real reply where the note was: it resolves by
digest to the note call, but its tokens do not extend that call's prompt (which held the note),
so the link is refused (``parent_digest_mismatch``, ``history_edited``) and a new chain starts:
fail closed. The follow-up's later calls link again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from capture_proxy.config import Settings
from capture_proxy.proxy.app import build_proxy_app
from capture_proxy.scripted_engine.app import (
    SENT_CALLS,
    ScriptedEngineConfig,
    build_scripted_engine_app,
)
from capture_proxy.scripted_engine.policy import Policy
from capture_proxy.store.sqlite import SQLiteStore
from harness_notes.opencode import STEP_LIMIT_NOTE_TEXT
from tests.e2e.test_opencode_e2e import NOTES_LINES, OPENCODE, _get, _opencode, _sent_for

pytestmark = [
    pytest.mark.opencode,
    pytest.mark.timeout(360),
    pytest.mark.skipif(
        OPENCODE is None,
        reason="OpenCode CLI not installed (run scripts/install-opencode, or set OPENCODE_BIN)",
    ),
]

POLICY_PATH = (
    Path(__file__).resolve().parents[2] / "capture_proxy" / "policies" / "opencode_step_limit.json"
)
ROLLOUT = "e2e-opencode-steplimit-0"
STEPS = 3


async def test_opencode_step_limit_note_is_rewritten_and_follow_up_fails_closed(
    aiohttp_server, aiohttp_client, qwen_tokenizer, tmp_path: Path
) -> None:
    policy = Policy.load(POLICY_PATH)
    engine_app = build_scripted_engine_app(ScriptedEngineConfig(policy=policy), qwen_tokenizer)
    engine = await aiohttp_server(engine_app, host="127.0.0.1", port=0)
    settings = Settings.model_validate(
        {"backend": f"http://127.0.0.1:{engine.port}", "store": tmp_path / "store"}
    )
    proxy = await aiohttp_server(
        build_proxy_app(settings, SQLiteStore(tmp_path / "store")), host="127.0.0.1", port=0
    )
    client = await aiohttp_client(proxy)
    base_url = f"http://127.0.0.1:{proxy.port}/ng-rollout/{ROLLOUT}/training-token-capture/v1"
    sent = engine_app[SENT_CALLS]

    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    (project / "notes.txt").write_text("\n".join(NOTES_LINES) + "\n", encoding="utf-8")

    # turn 1: a new session (title + read, bash, then the note on the 3rd agent request)
    t0 = time.monotonic()
    first = await _opencode(
        project, home, base_url, "Read notes.txt, then list the files.", steps=STEPS
    )
    answer = policy.rules[0].step.content
    assert policy.steps[0].content in first.stdout and answer in first.stdout, first.describe()
    # turn 2: `run -c`; OpenCode counts steps per user turn, so it hits the limit again
    second = await _opencode(
        project, home, base_url, "Do it again, please.", steps=STEPS, continue_session=True
    )
    assert answer in second.stdout, second.describe()

    # Name the calls: the title request (no tools) and the agent calls in engine arrival order.
    assert len(sent) == 1 + 2 * STEPS, [len(s.prompt_token_ids) for s in sent]
    body = await _get(client, f"/captures/rollouts/{ROLLOUT}/chains")
    calls = {c["call_id"]: c for ch in body["chains"] for c in ch["calls"]}
    assert len(calls) == len(sent)
    index = {cid: sent.index(_sent_for(sent, c["prompt_token_ids"])) for cid, c in calls.items()}
    title_ids = [cid for cid in calls if not sent[index[cid]].request_body.get("tools")]
    assert len(title_ids) == 1, "one title request: a continued session sends none"
    agent_ids = sorted((cid for cid in calls if cid not in title_ids), key=index.__getitem__)
    label = {title_ids[0]: "title"} | {cid: f"a{i}" for i, cid in enumerate(agent_ids, start=1)}
    by_label = {label[cid]: calls[cid] for cid in calls}
    a = {n: by_label[n]["call_id"] for n in by_label}

    # The exact chain list. Title and a1 are sent in parallel, so the order of those two roots
    # is the proxy's arrival order; everything else is fixed.
    chains = [[label[c["call_id"]] for c in ch["calls"]] for ch in body["chains"]]
    assert sorted(chains) == [["a1", "a2", "a3"], ["a4", "a5", "a6"], ["title"]], chains
    assert [c for c in chains if c != ["title"]] == [["a1", "a2", "a3"], ["a4", "a5", "a6"]]
    assert {ch["chain_id"] for ch in body["chains"]} == {a["title"], a["a1"], a["a4"]}
    assert body["unlinked_calls"] == [] and body["incomplete"] is False
    kinds = {"harness_note_rewritten": 2, "parent_digest_mismatch": 1}
    assert body["diagnostics"] == {"rollout": [], "calls_by_kind": kinds}

    # Every call carries exactly what the engine sampled; OpenCode streamed every call.
    for cid, call in calls.items():
        s = sent[index[cid]]
        assert call["status"] == "complete" and call["stream"] is True, label[cid]
        assert call["generation_token_ids"] == s.generation_token_ids, label[cid]
        assert call["generation_log_probs"] == pytest.approx(s.generation_log_probs)

    # Link verdicts, exactly. A rewritten note implies OpenCode sent it as an ASSISTANT
    # message: the registry matches only a trailing assistant message that is just the note.
    note_diag = [("harness_note_rewritten", {"note": "opencode.step_limit"})]
    expected = {
        "title": ("root", None, None, None, []),
        "a1": ("root", None, None, None, []),
        "a2": ("resolved", "a1", "a1", None, []),
        "a3": ("resolved", "a2", "a2", "opencode.step_limit", note_diag),
        "a4": ("refused", None, "a3", None, None),  # diagnostics checked below
        "a5": ("resolved", "a4", "a4", None, []),
        "a6": ("resolved", "a5", "a5", "opencode.step_limit", note_diag),
    }
    for name, (verdict, parent, digest_parent, note, diags) in expected.items():
        call = by_label[name]
        linking = call["linking"]
        got = (
            linking["verdict"],
            label.get(call["parent_call_id"]),
            label.get(linking["digest_parent_call_id"]),
            linking["harness_note"],
        )
        assert got == (verdict, parent, digest_parent, note), (name, linking)
        if diags is not None:
            assert [(d["kind"], d["details"]) for d in call["diagnostics"]] == diags, name
        if parent is not None:  # a link is a token prefix, with new tokens in between
            head = by_label[parent]["prompt_token_ids"] + by_label[parent]["generation_token_ids"]
            assert call["prompt_token_ids"][: len(head)] == head, name
            assert len(call["prompt_token_ids"]) > len(head), name

    # The note reached the engine as the LAST message, in the user role, with the exact text,
    # on a3 and a6 only; the stored record holds the messages as forwarded.
    note_msg = {"role": "user", "content": STEP_LIMIT_NOTE_TEXT}
    for name in ("a3", "a6"):
        assert sent[index[a[name]]].request_body["messages"][-1] == note_msg, name
        detail = await _get(client, f"/captures/calls/{a[name]}")
        assert detail["request_messages"][-1] == note_msg
        assert {t["function"]["name"] for t in detail["request_tools"]} >= {"read", "bash"}
        assert by_label[name]["response_message"]["content"] == answer
        assert not by_label[name]["response_message"].get("tool_calls")
    for cid in calls:
        if label[cid] not in ("a3", "a6"):
            messages = sent[index[cid]].request_body["messages"]
            assert all(m.get("content") != STEP_LIMIT_NOTE_TEXT for m in messages), label[cid]

    # a4 (the follow-up's first call): where a3's request held the note, a4's history holds
    # the model's real reply. It resolves by digest to a3, but its tokens do not extend a3's
    # prompt + generation: refused, fail closed, a new chain. They differ exactly where the
    # note began: after a2's output and its tool result, inside a3's prompt.
    a4_messages = sent[index[a["a4"]]].request_body["messages"]
    assert a4_messages[-2] == {"role": "assistant", "content": answer}
    assert a4_messages[-1] == {"role": "user", "content": '"Do it again, please."'}
    (mismatch,) = by_label["a4"]["diagnostics"]
    assert mismatch["kind"] == "parent_digest_mismatch"
    details = mismatch["details"]
    assert (details["class"], details["parent_call_id"]) == ("history_edited", a["a3"])
    a2, a3, a4 = by_label["a2"], by_label["a3"], by_label["a4"]
    a3_head = a3["prompt_token_ids"] + a3["generation_token_ids"]
    pos = details["position"]
    assert a4["prompt_token_ids"][:pos] == a3_head[:pos]
    assert a4["prompt_token_ids"][pos] != a3_head[pos]
    assert len(a2["prompt_token_ids"]) + len(a2["generation_token_ids"]) < pos
    assert pos < len(a3["prompt_token_ids"])

    summary = await _get(client, f"/captures/rollouts/{ROLLOUT}")
    assert (summary["num_calls"], summary["num_complete"]) == (7, 7), summary
    assert (summary["num_incomplete"], summary["num_failed"]) == (0, 0), summary
    assert (summary["num_chains"], summary["num_roots"], summary["num_branches"]) == (3, 3, 0)
    assert summary["incomplete"] is False
    assert summary["diagnostics"] == {"rollout": [], "calls_by_kind": kinds}
    stats = summary["linking"]
    assert stats["verdicts"] == {"refused": 1, "resolved": 4, "root": 2}, stats
    assert stats["links_resolved"] == 4 and stats["links_refused"] == {"history_edited": 1}
    assert stats["links_unresolved"] == {} and stats["retries"] == 0
    assert stats["harness_notes_rewritten"] == 2

    print(
        f"\nopencode step-limit e2e: {time.monotonic() - t0:.1f}s "
        f"(runs {first.duration_s:.1f}s + {second.duration_s:.1f}s); chains: {chains}; "
        f"a4 refused at token {pos} (a3 prompt {len(a3['prompt_token_ids'])})"
    )
