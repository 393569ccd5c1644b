"""Prefills without an event loop: a call that continues the harness's partial assistant
message is found by the turns before it, and offers its children the merged turn (prefill +
continuation) the harness sends next."""

from __future__ import annotations

import json

from capture_proxy.core.capture import prepare_request
from capture_proxy.core.linking.commands import FindPrefixAncestor, ReadParent
from capture_proxy.core.linking.digests import child_digest, history_digest
from capture_proxy.core.linking.index import LinkIndex, add_record
from capture_proxy.core.linking.parent_lookup import resolve_step
from capture_proxy.core.linking.prefill import continued_turn, offered_turn, split_prefill
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.stored import of_record, of_row
from capture_proxy.core.linking.verdicts import ReasonKind, Verdict
from capture_proxy.core.linking.verification import verify_step
from capture_proxy.core.records import CallRecord, DiagnosticKind
from tests.core.linking.steps import play
from tests.core.linking.test_verification import _record

USER = {"role": "user", "content": "Say hi"}
PREFILL = {"role": "assistant", "content": "Hello,"}
CONTINUATION = {"role": "assistant", "content": " world", "tool_calls": []}
MERGED = {"role": "assistant", "content": "Hello, world"}
PREFILLED = {
    "model": "m",
    "messages": [USER, PREFILL],
    "continue_final_message": True,
    "add_generation_prompt": False,
}
NEXT = [USER, MERGED, {"role": "user", "content": "again"}]


def _prefilled_call(index: LinkIndex, body: dict = PREFILLED) -> CallRecord:
    """The prefilled call resolved, answered, verified and indexed, as the proxy does."""
    prepared = prepare_request(body, None)
    resolution = play(
        resolve_step(
            index, "r1", prepared.linking_messages, prepared.body, call_id="p", created_at=1.0
        ),
        [],
    )
    answered = _record(
        "p",
        [1, 2, 3, 4],
        [5, 6],
        request_messages=body["messages"],
        response_message=CONTINUATION,
    )
    digests = RecordDigests(answered, prepared.prefill)
    record = play(
        verify_step(
            answered,
            resolution,
            prepared.linking_messages,
            harness_note=None,
            retry_count=None,
            can_decode=False,
            digests=digests,
            prefill=prepared.prefill,
        ),
        [],
    )
    add_record(index, record, digests)
    return record


def test_a_prefill_is_the_last_assistant_message_of_a_request_that_continues_it():
    assert split_prefill(PREFILLED, PREFILLED["messages"]) == PREFILL
    assert split_prefill(PREFILLED, [USER]) is None
    assert split_prefill({}, [USER, PREFILL]) is None  # answered as a new turn: history
    # vLLM 0.32 continues only with both flags: add_generation_prompt false alone renders the
    # message closed (history), continue_final_message alone is refused (a 400)
    assert split_prefill({"add_generation_prompt": False}, [USER, PREFILL]) is None
    assert split_prefill({"continue_final_message": True}, [USER, PREFILL]) is None


def test_the_merged_turn_is_the_prefill_then_the_continuation():
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    reply = {"content": None, "tool_calls": [call], "reasoning_content": "think"}
    assert continued_turn(PREFILL, reply) == {
        "role": "assistant",
        "content": "Hello,",
        "tool_calls": [call],
        "reasoning_content": "think",
    }
    parts = {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}
    assert continued_turn(parts, {"content": "c"})["content"] == "a\nbc"
    assert continued_turn({"role": "assistant", "content": ""}, {})["content"] is None


def test_the_prefill_is_left_out_of_the_linking_items_not_taken_for_a_foreign_turn():
    prepared = prepare_request(PREFILLED, None)
    assert prepared.linking_messages == [USER]
    assert prepared.prefill == PREFILL
    assert prepared.body["messages"] == [USER, PREFILL]  # the engine continues it
    record = _prefilled_call(LinkIndex())
    assert record.linking["verdict"] == "root" and record.linking["reason"] is None
    assert record.linking["prefill"] is True
    assert record.diagnostics == []  # no foreign_turn_projected_portable


def test_a_prefilled_call_is_the_parent_of_the_request_with_the_merged_turn():
    index = LinkIndex()
    parent = _prefilled_call(index)
    assert parent.linking["child_digest"] == history_digest(NEXT)
    assert parent.response_message == CONTINUATION  # what the engine answered, kept
    assert offered_turn(parent) == {**MERGED, "tool_calls": []}
    body = {"model": "m", "messages": NEXT}
    got = play(resolve_step(index, "r1", NEXT, body, call_id="c", created_at=2.0), [])
    assert got.verdict is Verdict.RESOLVED and got.parent_call_id == "p"
    child = _record("c", [1, 2, 3, 4, 5, 6, 7], [8], request_messages=NEXT)
    verified = play(
        verify_step(child, got, NEXT, harness_note=None, retry_count=None, can_decode=False), []
    )
    assert verified.parent_call_id == "p" and verified.linking["verdict"] == "resolved"
    assert verified.linking["prefill"] is False


