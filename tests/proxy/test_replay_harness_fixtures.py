"""Real Codex CLI and Claude Code sessions recorded THROUGH the proxy, replayed through a fresh one.

``tests/fixtures/{codex,claude_code}/02_through_proxy.jsonl`` were recorded by
``tests/support/record_proxy_fixtures.py`` (``serve --record-dir``, backend-template mode; the
e2e tests' task and policy): 4 Responses calls of Codex 0.169.0 (``exec_command ls``, ``cat``,
``apply_patch``, answer) and 4 Messages calls of Claude Code 2.1.328 (``Bash ls``, ``Read``,
``Edit``, answer). The scripted engine answers each request with what the recording answered
(``RecordedResponder``), with real token ids, so the suite keeps both harnesses' shapes
without their binaries: Codex's reasoning items with sealed ``encrypted_content``, custom tool
calls; Claude Code's ``role: "system"`` message inside ``messages`` (a block list, then a
string), omitted thinking with sealed signatures, and its rebuilt ``Edit`` input.

Chain structures are exact, per file and prompt mode, and every link is checked against the
tokens: a kept link is token-exact; a refused digest parent is not, and the call is linked to
its deepest token-exact ancestor (verdict ``prefix``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.harnesses.recorded import load_recording, replay, replay_engine_config
from tests.proxy.conftest import MakeStack

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MAX_MODEL_LEN = 32768  # ScriptedEngineConfig's default
REWRITTEN = ("turn_rewritten", None)
MISMATCH = ("parent_digest_mismatch", "template_rerendered")
CLAMPED = ("max_tokens_clamped", None)
#: Codex offers its sub-agent tools as a namespace, which the engine cannot render
NOT_RENDERED = ("tools_not_rendered", None)
CODEX_NOTE = {seq: [NOT_RENDERED] for seq in (1, 2, 3, 4)}

# (harness, prompt mode) -> ({seq: parent seq (None: root)}, {seq: verdict},
#                            {seq: [(diagnostic kind, class)]})
EXPECTED: dict[tuple[str, str], tuple[dict, dict, dict]] = {
    # Codex hands every answer back as given: one exact chain, nothing diagnosed but the
    # namespace tools left out.
    ("codex", "backend_template"): (
        {1: None, 2: 1, 3: 2, 4: 3},
        {1: "root", 2: "resolved", 3: "resolved", 4: "resolved"},
        CODEX_NOTE,
    ),
    ("codex", "exact_tokens"): (
        {1: None, 2: 1, 3: 2, 4: 3},
        {1: "root", 2: "resolved", 3: "resolved", 4: "resolved"},
        CODEX_NOTE,
    ),
    # Claude Code rebuilds Edit's input ({"replace_all": false, ...} first): the 4th call's
    # digest parent (3, the Edit call) is found by its tool-call ids (turn_rewritten); the
    # template renders the rebuilt input, the tokens do not chain, the link is refused
    # (template_rerendered) and 4 is linked to its deepest token-exact ancestor, 2 (Read).
    ("claude_code", "backend_template"): (
        {1: None, 2: 1, 3: 2, 4: 2},
        {1: "root", 2: "resolved", 3: "resolved", 4: "prefix"},
        {4: [REWRITTEN, MISMATCH]},
    ),
    # Exact tokens: the proxy splices Edit's own tokens, the link is kept. Claude Code asks
    # max_tokens 32000, more than the context left: clamped on every call.
    ("claude_code", "exact_tokens"): (
        {1: None, 2: 1, 3: 2, 4: 3},
        {1: "root", 2: "resolved", 3: "resolved", 4: "resolved"},
        {1: [CLAMPED], 2: [CLAMPED], 3: [CLAMPED], 4: [CLAMPED, REWRITTEN]},
    ),
}


def _full(call: dict[str, Any]) -> list[int]:
    return call["prompt_token_ids"] + call["generation_token_ids"]


def _extends(call: dict[str, Any], parent: dict[str, Any]) -> bool:
    head = _full(parent)
    return call["prompt_token_ids"][: len(head)] == head


@pytest.mark.parametrize(("harness", "prompt_mode"), list(EXPECTED), ids=lambda v: str(v))
async def test_recorded_harness_session_chains(
    make_stack: MakeStack, harness: str, prompt_mode: str
) -> None:
    path = FIXTURES / harness / "02_through_proxy.jsonl"
    recording = load_recording(path)
    api = "responses" if harness == "codex" else "messages"
    assert [r.seq for r in recording] == [1, 2, 3, 4]
    assert all(r.api.value == api and r.body["stream"] is True for r in recording)
    # recorded with the credentials redacted: the fixture holds no key
    assert "sk-" not in "".join(v for r in recording for _, v in r.headers)

    config = replay_engine_config(recording)
    stack = await make_stack(engine_config=config, prompt_mode=prompt_mode)
    rollout = f"rec-{harness}"
    base = str(stack.client.make_url(f"/ng-rollout/{rollout}/training-token-capture/v1"))
    calls = await replay(recording, base)
    assert [c.status for c in calls] == [200] * len(recording)
    seq_of = {c.call_id: c.seq for c in calls}

    body = await stack.get_json(f"/captures/rollouts/{rollout}/chains")
    assert body["incomplete"] is False and body["unlinked_calls"] == []
    (chain,) = body["chains"]
    assert [seq_of[c["call_id"]] for c in chain["calls"]] == [1, 2, 3, 4]
    by_seq = {seq_of[c["call_id"]]: c for c in chain["calls"]}
    parents, verdicts, diagnostics = EXPECTED[(harness, prompt_mode)]
    assert {
        s: seq_of.get(c["parent_call_id"]) if c["parent_call_id"] else None
        for s, c in by_seq.items()
    } == parents
    assert {s: c["linking"]["verdict"] for s, c in by_seq.items()} == verdicts
    for seq, call in by_seq.items():
        assert call["api"] == api and call["status"] == "complete", seq
        got = [(d["kind"], d["details"].get("class")) for d in call["diagnostics"]]
        assert got == diagnostics.get(seq, []), seq
        for d in call["diagnostics"]:
            if d["kind"] == "max_tokens_clamped":
                assert d["details"] == {
                    "requested": 32000,
                    "max_tokens": MAX_MODEL_LEN - call["num_prompt_tokens"],
                }
            elif d["kind"] == "turn_rewritten":
                assert seq_of[d["details"]["parent_call_id"]] == seq - 1
            elif d["kind"] == "tools_not_rendered":
                assert d["details"] == {"tools": [{"type": "namespace", "name": "multi_agent_v1"}]}

    # every link is token-exact; where a digest parent was refused, the tokens say why, and
    # the call hangs on the deepest call it does extend
    for seq, call in by_seq.items():
        if call["parent_call_id"] is not None:
            assert _extends(call, by_seq[parents[seq]]), seq
        digest_parent = call["linking"]["digest_parent_call_id"]
        if digest_parent is None:
            assert seq == 1
            continue
        assert seq_of[digest_parent] == seq - 1
        if call["linking"]["verdict"] == "prefix":
            assert not _extends(call, by_seq[seq - 1]), seq
            deepest = max(
                (o for s, o in by_seq.items() if s != seq and _extends(call, o)),
                key=lambda o: len(_full(o)),
            )
            assert deepest["call_id"] == call["parent_call_id"], seq

    if harness == "claude_code":
        # the Edit input came back rebuilt, in every mode, as the recording holds it
        edit_use = recording[3].body["messages"][-2]["content"][-1]
        assert edit_use["name"] == "Edit"
        assert list(edit_use["input"])[0] == "replace_all"
        assert edit_use["input"]["replace_all"] is False
        detail = await stack.get_json(f"/captures/calls/{chain['calls'][3]['call_id']}")
        (echoed,) = detail["request_messages"][-2]["tool_calls"]
        assert json.loads(echoed["function"]["arguments"])["replace_all"] is False
