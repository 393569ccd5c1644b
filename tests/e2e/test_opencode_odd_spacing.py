"""Tier 3: the scripted model writes tool-call JSON with odd spacing; the real OpenCode CLI
sends it back re-serialised.

Same stack as ``test_opencode_e2e.py``, with ``capture_proxy/policies/opencode_odd_spacing.json``:
the first agent call writes ``<tool_call>`` arguments as ``{ "filePath" :  "notes.txt" }``
(``arguments_raw``), then ``bash`` with ordinary JSON, then an answer. OpenCode gets
normalised JSON arguments either way (the scripted engine parses them like vLLM's Hermes
parser; in exact-token mode the proxy's own parser does), runs the tool, and sends the turn
back with its own compact serialisation. The digest (canonical JSON) still finds a1 as a2's
parent; what happens next depends on the prompt mode:

- ``backend_template``: the engine re-renders a1's tool call with ``tojson``, not as the model
  wrote it, so a2's tokens do not extend a1's: refused (``parent_digest_mismatch``, class
  ``template_rerendered``), a new chain. Chains: [a1], [a2, a3].
- ``exact_tokens``: a2's prompt is a1's own tokens + the tool result: one chain [a1, a2, a3].
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from capture_proxy.scripted_engine.policy import Policy
from tests.e2e.test_opencode_e2e import (
    NOTES_LINES,
    OPENCODE,
    PROMPT_MODES,
    _check_turn_tools,
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
    Path(__file__).resolve().parents[2] / "capture_proxy" / "policies" / "opencode_odd_spacing.json"
)
ROLLOUT = "e2e-opencode-oddspacing-0"
RAW_ARGUMENTS = '{ "filePath" :  "notes.txt" }'

# Per prompt mode: the agent chains, diagnostics by kind, summary verdicts and refused links.
EXPECTED = {
    "backend_template": {
        "chains": [["a1"], ["a2", "a3"]],
        "kinds": {"parent_digest_mismatch": 1},
        "linking": {
            "a1": ("root", None, None),
            "a2": ("refused", None, "a1"),
            "a3": ("resolved", "a2", "a2"),
        },
        "verdicts": {"refused": 1, "resolved": 1, "root": 2},
        "links_refused": {"template_rerendered": 1},
    },
    "exact_tokens": {
        "chains": [["a1", "a2", "a3"]],
        "kinds": {},
        "linking": {
            "a1": ("root", None, None),
            "a2": ("resolved", "a1", "a1"),
            "a3": ("resolved", "a2", "a2"),
        },
        "verdicts": {"resolved": 2, "root": 2},
        "links_refused": {},
    },
}


@pytest.mark.parametrize("prompt_mode", PROMPT_MODES)
async def test_opencode_odd_spacing_tool_call_json_per_mode(
    aiohttp_server, aiohttp_client, qwen_tokenizer, tmp_path: Path, prompt_mode: str
) -> None:
    expected = EXPECTED[prompt_mode]
    policy = Policy.load(POLICY_PATH)
    assert policy.steps[0].tool_calls[0].arguments_text() == RAW_ARGUMENTS
    stack = await start_stack(
        aiohttp_server,
        aiohttp_client,
        qwen_tokenizer,
        tmp_path,
        policy=policy,
        rollout=ROLLOUT,
        prompt_mode=prompt_mode,
    )
    client, sent = stack.client, stack.sent

    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    notes = (project / "notes.txt").resolve()
    notes.write_text("\n".join(NOTES_LINES) + "\n", encoding="utf-8")

    t0 = time.monotonic()
    run = await _opencode(project, home, stack.base_url, "Read notes.txt, then list the files.")
    assert policy.steps[-1].content in run.stdout, run.describe()

    # Name the calls: the title request (no tools) and the agent calls in engine arrival order.
    assert len(sent) == 4, [len(s.prompt_token_ids) for s in sent]
    body = await _get(client, f"/captures/rollouts/{ROLLOUT}/chains")
    calls = {c["call_id"]: c for ch in body["chains"] for c in ch["calls"]}
    assert len(calls) == len(sent)
    details = {cid: await _get(client, f"/captures/calls/{cid}") for cid in calls}
    index = {cid: sent.index(_sent_for(sent, c["prompt_token_ids"])) for cid, c in calls.items()}
    title_ids = [cid for cid in calls if not details[cid]["request_tools"]]
    assert len(title_ids) == 1
    agent_ids = sorted((cid for cid in calls if cid not in title_ids), key=index.__getitem__)
    label = {title_ids[0]: "title"} | {cid: f"a{i}" for i, cid in enumerate(agent_ids, start=1)}
    by_label = {label[cid]: calls[cid] for cid in calls}

    chains = [[label[c["call_id"]] for c in ch["calls"]] for ch in body["chains"]]
    assert [c for c in chains if c != ["title"]] == expected["chains"], chains
    assert ["title"] in chains
    assert body["unlinked_calls"] == [] and body["incomplete"] is False
    assert body["diagnostics"] == {"rollout": [], "calls_by_kind": expected["kinds"]}

    for cid, call in calls.items():
        s = sent[index[cid]]
        assert call["status"] == "complete" and call["stream"] is True, label[cid]
        assert call["generation_token_ids"] == s.generation_token_ids, label[cid]
        assert call["generation_log_probs"] == pytest.approx(s.generation_log_probs)
    check_engine_prompts(prompt_mode, list(calls.values()), sent)

    for name, (verdict, parent, digest_parent) in {
        "title": ("root", None, None),
        **expected["linking"],
    }.items():
        call = by_label[name]
        linking = call["linking"]
        got = (
            linking["verdict"],
            label.get(call["parent_call_id"]),
            label.get(linking["digest_parent_call_id"]),
        )
        assert got == (verdict, parent, digest_parent), (name, linking)
        if name != "a2" or prompt_mode == "exact_tokens":
            assert call["diagnostics"] == [], (name, call["diagnostics"])
        if parent is not None:
            head = by_label[parent]["prompt_token_ids"] + by_label[parent]["generation_token_ids"]
            assert call["prompt_token_ids"][: len(head)] == head, name
            assert len(call["prompt_token_ids"]) > len(head), name

    # The model wrote the odd spacing; OpenCode got normalised JSON (and ran the tool: the
    # read result and ls output are in the next requests), then sent its own serialisation.
    a1, a2 = by_label["a1"], by_label["a2"]
    assert RAW_ARGUMENTS in qwen_tokenizer.decode(a1["generation_token_ids"])
    (tool_call,) = a1["response_message"]["tool_calls"]
    assert tool_call["function"] == {"name": "read", "arguments": '{"filePath": "notes.txt"}'}
    _check_turn_tools([details[by_label[n]["call_id"]] for n in ("a1", "a2", "a3")], 0, notes)
    (echoed,) = [m for m in details[a2["call_id"]]["request_messages"] if m.get("tool_calls")]
    (echoed_call,) = echoed["tool_calls"]
    assert echoed_call["id"] == tool_call["id"]
    assert json.loads(echoed_call["function"]["arguments"]) == {"filePath": "notes.txt"}
    assert echoed_call["function"]["arguments"] != RAW_ARGUMENTS
    echoed_args = echoed_call["function"]["arguments"]

    a1_head = a1["prompt_token_ids"] + a1["generation_token_ids"]
    a2_text = qwen_tokenizer.decode(a2["prompt_token_ids"])
    if prompt_mode == "backend_template":
        # The engine rendered the call from OpenCode's JSON: the model's spacing is gone, and
        # the tokens part inside a1's generation.
        assert RAW_ARGUMENTS not in a2_text
        (mismatch,) = a2["diagnostics"]
        assert mismatch["kind"] == "parent_digest_mismatch"
        d = mismatch["details"]
        assert (d["class"], d["parent_call_id"]) == ("template_rerendered", a1["call_id"])
        pos = d["position"]
        assert a2["prompt_token_ids"][:pos] == a1_head[:pos]
        assert a2["prompt_token_ids"][pos] != a1_head[pos]
        assert len(a1["prompt_token_ids"]) <= pos < len(a1_head)
        where = f"a2 refused at token {pos} (a1 prompt {len(a1['prompt_token_ids'])})"
    else:
        # a2's prompt holds a1's own tokens, the odd spacing included, then the tool result.
        assert a2["prompt_token_ids"][: len(a1_head)] == a1_head
        assert RAW_ARGUMENTS in a2_text
        where = f"a2 extends a1 ({len(a1_head)} tokens)"

    summary = await _get(client, f"/captures/rollouts/{ROLLOUT}")
    num_chains = len(expected["chains"]) + 1
    assert (summary["num_calls"], summary["num_complete"]) == (4, 4), summary
    assert (summary["num_chains"], summary["num_roots"], summary["num_branches"]) == (
        num_chains,
        num_chains,
        0,
    )
    assert summary["incomplete"] is False
    assert summary["diagnostics"] == {"rollout": [], "calls_by_kind": expected["kinds"]}
    stats = summary["linking"]
    assert stats["verdicts"] == expected["verdicts"], stats
    assert stats["links_refused"] == expected["links_refused"], stats
    assert stats["links_unresolved"] == {} and stats["retries"] == 0

    print(
        f"\nopencode odd-spacing e2e [{prompt_mode}]: {time.monotonic() - t0:.1f}s "
        f"(run {run.duration_s:.1f}s); chains: {chains}; OpenCode echoed {echoed_args}; {where}"
    )
