"""The decisions every store makes the same way: what a stored call, a freeze, a metadata
change and a retire do to a rollout, given the rows the store read, and how rows become
``RolloutInfo``. The contract is ``base.py``'s; this module is its one implementation.

Pure: no I/O, no driver (sqlite3, psycopg) and no aiohttp. A store reads a rollout's state
inside its own transaction (``STATE_COLUMNS``: its tombstone and its ``rollouts`` row, one
statement), asks a function here, and writes what it answers; the SQL, the locking and the
transaction stay in the store.
Each function either returns what to do or raises the contract's exception, whose message is
the same on every store. ``encode_call`` is ``put_call``'s step from a record to its stored
form; ``lookup`` is the store's reader of ``StoredMessages`` (the one callback here).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from capture_proxy.core.chain_counts import chains_delta, incomplete_delta
from capture_proxy.core.codec import PromptParent, encode_record, same_content
from capture_proxy.core.completeness import RetryLink
from capture_proxy.core.episodes import parse_episode
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.prefixes import StoredPrefix, choose_prompt_parent
from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic, DiagnosticKind
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.stored_form import EncodedRecord, StoredMessages, common_messages_prefix
from capture_proxy.store.base import (
    ConflictingRecord,
    Retirement,
    RolloutDeleted,
    RolloutInfo,
    RolloutNotFound,
    RolloutNotFrozen,
    Snapshot,
    SnapshotMismatch,
)

#: What ``state_of`` reads, in order: the columns of the rollout's tombstone (``t``, all NULL
#: for none) and of its ``rollouts`` row (``r``, all NULL for none), e.g. ``SELECT
#: {STATE_COLUMNS} FROM (SELECT ? AS id) k LEFT JOIN tombstones t ON t.rollout_id = k.id
#: LEFT JOIN rollouts r ON r.rollout_id = k.id``.
STATE_COLUMNS = (
    "t.deleted_at, t.snapshot_id, t.version, t.deleted_calls, "
    "r.version, r.metadata, r.diagnostics, r.snapshot_id, r.frozen_at, r.frozen_num_calls, "
    "r.export_cursor"
)


@dataclass(frozen=True)
class Tombstone:
    """A deleted rollout's tombstone: when (Unix s) and, for a retire, what was retired."""

    deleted_at: float
    snapshot_id: str | None = None
    version: int | None = None
    deleted_calls: int | None = None

    @classmethod
    def of(cls, row: Sequence[Any]) -> Tombstone | None:
        """From its four values in ``STATE_COLUMNS`` (None: no tombstone)."""
        deleted_at, snapshot_id, version, deleted_calls = row
        if deleted_at is None:
            return None
        return cls(
            float(deleted_at),
            snapshot_id,
            None if version is None else int(version),
            None if deleted_calls is None else int(deleted_calls),
        )


@dataclass(frozen=True)
class LifecycleRow:
    """The lifecycle columns of a rollout's ``rollouts`` row: its revision, its metadata and
    rollout-level diagnostics (JSON texts) and, once frozen, its snapshot."""

    version: int
    metadata: str = "{}"
    diagnostics: str = "[]"
    snapshot_id: str | None = None
    frozen_at: float | None = None
    frozen_num_calls: int | None = None
    export_cursor: int | None = None

    @classmethod
    def of(cls, row: Sequence[Any]) -> LifecycleRow | None:
        """From its seven values in ``STATE_COLUMNS`` (None: no such rollout)."""
        version, metadata, diagnostics, snapshot_id, frozen_at, num_calls, cursor = row
        if version is None:  # NOT NULL in a row that exists
            return None
        return cls(int(version), metadata, diagnostics, snapshot_id, frozen_at, num_calls, cursor)

    @property
    def frozen(self) -> bool:
        return self.snapshot_id is not None

    @property
    def snapshot(self) -> Snapshot | None:
        return _snapshot(
            self.snapshot_id,
            self.version,
            self.frozen_num_calls,
            self.frozen_at,
            self.export_cursor,
        )


