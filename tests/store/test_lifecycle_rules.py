"""Tier 1: the stores' shared lifecycle decisions (``store.lifecycle``), without a store or an
event loop. The same contract runs through both stores in ``test_lifecycle.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from capture_proxy.core.codec import encode_record
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.prefixes import StoredPrefix
from capture_proxy.core.records import CallStatus, Diagnostic
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.stored_form import StoredMessages
from capture_proxy.store import lifecycle
from capture_proxy.store.base import (
    ConflictingRecord,
    Retirement,
    RolloutDeleted,
    RolloutNotFound,
    RolloutNotFrozen,
    Snapshot,
    SnapshotMismatch,
)
from capture_proxy.store.lifecycle import LifecycleRow, Tombstone
from tests.factories import record

OPEN = LifecycleRow(version=3, metadata='{"reward": 1.0, "tags": {}, "task_id": null}')
FROZEN = LifecycleRow(4, "{}", "[]", "s" * 32, 10.0, 2, 7)
RETIRED = Tombstone(20.0, "s" * 32, 4, 2)
DELETED = Tombstone(20.0)


def test_a_state_row_is_read_in_the_order_of_its_columns():
    columns = [c.strip() for c in lifecycle.STATE_COLUMNS.split(",")]
    assert columns[:5] == [
        "t.deleted_at",
        "t.snapshot_id",
        "t.version",
        "t.deleted_calls",
        "r.version",
    ]
    assert len(columns) == 11
    frozen = (None,) * 4 + (4, "{}", "[]", "s" * 32, 10.0, 2, 7)
    assert lifecycle.state_of(frozen) == (None, FROZEN)
    assert FROZEN.frozen and FROZEN.snapshot == Snapshot("s" * 32, 4, 2, 10.0, 7)
    assert not OPEN.frozen and OPEN.snapshot is None
    assert lifecycle.state_of((20, "s" * 32, 4, 2) + (None,) * 7) == (RETIRED, None)
    assert lifecycle.state_of((20.0, None, None, None) + (None,) * 7) == (DELETED, None)
    assert lifecycle.state_of((None,) * 11) == (None, None)


def test_freeze_returns_the_earlier_snapshot_or_says_freeze_now():
    assert lifecycle.earlier_freeze("r1", None, FROZEN, known_elsewhere=False) == FROZEN.snapshot
    assert lifecycle.earlier_freeze("r1", None, OPEN, known_elsewhere=False) is None
    assert lifecycle.earlier_freeze("r1", None, None, known_elsewhere=True) is None
    with pytest.raises(RolloutNotFound, match="rollout r1 not found"):
        lifecycle.earlier_freeze("r1", None, None, known_elsewhere=False)
    with pytest.raises(RolloutDeleted, match="deleted or retired"):
        lifecycle.earlier_freeze("r1", DELETED, None, known_elsewhere=True)
    snap = lifecycle.new_snapshot(OPEN, num_calls=5, now=12.5, cursor=9)
    assert (snap.version, snap.num_calls, snap.frozen_at, snap.cursor) == (3, 5, 12.5, 9)
    assert len(snap.snapshot_id) == 32 and int(snap.snapshot_id, 16) >= 0
    assert lifecycle.new_snapshot(None, num_calls=0, now=1.0, cursor=1).version == 0
    assert lifecycle.new_snapshot(OPEN, num_calls=0, now=1.0, cursor=1).snapshot_id != (
        snap.snapshot_id
    )


def test_metadata_bumps_the_version_only_for_a_change():
    same = RolloutMetadata(reward=1.0)
    assert lifecycle.metadata_change("r1", None, OPEN, same) == (3, None)
    after, text = lifecycle.metadata_change("r1", None, OPEN, RolloutMetadata(task_id="t"))
    assert after == 4 and json.loads(text or "") == {"reward": None, "task_id": "t", "tags": {}}
    assert lifecycle.metadata_text(RolloutMetadata(tags={"b": "1", "a": "2"})) == (
        '{"reward": null, "tags": {"a": "2", "b": "1"}, "task_id": null}'
    )
    with pytest.raises(RolloutNotFound):
        lifecycle.metadata_change("r1", None, None, same)
    with pytest.raises(RolloutDeleted):
        lifecycle.metadata_change("r1", RETIRED, None, same)


def test_retire_checks_identifiers_and_a_repeat_answers_from_the_tombstone():
    sid = "s" * 32
    assert lifecycle.earlier_retirement("r1", sid, 4, None, FROZEN) is None  # retire now
    assert lifecycle.earlier_retirement("r1", sid, 4, RETIRED, None) == Retirement(
        "r1", sid, 4, 2, 20.0
    )
    cases = [
        (("x" * 32, 4, None, FROZEN), SnapshotMismatch, "snapshot_id"),
        ((sid, 5, None, FROZEN), SnapshotMismatch, "version"),
        ((sid, 5, RETIRED, None), SnapshotMismatch, "version"),
        ((sid, 4, DELETED, None), SnapshotMismatch, "snapshot_id"),
        ((sid, 4, None, OPEN), RolloutNotFrozen, None),
    ]
    for args, error, field in cases:
        with pytest.raises(error) as caught:
            lifecycle.earlier_retirement("r1", *args)
        assert caught.value.field == field
    with pytest.raises(SnapshotMismatch, match="changed after it was read"):
        lifecycle.earlier_retirement("r1", sid, 5, None, FROZEN)
    with pytest.raises(RolloutNotFound):
        lifecycle.earlier_retirement("r1", sid, 4, None, None)


def test_a_call_counts_only_when_new_and_before_the_freeze():
    ok = record("c1", [1], [2])
    cut = record("c2", [1], [], status=CallStatus.INCOMPLETE)
    retry = ok.replace(retry_of="c0")
    effect = lifecycle.call_effect
    assert effect(ok, frozen=False, inserted=True) == lifecycle.CallEffect(1, False)
    assert effect(cut, frozen=False, inserted=True) == lifecycle.CallEffect(1, True)
    assert effect(retry, frozen=False, inserted=True) == lifecycle.CallEffect(1, True)
    for frozen, inserted in ((True, True), (False, False), (True, False)):
        assert effect(cut, frozen=frozen, inserted=inserted) == lifecycle.CallEffect(0, False)
    with pytest.raises(RolloutDeleted, match="call c1 refused"):
        lifecycle.refuse_deleted(ok, True)
    lifecycle.refuse_deleted(ok, False)


def test_a_call_is_encoded_against_its_prompt_parent_and_re_puts_are_compared():
    parent = record("p", [1, 2], [3]).replace(request_messages=[{"role": "user", "content": "a"}])
    child = record("c", [1, 2, 3, 4], [5], created_at=1.0).replace(
        request_messages=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ]
    )
    stored_parent = lifecycle.encode_call(parent, None, [], lambda c: None)
    assert stored_parent.prompt_parent_call_id is None
    candidates = [
        StoredPrefix("p", 0.0, stored_parent.num_prompt_tokens + 1, stored_parent.tokens_sha256)
    ]
    looked_up: list[str] = []

    def lookup(call_id: str) -> StoredMessages | None:
        looked_up.append(call_id)
        p = stored_parent
        return StoredMessages(
            call_id, None, p.messages_prefix_len, p.num_messages, p.messages_chain
        )

    request = RequestEncoding.of(child.request_messages, child.request_tools)
    enc = lifecycle.encode_call(child, request, candidates, lookup)
    assert (enc.prompt_parent_call_id, enc.prompt_prefix_len) == ("p", 3)
    assert (enc.messages_prefix_len, looked_up) == (1, ["p"])
    assert np.frombuffer(enc.prompt_token_ids, "<u4").tolist() == [4]
    lifecycle.check_re_put(enc, enc)
    lifecycle.check_re_put(None, enc)  # vanished: nothing to compare
    whole = encode_record(child, prompt_parent=None, messages_prefix_len=0, request=request)
    lifecycle.check_re_put(whole, enc)  # the same call, split otherwise
    changed = lifecycle.encode_call(child.replace(finish_reason="length"), None, [], lookup)
    with pytest.raises(ConflictingRecord, match="call c is already stored"):
        lifecycle.check_re_put(changed, enc)


def test_diagnostics_keep_one_per_kind():
    first = Diagnostic("store_failed", {"call_id": "a"})
    text = lifecycle.with_diagnostic(None, first)
    marked = LifecycleRow(1, diagnostics=text)
    assert lifecycle.with_diagnostic(marked, Diagnostic("store_failed", {"call_id": "b"})) == text
    both = lifecycle.with_diagnostic(marked, Diagnostic("other", {}))
    assert [d["kind"] for d in json.loads(both)] == ["store_failed", "other"]


def test_a_second_diagnostic_of_a_kind_adds_the_calls_it_names():
    lost = Diagnostic("store_failed", {"reason": "disk full", "call_ids": ["c1", "c2"]})
    marked = LifecycleRow(1, diagnostics=lifecycle.with_diagnostic(None, lost))
    later = Diagnostic("store_failed", {"reason": "read-only", "call_ids": ["c2", "c3"]})
    merged = json.loads(lifecycle.with_diagnostic(marked, later))
    assert merged == [
        {"kind": "store_failed", "details": {"reason": "disk full", "call_ids": ["c1", "c2", "c3"]}}
    ]


def test_rollout_info_and_episodes():
    row = ("r1", 1.0, 0, "[]", 3, 4, "{}", "s" * 32, 10.0, 2, 7, 1, 1, 0, 2)
    info = lifecycle.rollout_info(row, ["c3"], ["retry", "parent_digest_mismatch"])
    assert (info.num_calls, info.version, info.incomplete, info.late_call_ids) == (
        3,
        4,
        False,
        ("c3",),
    )
    assert (info.num_chains, info.num_failed, info.num_incomplete, info.num_refused) == (1, 1, 0, 2)
    assert info.call_diagnostic_kinds == ("parent_digest_mismatch", "retry")
    assert info.snapshot == FROZEN.snapshot and info.metadata == RolloutMetadata()
    open_info = lifecycle.rollout_info(
        ("r2", 1.0, True, "[]", 0, 0, "{}", None, None, None, None, None, 0, 0, 0), []
    )
    assert open_info.snapshot is None and open_info.incomplete and open_info.num_chains is None
    ids = ["t1-a2", "t1", "t10", "t1-b", "t1-a1-a1", "t1-a1", "t1"]
    assert lifecycle.episodes_of("t1", ids) == ["t1", "t1-a1", "t1-a2"]
