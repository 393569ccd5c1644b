"""Tier 3: the real OpenCode CLI hits its step limit through the proxy (``agent.build.steps: 3``).

Same stack as ``test_opencode_e2e.py`` (scripted engine, real proxy, temporary SQLite store),
with ``capture_proxy/policies/opencode_step_limit.json``: the scripted model calls a tool on
every step, so OpenCode appends its step-limit note (an assistant message the model never
wrote) as the last message of the 3rd agent request. The proxy forwards the note to the engine
as a USER message; the policy's rule answers it with text, which ends the turn.

A ``run -c`` follow-up then carries the model's real reply where the note was: it resolves by
digest to the note call (a3). What happens next depends on the prompt mode:

- ``backend_template``: the engine renders the follow-up's history, without the note, so its
  tokens do not extend a3's prompt (which held the note): the link is refused
  (``parent_digest_mismatch``, ``history_edited``), fail closed, and a4 is linked to its
  deepest token-exact ancestor, a2 (verdict ``prefix``): a branch beside a3. The follow-up's
  later calls link again: one chain [a1 .. a6], a2 <- a3, a2 <- a4 <- a5 <- a6.
- ``exact_tokens``: the proxy builds a4's prompt from a3's own tokens (prompt, with the note
  as a user turn, + generation) and the rendering of the new user turn, so the note's tokens
  stay in the history the model saw and the link is exact: one chain [a1 .. a6].
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from capture_proxy.scripted_engine.policy import Policy
from harness_notes.opencode import STEP_LIMIT_NOTE_TEXT
from tests.e2e.test_opencode_e2e import (
    NOTES_LINES,
    OPENCODE,
    PROMPT_MODES,
    _get,
    _opencode,
    _sent_for,
    check_engine_prompts,
    start_stack,
)

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
NOTE_DIAG = [("harness_note_rewritten", {"note": "opencode.step_limit"})]
NOTE_USER_TURN = f"<|im_start|>user\n{STEP_LIMIT_NOTE_TEXT}<|im_end|>\n"

# Per prompt mode: the chains (agent calls in engine arrival order), the diagnostics by kind,
# each call's (verdict, parent, digest parent, harness note, diagnostics or None = checked
# separately), the summary's verdict counts and refused links, and how many times the note is
# in each call's prompt as the engine saw it.
EXPECTED = {
    "backend_template": {
        # a4's digest parent a3 is refused (its history no longer holds the note); a4 is
        # linked to its deepest token-exact ancestor, a2 (verdict prefix): a branch beside a3
        "chains": [["a1", "a2", "a3", "a4", "a5", "a6"]],
        "branches": 1,
        "kinds": {"harness_note_rewritten": 2, "parent_digest_mismatch": 1},
        "linking": {
            "a1": ("root", None, None, None, []),
            "a2": ("resolved", "a1", "a1", None, []),
            "a3": ("resolved", "a2", "a2", "opencode.step_limit", NOTE_DIAG),
            "a4": ("prefix", "a2", "a3", None, None),  # parent_digest_mismatch, below
            "a5": ("resolved", "a4", "a4", None, []),
            "a6": ("resolved", "a5", "a5", "opencode.step_limit", NOTE_DIAG),
        },
        "verdicts": {"prefix": 1, "resolved": 4, "root": 2},
        "links_refused": {"history_edited": 1},
        # the engine rendered a4's history from OpenCode's messages: the note is gone
        "notes_in_prompt": {"a1": 0, "a2": 0, "a3": 1, "a4": 0, "a5": 0, "a6": 1},
    },
    "exact_tokens": {
        "chains": [["a1", "a2", "a3", "a4", "a5", "a6"]],
        "branches": 0,
        "kinds": {"harness_note_rewritten": 2},
        "linking": {
            "a1": ("root", None, None, None, []),
            "a2": ("resolved", "a1", "a1", None, []),
            "a3": ("resolved", "a2", "a2", "opencode.step_limit", NOTE_DIAG),
            "a4": ("resolved", "a3", "a3", None, []),
            "a5": ("resolved", "a4", "a4", None, []),
            "a6": ("resolved", "a5", "a5", "opencode.step_limit", NOTE_DIAG),
        },
        "verdicts": {"resolved": 5, "root": 2},
        "links_refused": {},
        # a4..a6 extend a3's tokens, note included; a6 carries a second note of its own
        "notes_in_prompt": {"a1": 0, "a2": 0, "a3": 1, "a4": 1, "a5": 1, "a6": 2},
    },
}


@pytest.mark.parametrize("prompt_mode", PROMPT_MODES)
async def test_opencode_step_limit_note_is_rewritten_and_follow_up_links_per_mode(
    aiohttp_server, aiohttp_client, qwen_tokenizer, tmp_path: Path, prompt_mode: str
) -> None:
    expected = EXPECTED[prompt_mode]
    policy = Policy.load(POLICY_PATH)
    stack = await start_stack(
        aiohttp_server,
        aiohttp_client,
        qwen_tokenizer,
        tmp_path,
        policy=policy,
        rollout=ROLLOUT,
        prompt_mode=prompt_mode,
    )
    client, base_url, sent = stack.client, stack.base_url, stack.sent

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
    details = {cid: await _get(client, f"/captures/calls/{cid}") for cid in calls}
    index = {cid: sent.index(_sent_for(sent, c["prompt_token_ids"])) for cid, c in calls.items()}
    title_ids = [cid for cid in calls if not details[cid]["request_tools"]]
    assert len(title_ids) == 1, "one title request: a continued session sends none"
    agent_ids = sorted((cid for cid in calls if cid not in title_ids), key=index.__getitem__)
    label = {title_ids[0]: "title"} | {cid: f"a{i}" for i, cid in enumerate(agent_ids, start=1)}
    by_label = {label[cid]: calls[cid] for cid in calls}
    a = {n: by_label[n]["call_id"] for n in by_label}

    # The exact chain list. Title and a1 are sent in parallel, so the order of those two roots
    # is the proxy's arrival order; everything else is fixed.
    chains = [[label[c["call_id"]] for c in ch["calls"]] for ch in body["chains"]]
    assert sorted(chains) == sorted([*expected["chains"], ["title"]]), chains
    assert [c for c in chains if c != ["title"]] == expected["chains"]
    assert {ch["chain_id"] for ch in body["chains"]} == {a["title"]} | {
        a[ch[0]] for ch in expected["chains"]
    }
    assert body["unlinked_calls"] == [] and body["incomplete"] is False
    assert body["diagnostics"] == {"rollout": [], "calls_by_kind": expected["kinds"]}

    # Every call carries exactly what the engine sampled; OpenCode streamed every call. In
    # exact-token mode the engine got the stored prompt ids, and each child extends its parent.
    for cid, call in calls.items():
        s = sent[index[cid]]
        assert call["status"] == "complete" and call["stream"] is True, label[cid]
        assert call["generation_token_ids"] == s.generation_token_ids, label[cid]
        assert call["generation_log_probs"] == pytest.approx(s.generation_log_probs)
    check_engine_prompts(prompt_mode, list(calls.values()), sent)

    # Link verdicts, exactly. A rewritten note implies OpenCode sent it as an ASSISTANT
    # message: the registry matches only a trailing assistant message that is just the note.
    expected_linking = {"title": ("root", None, None, None, []), **expected["linking"]}
    for name, (verdict, parent, digest_parent, note, diags) in expected_linking.items():
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

    # The note reached the engine as the LAST turn, in the user role, with the exact text, on
    # a3 and a6 only; the stored record holds the messages as forwarded. Where else the note's
    # tokens are depends on the mode (EXPECTED["notes_in_prompt"]).
    note_msg = {"role": "user", "content": STEP_LIMIT_NOTE_TEXT}
    prompts = {
        name: qwen_tokenizer.decode(by_label[name]["prompt_token_ids"])
        for name in expected["notes_in_prompt"]
    }
    for name in ("a3", "a6"):
        assert prompts[name].endswith(NOTE_USER_TURN + "<|im_start|>assistant\n"), name
        if prompt_mode == "backend_template":
            assert sent[index[a[name]]].request_body["messages"][-1] == note_msg, name
        detail = details[a[name]]
        assert detail["request_messages"][-1] == note_msg
        assert {t["function"]["name"] for t in detail["request_tools"]} >= {"read", "bash"}
        assert by_label[name]["response_message"]["content"] == answer
        assert not by_label[name]["response_message"].get("tool_calls")
    for cid in calls:
        if label[cid] not in ("a3", "a6"):
            messages = details[cid]["request_messages"]
            assert all(m.get("content") != STEP_LIMIT_NOTE_TEXT for m in messages), label[cid]
    notes_in_prompt = {name: text.count(NOTE_USER_TURN) for name, text in prompts.items()}
    assert notes_in_prompt == expected["notes_in_prompt"]

    # a4 (the follow-up's first call): where a3's request held the note, a4's history holds
    # the model's real reply. It resolves by digest to a3.
    a4_messages = details[a["a4"]]["request_messages"]
    assert a4_messages[-2] == {"role": "assistant", "content": answer}
    assert a4_messages[-1] == {"role": "user", "content": '"Do it again, please."'}
    a2, a3, a4 = by_label["a2"], by_label["a3"], by_label["a4"]
    a3_head = a3["prompt_token_ids"] + a3["generation_token_ids"]
    if prompt_mode == "backend_template":
        # Its tokens do not extend a3's prompt + generation: the link is refused (fail closed)
        # and a4 hangs on a2, its deepest token-exact ancestor. They differ exactly where the
        # note began: after a2's output and its tool result, inside a3's prompt.
        (mismatch,) = a4["diagnostics"]
        assert mismatch["kind"] == "parent_digest_mismatch"
        mismatch_details = mismatch["details"]
        assert (mismatch_details["class"], mismatch_details["parent_call_id"]) == (
            "history_edited",
            a["a3"],
        )
        pos = mismatch_details["position"]
        assert a4["prompt_token_ids"][:pos] == a3_head[:pos]
        assert a4["prompt_token_ids"][pos] != a3_head[pos]
        assert len(a2["prompt_token_ids"]) + len(a2["generation_token_ids"]) < pos
        assert pos < len(a3["prompt_token_ids"])
        where = f"a4 refused at token {pos}"
    else:
        # a4's prompt is a3's prompt (note as a user turn) + a3's generation + the new user turn.
        assert a4["prompt_token_ids"][: len(a3_head)] == a3_head
        tail = qwen_tokenizer.decode(a4["prompt_token_ids"][len(a3_head) :])
        assert tail == (
            '\n<|im_start|>user\n"Do it again, please."<|im_end|>\n<|im_start|>assistant\n'
        ), tail
        where = (
            f"a4 extends a3 ({len(a3_head)} tokens) by {len(a4['prompt_token_ids']) - len(a3_head)}"
        )

    summary = await _get(client, f"/captures/rollouts/{ROLLOUT}")
    num_chains = len(expected["chains"]) + 1
    assert (summary["num_calls"], summary["num_complete"]) == (7, 7), summary
    assert (summary["num_incomplete"], summary["num_failed"]) == (0, 0), summary
    assert (summary["num_chains"], summary["num_roots"], summary["num_branches"]) == (
        num_chains,
        num_chains,
        expected["branches"],
    )
    assert summary["incomplete"] is False
    assert summary["diagnostics"] == {"rollout": [], "calls_by_kind": expected["kinds"]}
    stats = summary["linking"]
    assert stats["verdicts"] == expected["verdicts"], stats
    assert stats["links_resolved"] == expected["verdicts"]["resolved"]
    assert stats["links_refused"] == expected["links_refused"], stats
    assert stats["links_unresolved"] == {} and stats["retries"] == 0
    assert stats["harness_notes_rewritten"] == 2

    print(
        f"\nopencode step-limit e2e [{prompt_mode}]: {time.monotonic() - t0:.1f}s "
        f"(runs {first.duration_s:.1f}s + {second.duration_s:.1f}s); chains: {chains}; "
        f"{where} (a3 prompt {len(a3['prompt_token_ids'])})"
    )