def _snapshot(
    snapshot_id: str | None,
    version: int,
    num_calls: int | None,
    frozen_at: float | None,
    cursor: int | None,
) -> Snapshot | None:
    if snapshot_id is None:
        return None
    assert num_calls is not None and frozen_at is not None and cursor is not None
    return Snapshot(snapshot_id, int(version), int(num_calls), float(frozen_at), int(cursor))


def state_of(row: Sequence[Any]) -> tuple[Tombstone | None, LifecycleRow | None]:
    """(tombstone, ``rollouts`` row) of a rollout from a row of ``STATE_COLUMNS``."""
    return Tombstone.of(row[:4]), LifecycleRow.of(row[4:])


def deleted(rollout_id: str) -> RolloutDeleted:
    return RolloutDeleted(f"rollout {rollout_id} was deleted or retired")


def not_found(rollout_id: str) -> RolloutNotFound:
    return RolloutNotFound(f"rollout {rollout_id} not found")


# --- put_call ------------------------------------------------------------------------------


def refuse_deleted(record: CallRecord, tombstoned: bool) -> None:
    """A call of a tombstoned rollout is refused: nothing is written."""
    if tombstoned:
        raise RolloutDeleted(
            f"rollout {record.rollout_id} was deleted; call {record.call_id} refused"
        )


def encode_call(
    record: CallRecord,
    request: RequestEncoding | None,
    candidates: Iterable[StoredPrefix],
    lookup: Callable[[str], StoredMessages | None],
) -> EncodedRecord:
    """The stored form of ``record``: its prompt parent chosen among ``candidates`` (the
    rollout's complete calls with output, read in the write transaction), its messages split
    after the prefix it shares with that parent (``lookup``: a stored call's
    ``StoredMessages``). ``request``: its ``RequestEncoding`` if computed ahead, used only when
    it belongs to the record."""
    parent = choose_prompt_parent(record.prompt_token_ids, candidates, exclude=record.call_id)
    return encode_with_parent(record, request, parent, lookup)


def encode_with_parent(
    record: CallRecord,
    request: RequestEncoding | None,
    parent: PromptParent | None,
    lookup: Callable[[str], StoredMessages | None],
    tokens_sha256: bytes | None = None,
) -> EncodedRecord:
    """``encode_call`` with the prompt parent chosen already (``prefixes.choose_with_digest``
    over the candidates a store read, which also gives the record's ``tokens_sha256``)."""
    encoding = (
        request
        if request is not None and request.belongs_to(record)
        else RequestEncoding.of(record.request_messages, record.request_tools)
    )
    k = 0
    if parent is not None:
        k = common_messages_prefix(encoding.message_digests, parent.call_id, lookup)
    return encode_record(
        record,
        prompt_parent=parent,
        messages_prefix_len=k,
        request=encoding,
        tokens_sha256=tokens_sha256,
    )


def check_re_put(stored: EncodedRecord | None, enc: EncodedRecord) -> None:
    """A call id stored before must hold the same content (``stored``: its row, None when it
    vanished); else ConflictingRecord, and the original is kept."""
    if stored is not None and not same_content(stored, enc):
        raise ConflictingRecord(
            f"call {enc.call_id} is already stored with different content; original kept"
        )


@dataclass(frozen=True)
class CallEffect:
    """What storing one call does to its rollout's row. ``version_delta``: 1 for a new call
    before the freeze, else 0 (a late call or a re-put changes neither the revision nor the
    completeness of what was, or will be, read); ``recount``: the rollout's incomplete calls
    must be counted again (``core.completeness``), for a new incomplete call or retry."""

    version_delta: int
    recount: bool


def may_recount(record: CallRecord) -> bool:
    """Whether storing ``record`` may change its rollout's count of incomplete calls (it is
    incomplete, or a retry): the store then reads the rollout's ``RetryLink`` rows first."""
    return record.status is CallStatus.INCOMPLETE or record.retry_of is not None


def call_effect(record: CallRecord, *, frozen: bool, inserted: bool) -> CallEffect:
    counts = inserted and not frozen
    return CallEffect(int(counts), counts and may_recount(record))