def test_a_prefilled_call_with_earlier_turns_finds_its_parent_by_them():
    index = LinkIndex()
    first = _record("a", [1, 2], [3], request_messages=[USER], response_message={"content": "Hi"})
    add_record(index, first)
    history = [USER, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "more"}]
    body = {**PREFILLED, "messages": [*history, PREFILL]}
    prepared = prepare_request(body, None)
    got = play(
        resolve_step(
            index, "r1", prepared.linking_messages, prepared.body, call_id="p", created_at=3.0
        ),
        [],
    )
    assert got.verdict is Verdict.RESOLVED and got.parent_call_id == "a"
    assert got.reason is None


def test_the_merged_turn_under_an_edited_history_is_named_history_edited():
    index = LinkIndex()
    _prefilled_call(index)
    # a model-authored turn before the merged one that the prefilled call never saw
    edited = [USER, {"role": "assistant", "content": "Hm."}, USER, *NEXT[1:]]
    body = {"model": "m", "messages": edited}
    got = play(resolve_step(index, "r1", edited, body, call_id="c", created_at=2.0), [])
    assert got.verdict is Verdict.UNRESOLVED
    assert got.reason.kind is ReasonKind.HISTORY_EDITED
    assert got.mismatch["class"] == "history_edited"


def test_the_index_files_a_stored_prefilled_call_by_the_merged_turn():
    record = _prefilled_call(LinkIndex())
    stored = of_record(record)
    assert stored.child_digest == history_digest(NEXT)
    assert stored.response == {**MERGED, "tool_calls": []}
    # a record stored without its child digest derives the same one
    bare = record.replace(linking={"prefill": True})
    assert of_record(bare).child_digest == child_digest([USER], MERGED) == history_digest(NEXT)
    # a fresh index of the stored record (a restart) finds it for the next request
    index = LinkIndex()
    add_record(index, record)
    body = {"model": "m", "messages": NEXT}
    got = play(resolve_step(index, "r1", NEXT, body, call_id="c", created_at=2.0), [])
    assert got.parent_call_id == "p"


def test_a_prefilled_calls_row_offers_the_merged_turn_from_its_metadata():
    record = _prefilled_call(LinkIndex())
    assert record.linking["prefill_message"] == PREFILL
    meta = json.dumps(
        {
            "linking": record.linking,
            "response_message": record.response_message,
            "num_prompt_tokens": 4,
            "num_generation_tokens": 2,
            "model": record.model,
        }
    )
    digests = RecordDigests(record)
    tokens_sha256, block_sha256 = digests.token_key()
    row = of_row("p", record.created_at, "complete", 4, meta, tokens_sha256, block_sha256, None)
    assert row is not None and row == of_record(record)
    assert row.response == {**MERGED, "tool_calls": []}


def test_a_prefilled_row_stored_without_its_prefill_message_is_read_whole():
    meta = (
        '{"linking": {"child_digest": "d", "prefill": true}, "response_message": '
        '{"content": " world"}, "num_prompt_tokens": 4, "num_generation_tokens": 2}'
    )
    assert of_row("p", 1.0, "complete", 4, meta, b"x", b"y", None) is None
    plain = meta.replace('"prefill": true', '"prefill": false')
    assert of_row("p", 1.0, "complete", 4, plain, b"x", b"y", None) is not None


def test_a_prefilled_calls_diagnostics_name_no_foreign_turn():
    # the same request without the continue flag: its trailing assistant message is history
    # that no captured call produced (a foreign turn), and the engine answers a new turn
    body = {"model": "m", "messages": [USER, PREFILL]}
    prepared = prepare_request(body, None)
    assert prepared.prefill is None and prepared.linking_messages == [USER, PREFILL]
    index = LinkIndex()
    got = play(
        resolve_step(
            index, "r1", prepared.linking_messages, prepared.body, call_id="x", created_at=1.0
        ),
        [],
    )
    answered = _record("x", [1], [2], request_messages=[USER, PREFILL], response_message=MERGED)
    record = play(
        verify_step(
            answered,
            got,
            prepared.linking_messages,
            harness_note=None,
            retry_count=None,
            can_decode=False,
        ),
        [(FindPrefixAncestor("r1", answered.prompt_token_ids, "m", "x"), None)],
    )
    assert [d.kind for d in record.diagnostics] == [DiagnosticKind.FOREIGN_TURN]


def test_a_changed_system_prompt_under_a_prefilled_parent_is_named_system_changed():
    """The parent's request ends with its prefill: the system messages are compared with the
    history before the turn it offers, as in exact-token mode (review)."""
    index = LinkIndex()
    first = {**PREFILLED, "messages": [{"role": "system", "content": "one"}, USER, PREFILL]}
    parent = _prefilled_call(index, first)
    changed = [{"role": "system", "content": "two"}, *NEXT]
    body = {"model": "m", "messages": changed}
    got = play(resolve_step(index, "r1", changed, body, call_id="c", created_at=2.0), [])
    assert got.verdict is Verdict.RESOLVED and got.parent_call_id == "p"
    child = _record("c", [1, 9, 3, 4, 5, 6, 7], [8], request_messages=changed)
    verified = play(
        verify_step(child, got, changed, harness_note=None, retry_count=None, can_decode=False),
        [
            (ReadParent("p"), parent),
            (FindPrefixAncestor("r1", child.prompt_token_ids, "m", "c"), None),
        ],
    )
    assert verified.linking["verdict"] == "refused"
    assert verified.linking["reason"] == "tokens do not chain (system_changed)"
