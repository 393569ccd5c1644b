"""The verification step without an event loop: the commands it asks, the record it returns."""

from __future__ import annotations

import numpy as np
import pytest

from capture_proxy.core.linking import verdicts
from capture_proxy.core.linking.commands import Detokenize, FindPrefixAncestor, ReadParent
from capture_proxy.core.linking.digests import (
    child_digest,
    child_digest_after,
    history_digest,
    request_digest,
)
from capture_proxy.core.linking.index import LinkIndex, add_record
from capture_proxy.core.linking.parent_lookup import resolve_step
from capture_proxy.core.linking.resolution import Candidate, Resolution
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.linking.verification import verify_step
from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic, DiagnosticKind
from tests.core.linking.steps import play

USER = {"role": "user", "content": "list the files"}
ANSWER = {"role": "assistant", "content": "ls"}
HISTORY = [USER, ANSWER, {"role": "user", "content": "and now?"}]
BODY = {"model": "m", "messages": HISTORY}
PARENT_DIGEST = history_digest(HISTORY)
REQUEST_DIGEST = request_digest(BODY)
CHILD_ANSWER = {"content": "done"}


def _record(call_id: str, prompt: list[int], generation: list[int], **fields) -> CallRecord:
    return CallRecord(
        call_id=call_id,
        rollout_id="r1",
        created_at=float(len(prompt)),
        model="m",
        prompt_token_ids=np.asarray(prompt, np.uint32),
        generation_token_ids=np.asarray(generation, np.uint32),
        generation_log_probs=np.full(len(generation), -0.5, np.float32),
        **fields,
    )


PARENT = _record(
    "p", [1, 2, 3], [4, 5], request_messages=[USER], response_message={"content": "ls"}
)


def _child(prompt: list[int], **fields) -> CallRecord:
    return _record(
        "c", prompt, [8], request_messages=HISTORY, response_message=CHILD_ANSWER, **fields
    )


def _resolved(*candidates: Candidate, reason=None) -> Resolution:
    return Resolution(
        Verdict.RESOLVED,
        PARENT_DIGEST,
        REQUEST_DIGEST,
        candidates[0].call_id,
        reason=reason,
        candidates=candidates,
    )


def _linking(verdict: str, reason: str | None, digest_parent: str | None = "p") -> dict:
    return {
        "verdict": verdict,
        "parent_digest": PARENT_DIGEST,
        "child_digest": child_digest(HISTORY, CHILD_ANSWER),
        "request_digest": REQUEST_DIGEST,
        "digest_parent_call_id": digest_parent,
        "reason": reason,
        "harness_note": None,
        "prefill": False,
    }


def _verify(child: CallRecord, resolution: Resolution, *, can_decode: bool = False, **kw):
    return verify_step(
        child,
        resolution,
        HISTORY,
        harness_note=kw.get("harness_note"),
        retry_count=kw.get("retry_count"),
        can_decode=can_decode,
    )


def _ancestor_question(child: CallRecord) -> FindPrefixAncestor:
    return FindPrefixAncestor("r1", child.prompt_token_ids, "m", "c")


def test_a_parent_verified_by_digest_is_taken_without_reading_it():
    index = LinkIndex()
    add_record(index, PARENT)
    resolution = play(resolve_step(index, "r1", HISTORY, BODY, call_id="c", created_at=9.0), [])
    assert [c.call_id for c in resolution.candidates] == ["p"]
    got = play(_verify(_child([1, 2, 3, 4, 5, 6, 7]), resolution), [])
    assert got.parent_call_id == "p" and got.retry_of is None
    assert got.linking == _linking("resolved", None)
    assert got.diagnostics == []


def test_a_parent_without_a_token_key_is_read_and_verified_by_its_tokens():
    got = play(
        _verify(_child([1, 2, 3, 4, 5, 6, 7]), _resolved(Candidate("p"))),
        [(ReadParent("p"), PARENT)],
    )
    assert got.parent_call_id == "p"
    assert got.linking == _linking("resolved", None)
    assert got.diagnostics == []


def test_the_second_candidate_verified_by_digest_is_taken_when_the_first_does_not_chain():
    other = _record("q", [1, 2, 3], [4, 6])
    index = LinkIndex()
    add_record(index, other.replace(request_messages=[USER], response_message={"content": "ls"}))
    add_record(index, PARENT.replace(created_at=99.0))
    resolution = index.resolve(PARENT_DIGEST, REQUEST_DIGEST, model="m")
    assert [c.call_id for c in resolution.candidates] == ["q", "p"]
    got = play(_verify(_child([1, 2, 3, 4, 5, 6, 7]), resolution), [])
    assert got.parent_call_id == "p"
    assert got.linking == _linking("resolved", None, digest_parent="q")