def call_tally(record: CallRecord) -> tuple[int, int, int]:
    """What a stored call adds to its rollout's ``num_failed``, ``num_incomplete`` and
    ``num_refused`` (its ``parent_digest_mismatch`` diagnostics), late or not: the viewer's
    listing counts."""
    refused = sum(1 for d in record.diagnostics if d.kind == DiagnosticKind.PARENT_DIGEST_MISMATCH)
    return (
        int(record.status is CallStatus.FAILED),
        int(record.status is CallStatus.INCOMPLETE),
        refused,
    )


def count_deltas(
    record: CallRecord,
    effect: CallEffect,
    family: Sequence[RetryLink],
    parent_status: str | None,
) -> tuple[int, int | None]:
    """How storing ``record`` changes its rollout's kept counts: (incomplete calls no complete
    retry supersedes, chains; None: no longer kept), both 0 for a late call or a re-put.
    ``family``: the stored members of its retry family (``sql.RETRY_FAMILY``), read when
    ``may_recount``; ``parent_status``: its linked parent's status when stored in the rollout
    (``core.chain_counts``)."""
    if not effect.version_delta:
        return 0, 0
    incomplete = incomplete_delta(record, family) if effect.recount else 0
    return incomplete, chains_delta(record, parent_status, family if may_recount(record) else None)


# --- mark_rollout_incomplete ---------------------------------------------------------------


def with_diagnostic(row: LifecycleRow | None, diagnostic: Diagnostic) -> str:
    """The rollout's diagnostics text (``row``: its row, None for a new rollout) with
    ``diagnostic`` added unless one of its kind is there (one per kind). A diagnostic of a
    kind already there adds the calls it names (``details["call_ids"]``, a list of call
    ids, e.g. ``store_failed``'s lost calls) to the earlier one's, each once, in order; its
    other details are the earlier one's."""
    diags = [Diagnostic.from_json(d) for d in json.loads(row.diagnostics)] if row else []
    for i, earlier in enumerate(diags):
        if earlier.kind == diagnostic.kind:
            diags[i] = earlier.with_call_ids_of(diagnostic)
            break
    else:
        diags.append(diagnostic)
    return json.dumps([d.to_json() for d in diags], ensure_ascii=False)


# --- freeze --------------------------------------------------------------------------------


def earlier_freeze(
    rollout_id: str,
    tomb: Tombstone | None,
    row: LifecycleRow | None,
    *,
    known_elsewhere: bool,
) -> Snapshot | None:
    """The snapshot a repeated freeze returns, or None: freeze now (a missing ``row`` is
    created first, frozen empty, when ``known_elsewhere``). Raises RolloutDeleted (tombstoned)
    or RolloutNotFound."""
    if tomb is not None:
        raise deleted(rollout_id)
    if row is None:
        if not known_elsewhere:
            raise not_found(rollout_id)
        return None
    return row.snapshot


def new_snapshot(row: LifecycleRow | None, *, num_calls: int, now: float, cursor: int) -> Snapshot:
    """The seal of a freeze now: a new random id, the rollout's revision (0 for a rollout
    frozen empty before its first call is stored), the calls stored before it (late ones
    excluded), the time (Unix s) and the export cursor the store handed out."""
    version = 0 if row is None else row.version
    return Snapshot(uuid.uuid4().hex, version, int(num_calls), now, int(cursor))


# --- metadata ------------------------------------------------------------------------------


def metadata_text(metadata: RolloutMetadata) -> str:
    """The stored text of metadata: one text per value, so equal metadata compare equal."""
    return json.dumps(metadata.to_json(), ensure_ascii=False, sort_keys=True)


def metadata_change(
    rollout_id: str, tomb: Tombstone | None, row: LifecycleRow | None, metadata: RolloutMetadata
) -> tuple[int, str | None]:
    """(the version after, the text to store or None when nothing changes: a retry). Raises
    RolloutDeleted or RolloutNotFound."""
    if tomb is not None:
        raise deleted(rollout_id)
    if row is None:
        raise not_found(rollout_id)
    text = metadata_text(metadata)
    if text == metadata_text(RolloutMetadata.from_json(json.loads(row.metadata))):
        return row.version, None
    return row.version + 1, text


