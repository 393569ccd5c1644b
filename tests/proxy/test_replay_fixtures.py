"""Recorded OpenCode sessions replayed through the proxy (backend_template mode).

The scripted engine answers each request with what the recording answered, with real token ids;
the proxy resolves parents by digest and verifies them by tokens. Chain structures are exact,
per file, and every link decision is checked against the tokens themselves: a link exists
exactly where the child's prompt ids begin with the digest-parent's prompt + generation ids.
"""

from __future__ import annotations

import pytest

from capture_proxy.harnesses.recorded import load_recording, replay, replay_engine_config

NOTE = "harness_note_rewritten"
MISMATCH = "parent_digest_mismatch"

# file, template -> (chains as lists of recorded seq numbers, {seq: [(kind, class)]})
EXPECTED = {
    ("01_multistep", "keep_reasoning"): (
        # 5 is linked to 3, its deepest token-exact ancestor (a branch beside 4).
        [[1], [2, 3, 4, 5, 6, 7]],
        # seq 4 answered bash with deliberately non-canonical JSON ('{\n  "command" : ...');
        # OpenCode sends it back compact, the template re-renders it: the tokens do not chain.
        {5: [(MISMATCH, "template_rerendered")]},
    ),
    ("02_step_limit_obeyed", "keep_reasoning"): (
        [[1], [2, 3, 4, 5, 6, 7]],
        # seq 5 resolves by digest to the note call (4) but its history no longer has the note.
        {4: [(NOTE, None)], 5: [(MISMATCH, "history_edited")], 7: [(NOTE, None)]},
    ),
    ("03_step_limit_ignored", "keep_reasoning"): (
        [[1], [2, 3, 4, 5, 6, 7]],
        {
            4: [(NOTE, None)],
            5: [(NOTE, None), (MISMATCH, "history_edited")],
            6: [(NOTE, None), (MISMATCH, "history_edited")],
            7: [(NOTE, None), (MISMATCH, "history_edited")],
        },
    ),
    ("05_reasoning_default", "keep_reasoning"): ([[1], [2, 3, 4, 5]], {}),
    ("05_reasoning_default", "drop_reasoning"): (
        [[1], [2], [3], [4], [5]],
        {s: [(MISMATCH, "template_rerendered")] for s in (3, 4, 5)},
    ),
    ("06_reasoning_interleaved", "keep_reasoning"): ([[1], [2, 3, 4]], {}),
    ("06_reasoning_interleaved", "drop_reasoning"): (
        [[1], [2], [3], [4]],
        {s: [(MISMATCH, "template_rerendered")] for s in (3, 4)},
    ),
}


# Calls whose digest parent was refused and which are linked to their deepest token-exact
# ancestor instead (seq -> parent seq): they are branches of the chain, never roots.
PREFIX_LINKED = {
    ("01_multistep", "keep_reasoning"): {5: 3},
    ("02_step_limit_obeyed", "keep_reasoning"): {5: 3},
    ("03_step_limit_ignored", "keep_reasoning"): {5: 3, 6: 3, 7: 3},
}


@pytest.mark.parametrize(("name", "template"), list(EXPECTED), ids=lambda v: str(v))
async def test_recorded_session_chains(make_stack, fixtures_dir, name, template):
    recording = load_recording(fixtures_dir / "opencode" / "logs" / f"{name}.jsonl")
    config = replay_engine_config(recording, tokenizer_template=template)
    stack = await make_stack(engine_config=config)
    base = str(stack.client.make_url("/ng-rollout/rec-1/training-token-capture/v1"))
    calls = await replay(recording, base)
    assert [c.status for c in calls] == [200] * len(recording)
    seq_of = {c.call_id: c.seq for c in calls}

    chains = await stack.get_json("/captures/rollouts/rec-1/chains")
    expected_chains, expected_diags = EXPECTED[(name, template)]
    assert [
        [seq_of[c["call_id"]] for c in ch["calls"]] for ch in chains["chains"]
    ] == expected_chains
    assert chains["incomplete"] is False and chains["unlinked_calls"] == []
    prefix_linked = {
        seq_of[c["call_id"]]: seq_of[c["parent_call_id"]]
        for ch in chains["chains"]
        for c in ch["calls"]
        if c["linking"]["verdict"] == "prefix"
    }
    assert prefix_linked == PREFIX_LINKED.get((name, template), {})
    by_seq = {seq_of[c["call_id"]]: c for ch in chains["chains"] for c in ch["calls"]}
    for seq, call in by_seq.items():
        got = [(d["kind"], d["details"].get("class")) for d in call["diagnostics"]]
        assert got == expected_diags.get(seq, []), seq

    # Every link decision agrees with the tokens: a digest parent is kept exactly where the
    # tokens chain; where it is refused, the call is linked to its deepest token-exact
    # ancestor (verdict "prefix"), if it has one.
    def full(call: dict) -> list[int]:
        return call["prompt_token_ids"] + call["generation_token_ids"]

    def extends(call: dict, parent: dict) -> bool:
        prefix = full(parent)
        return call["prompt_token_ids"][: len(prefix)] == prefix

    for seq, call in by_seq.items():
        linking = call["linking"]
        digest_parent = linking["digest_parent_call_id"]
        if call["parent_call_id"] is not None:
            assert extends(call, by_seq[seq_of[call["parent_call_id"]]]), seq
        if digest_parent is None:
            assert linking["verdict"] == "root" and call["parent_call_id"] is None
            continue
        chains_by_tokens = extends(call, by_seq[seq_of[digest_parent]])
        if chains_by_tokens:
            assert linking["verdict"] == "resolved"
            assert call["parent_call_id"] == digest_parent, seq
            continue
        ancestors = [
            other for other in by_seq.values()
            if other is not call and other["generation_token_ids"] and extends(call, other)
        ]
        if not ancestors:
            assert linking["verdict"] == "refused" and call["parent_call_id"] is None, seq
            continue
        deepest = max(ancestors, key=lambda a: len(full(a)))
        assert linking["verdict"] == "prefix", seq
        assert call["parent_call_id"] == deepest["call_id"], seq

    # A rewritten note reached the engine as the last message, in the user role.
    for seq, diags in expected_diags.items():
        if (NOTE, None) in diags:
            sent = stack.sent[seq - 1].request_body["messages"][-1]
            assert sent == {
                "role": "user",
                "content": recording[seq - 1].body["messages"][-1]["content"],
            }

    # The title request (no tools) is always its own root.
    assert "tools" not in recording[0].body and expected_chains[0] == [1]