MISMATCH = {
    "parent_call_id": "p",
    "position": 3,
    "class": "template_rerendered",
    "explanation": "the parent's turn renders differently from what the model generated",
    "classified_with_text": False,
}


def test_a_refused_mismatch_without_texts_is_classified_by_tokens_and_asks_for_an_ancestor():
    child = _child([1, 2, 3, 9, 5, 6, 7])
    got = play(
        _verify(child, _resolved(Candidate("p"))),
        [(ReadParent("p"), PARENT), (_ancestor_question(child), None)],
    )
    assert got.parent_call_id is None
    assert got.linking == _linking("refused", "tokens do not chain (template_rerendered)")
    assert got.diagnostics == [Diagnostic(DiagnosticKind.PARENT_DIGEST_MISMATCH, MISMATCH)]


def test_a_refused_mismatch_with_texts_is_classified_by_text():
    child = _child([1, 2, 3, 9, 5, 6, 7])
    got = play(
        _verify(child, _resolved(Candidate("p")), can_decode=True),
        [
            (ReadParent("p"), PARENT),
            (Detokenize([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 9, 5, 6, 7]), ("U", "Uls", "Uls!")),
            (_ancestor_question(child), None),
        ],
    )
    assert got.linking == _linking("refused", "tokens do not chain (retokenized)")
    assert got.diagnostics == [
        Diagnostic(
            DiagnosticKind.PARENT_DIGEST_MISMATCH,
            {
                **MISMATCH,
                "class": "retokenized",
                "explanation": "same text, different tokens: the parent's output re-encodes "
                "differently",
                "classified_with_text": True,
            },
        )
    ]


@pytest.mark.parametrize("texts", [None, ("U", None, "Uls!")])
def test_texts_the_engine_could_not_give_leave_the_classification_by_tokens(texts):
    child = _child([1, 2, 3, 9, 5, 6, 7])
    got = play(
        _verify(child, _resolved(Candidate("p")), can_decode=True),
        [
            (ReadParent("p"), PARENT),
            (Detokenize([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 9, 5, 6, 7]), texts),
            (_ancestor_question(child), None),
        ],
    )
    assert got.diagnostics == [Diagnostic(DiagnosticKind.PARENT_DIGEST_MISMATCH, MISMATCH)]


def test_a_refused_link_falls_back_to_the_deepest_token_exact_ancestor():
    child = _child([1, 2, 3, 9, 5, 6, 7])
    question = _ancestor_question(child)
    got = play(
        _verify(child, _resolved(Candidate("p"))),
        [(ReadParent("p"), PARENT), (question, "g")],
    )
    assert question.prompt_token_ids is child.prompt_token_ids
    assert got.parent_call_id == "g"
    assert got.linking == _linking(
        "prefix",
        "refused: tokens do not chain (template_rerendered); linked to its deepest token-exact "
        "ancestor",
    )
    assert got.diagnostics == [Diagnostic(DiagnosticKind.PARENT_DIGEST_MISMATCH, MISMATCH)]


def test_a_foreign_last_turn_is_a_diagnostic_and_may_still_link_an_ancestor():
    child = _child([1, 2, 3, 4, 5, 6, 7])
    resolution = Resolution(
        Verdict.UNRESOLVED, PARENT_DIGEST, REQUEST_DIGEST, reason=verdicts.NO_MATCH
    )
    got = play(_verify(child, resolution), [(_ancestor_question(child), "g")])
    text = "no captured call produced the last model-authored turn"
    assert got.parent_call_id == "g"
    assert got.linking == _linking(
        "prefix",
        f"unresolved: {text}; linked to its deepest token-exact ancestor",
        digest_parent=None,
    )
    assert got.diagnostics == [Diagnostic(DiagnosticKind.FOREIGN_TURN, {"reason": text})]


def test_another_models_turns_are_a_diagnostic_and_may_still_link_an_ancestor():
    child = _child([1, 2, 3, 4, 5, 6, 7])
    reason = verdicts.model_scope(["small"], "m")
    resolution = Resolution(Verdict.UNRESOLVED, PARENT_DIGEST, REQUEST_DIGEST, reason=reason)
    got = play(_verify(child, resolution), [(_ancestor_question(child), None)])
    text = (
        "the matching turns come from a call to another model: the turns were produced by "
        "model small, this call is to m"
    )
    assert got.parent_call_id is None
    assert got.linking == _linking("unresolved", text, digest_parent=None)
    assert got.diagnostics == [Diagnostic(DiagnosticKind.PARENT_MODEL_MISMATCH, {"reason": text})]