# --- retire --------------------------------------------------------------------------------


def _check_identifiers(
    rollout_id: str, snapshot_id: str, version: int, have_snapshot: str, have_version: int
) -> None:
    if have_snapshot != snapshot_id:
        raise SnapshotMismatch(
            f"snapshot_id {snapshot_id!r} is not rollout {rollout_id}'s snapshot "
            f"({have_snapshot!r})",
            field="snapshot_id",
        )
    if have_version != version:
        raise SnapshotMismatch(
            f"version {version} is not rollout {rollout_id}'s version ({have_version}): "
            "it changed after it was read (a late reward or tag?); read it again",
            field="version",
        )


def earlier_retirement(
    rollout_id: str,
    snapshot_id: str,
    version: int,
    tomb: Tombstone | None,
    row: LifecycleRow | None,
) -> Retirement | None:
    """The ``Retirement`` a repeated retire answers (from the tombstone), or None: retire now
    (the identifiers are the rollout's). Raises RolloutNotFound, RolloutNotFrozen or
    SnapshotMismatch (also for a rollout deleted without a snapshot)."""
    if tomb is not None:
        if tomb.snapshot_id is None or tomb.version is None:
            raise SnapshotMismatch(
                f"rollout {rollout_id} was deleted without a snapshot, not retired",
                field="snapshot_id",
            )
        _check_identifiers(rollout_id, snapshot_id, version, tomb.snapshot_id, tomb.version)
        return Retirement(
            rollout_id, tomb.snapshot_id, tomb.version, tomb.deleted_calls or 0, tomb.deleted_at
        )
    if row is None:
        raise not_found(rollout_id)
    if row.snapshot_id is None:
        raise RolloutNotFrozen(
            f"rollout {rollout_id} is not frozen: freeze it, read it, then retire it"
        )
    _check_identifiers(rollout_id, snapshot_id, version, row.snapshot_id, row.version)
    return None


# --- reads ---------------------------------------------------------------------------------


def rollout_info(
    row: Sequence[Any], late_call_ids: Iterable[str], call_kinds: Iterable[str] = ()
) -> RolloutInfo:
    """A ``RolloutInfo`` from the values a store's rollout query selects, in this order:
    rollout id, created at, incomplete (true for a rollout-level mark or incomplete calls),
    diagnostics (JSON text), number of calls, version, metadata (JSON text), snapshot id,
    frozen at, frozen number of calls, export cursor, number of chains (None: not kept), of
    failed, incomplete and refused calls; then the late call ids and the calls' diagnostic
    kinds."""
    (
        rollout_id,
        created_at,
        incomplete,
        diagnostics,
        num_calls,
        version,
        metadata,
        snapshot_id,
        frozen_at,
        frozen_num_calls,
        export_cursor,
        num_chains,
        num_failed,
        num_incomplete,
        num_refused,
    ) = row
    return RolloutInfo(
        rollout_id=rollout_id,
        created_at=created_at,
        num_calls=int(num_calls),
        incomplete=bool(incomplete),
        diagnostics=[Diagnostic.from_json(d) for d in json.loads(diagnostics)],
        version=int(version),
        snapshot=_snapshot(snapshot_id, version, frozen_num_calls, frozen_at, export_cursor),
        late_call_ids=tuple(late_call_ids),
        metadata=RolloutMetadata.from_json(json.loads(metadata)),
        num_chains=None if num_chains is None else int(num_chains),
        num_failed=int(num_failed),
        num_incomplete=int(num_incomplete),
        num_refused=int(num_refused),
        call_diagnostic_kinds=tuple(sorted(call_kinds)),
    )


def episodes_of(base: str, rollout_ids: Iterable[str]) -> list[str]:
    """The ids among ``rollout_ids`` that are episodes of ``base`` (itself or ``<base>-a<n>``),
    sorted and once each (a store's prefix match finds a superset)."""
    return sorted({r for r in rollout_ids if r == base or parse_episode(r).base == base})