@pytest.mark.parametrize(
    "reason",
    [verdicts.NOTE_PARENT, "parent resolution failed: OSError: disk"],
    ids=["source_history", "adapter"],
)
def test_a_note_parent_refusal_or_an_adapters_reason_asks_for_nothing(reason):
    resolution = Resolution(Verdict.UNRESOLVED, PARENT_DIGEST, REQUEST_DIGEST, reason=reason)
    got = play(_verify(_child([1, 2, 3, 4, 5, 6, 7]), resolution), [])
    assert got.parent_call_id is None
    assert got.linking == _linking("unresolved", str(reason), digest_parent=None)
    assert got.diagnostics == []


@pytest.mark.parametrize("parent", [None, PARENT.replace(status=CallStatus.INCOMPLETE)])
def test_an_incomplete_parent_is_refused(parent):
    child = _child([1, 2, 3, 4, 5, 6, 7])
    got = play(
        _verify(child, _resolved(Candidate("p"))),
        [(ReadParent("p"), parent), (_ancestor_question(child), None)],
    )
    assert got.parent_call_id is None
    assert got.linking == _linking("refused", "parent has no complete token data")
    assert got.diagnostics == [
        Diagnostic(
            DiagnosticKind.PARENT_DIGEST_MISMATCH,
            {"parent_call_id": "p", "reason": "parent incomplete"},
        )
    ]


def test_an_incomplete_call_is_not_verified_and_asks_for_nothing():
    child = _child([1, 2, 3, 4, 5, 6, 7], status=CallStatus.INCOMPLETE)
    key = Candidate("p", None, 5, b"\x00" * 32)
    got = play(_verify(child, _resolved(key)), [])
    assert got.parent_call_id is None
    assert got.linking == _linking("unresolved", "call has no complete token data to verify")
    assert got.diagnostics == []


def test_rows_asked_from_a_digest_parent_whose_link_was_not_taken_are_a_mismatch():
    child = _child([1, 2, 3, 9, 5, 6, 7], routed_experts_start=5)
    got = play(
        _verify(child, _resolved(Candidate("p"))),
        [(ReadParent("p"), PARENT), (_ancestor_question(child), None)],
    )
    assert got.diagnostics == [
        Diagnostic(DiagnosticKind.PARENT_DIGEST_MISMATCH, MISMATCH),
        Diagnostic(
            DiagnosticKind.ROUTED_EXPERTS_MISMATCH,
            {
                "reason": "the digest parent's link was not taken: rows before "
                "routed_experts_start were not asked for",
                "routed_experts_start": 5,
            },
        ),
    ]


def test_a_rewritten_turn_found_by_its_tool_call_ids_is_a_diagnostic_once_verified():
    index = LinkIndex()
    add_record(index, PARENT)
    (candidate,) = index.resolve(PARENT_DIGEST, REQUEST_DIGEST, model="m").candidates
    got = play(
        _verify(_child([1, 2, 3, 4, 5, 6]), _resolved(candidate, reason=verdicts.TURN_REWRITTEN)),
        [],
    )
    assert got.parent_call_id == "p"
    assert got.linking == _linking("resolved", None)
    assert got.diagnostics == [
        Diagnostic(
            DiagnosticKind.TURN_REWRITTEN,
            {
                "parent_call_id": "p",
                "reason": "the last model-authored turn was rewritten by the harness; found by "
                "its tool-call ids",
            },
        )
    ]


def test_harness_note_and_retry_diagnostics_follow_the_records_own():
    own = Diagnostic(DiagnosticKind.NON_FINITE_LOGPROB, {"positions": [0]})
    root = _record(
        "c",
        [1, 2],
        [3],
        request_messages=[USER],
        response_message=CHILD_ANSWER,
        diagnostics=[own],
    )
    resolution = Resolution(Verdict.ROOT, None, "q", retry_of="c0")
    got = play(
        verify_step(
            root,
            resolution,
            [USER],
            harness_note="opencode/step-limit",
            retry_count="2",
            can_decode=True,
        ),
        [],
    )
    assert got.parent_call_id is None and got.retry_of == "c0"
    assert got.linking == {
        "verdict": "root",
        "parent_digest": None,
        "child_digest": child_digest_after(None, CHILD_ANSWER),
        "request_digest": "q",
        "digest_parent_call_id": None,
        "reason": None,
        "harness_note": "opencode/step-limit",
        "prefill": False,
    }
    assert got.linking["child_digest"] == child_digest([USER], CHILD_ANSWER)
    assert got.diagnostics == [
        own,
        Diagnostic(DiagnosticKind.HARNESS_NOTE_REWRITTEN, {"note": "opencode/step-limit"}),
        Diagnostic(DiagnosticKind.RETRY, {"retry_of": "c0", "retry_count_header": "2"}),
    ]
