"""The store interface: what the proxy and the REST API need from any store.

Owns the contract, not an implementation: an acknowledged ``put_call`` is durable; ``put_call``
is idempotent by call id (the same content again is a no-op, different content is refused with
``ConflictingRecord`` and the original kept); reads return decoded ``CallRecord`` objects with
full prompts. ``delete_rollout`` leaves a tombstone: a later ``put_call`` for that rollout is
refused with ``RolloutDeleted`` until ``sweep_tombstones`` removes the tombstone.

Lifecycle (DESIGN.md, "Rollout lifecycle"), every step atomic, durable and idempotent:

- open: implicit, the first ``put_call`` (or a ``freeze_rollout`` with ``known_elsewhere``).
- ``freeze_rollout``: seals the rollout's calls into a snapshot (``Snapshot``: a random
  ``snapshot_id``, the ``version``, the number of calls, an export ``cursor``). A repeat returns
  the same snapshot. A ``put_call`` after the freeze is still stored, marked *late*
  (``RolloutInfo.late_call_ids``); late calls never count in the snapshot or its exports.
- ``set_metadata``: reward, task id and tags (``core.metadata.RolloutMetadata``), replaced
  whole; allowed before and after the freeze.
- ``retire_rollout``: with the snapshot id and version the trainer read, deletes the rollout
  and leaves a tombstone that remembers them, so a retried retire answers the same
  ``Retirement``; other identifiers are refused with ``SnapshotMismatch``.

``version`` is the rollout's revision: 1 more for each call stored before the freeze and for
each metadata change. A trainer that read version 7 and retires with 7 knows that nothing it
did not read (a later reward, say) is deleted with the rollout.

Exports walk frozen rollouts by ``Snapshot.cursor``: a positive integer from one store-wide
sequence, given at freeze time, never reused (not even after a retire), so a rollout frozen
later always sorts after every cursor handed out before (``list_frozen``).

Exceptions::

    StoreError                 any store failure; the proxy still answers the harness
    +-- ConflictingRecord      same call id, different content; the original is kept
    +-- RolloutDeleted         a write to a deleted (tombstoned) rollout; nothing is written
    +-- RolloutNotFound(LookupError)
    |                          a lifecycle step for a rollout the store has never heard of
    +-- LifecycleConflict      a lifecycle step that the rollout's state refuses
        +-- RolloutNotFrozen   retire before freeze
        +-- SnapshotMismatch   retire with a snapshot id or version that is not the rollout's
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from capture_proxy.core.images import PromptImage
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.stored import StoredCall
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.records import CallRecord, Diagnostic
from capture_proxy.core.request_encoding import RequestEncoding


class StoreError(Exception):
    """A store operation failed (I/O, corruption). The proxy still answers the harness."""


class ConflictingRecord(StoreError):
    """A call id was stored before with different content; the original is kept."""


class RolloutDeleted(StoreError):
    """The rollout was deleted and its tombstone is still there; a late write cannot
    resurrect it."""


class RolloutNotFound(StoreError, LookupError):
    """A lifecycle step names a rollout with no calls, no bookkeeping and no tombstone."""


class LifecycleConflict(StoreError):
    """The rollout's lifecycle state refuses the step. ``code`` is a stable name for clients;
    ``field`` names the request field at fault, if one is."""

    code = "lifecycle_conflict"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class RolloutNotFrozen(LifecycleConflict):
    """Retire before freeze: there is no snapshot to retire."""

    code = "rollout_not_frozen"


class SnapshotMismatch(LifecycleConflict):
    """Retire with a snapshot id or version that is not the rollout's (``field`` says which),
    or of a rollout deleted without a snapshot."""

    code = "snapshot_mismatch"


#: The largest export cursor: both stores keep it as a 64-bit signed integer (SQLite INTEGER,
#: PostgreSQL bigint).
MAX_CURSOR = 2**63 - 1


class RolloutStatus(enum.StrEnum):
    OPEN = "open"
    FROZEN = "frozen"


@dataclass(frozen=True)
class Snapshot:
    """A frozen rollout's seal. ``snapshot_id``: 32 hex digits; ``version``: the rollout's
    current revision (see the module docstring); ``num_calls``: calls stored before the freeze
    (late calls excluded); ``frozen_at``: Unix s; ``cursor``: its export position (> 0)."""

    snapshot_id: str
    version: int
    num_calls: int
    frozen_at: float
    cursor: int

    def to_json(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "version": self.version,
            "num_calls": self.num_calls,
            "frozen_at": self.frozen_at,
            "cursor": self.cursor,
        }


@dataclass(frozen=True)
class Retirement:
    """What a retire did, kept in the tombstone so a retry answers the same: the snapshot and
    version retired, the calls deleted, when (Unix s)."""

    rollout_id: str
    snapshot_id: str
    version: int
    deleted_calls: int
    retired_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "snapshot_id": self.snapshot_id,
            "version": self.version,
            "deleted_calls": self.deleted_calls,
            "retired_at": self.retired_at,
        }


@dataclass(frozen=True)
class RolloutInfo:
    """Per-rollout bookkeeping kept beside the calls.

    ``created_at`` is Unix seconds of the first call seen; ``num_calls`` counts every stored
    call, late ones included; ``incomplete`` is True while a call counted in the rollout (not
    late) lost token data and no complete retry of it supersedes it (``core.completeness``:
    the harness continued from the retry), and once a rollout-level diagnostic marked it
    (``mark_rollout_incomplete``, e.g. a call that failed to store); ``diagnostics`` are those
    rollout-level conditions (one per kind, with details), e.g. ``store_failed``. ``version``
    is the revision (module docstring); ``snapshot`` is set once frozen; ``late_call_ids`` are
    the calls stored after the freeze, in arrival order; ``metadata`` is what the trainer
    attached. ``num_chains`` is ``len(build_chains(...).chains)`` over the calls a training
    read holds (the late ones left out), kept by every put (``core.chain_counts``); None when
    the store does not keep it for this rollout (the reader builds the chains).
    ``num_failed``, ``num_incomplete`` and ``num_refused`` count the calls stored failed,
    incomplete (superseded or not) and with a ``parent_digest_mismatch`` (one per such
    diagnostic), and ``call_diagnostic_kinds`` are the kinds found on any call, sorted: all of
    them late calls included, for the viewer's list.
    """

    rollout_id: str
    created_at: float
    num_calls: int
    incomplete: bool
    diagnostics: list[Diagnostic] = field(default_factory=list)
    version: int = 0
    snapshot: Snapshot | None = None
    late_call_ids: tuple[str, ...] = ()
    metadata: RolloutMetadata = field(default_factory=RolloutMetadata)
    num_chains: int | None = None
    num_failed: int = 0
    num_incomplete: int = 0
    num_refused: int = 0
    call_diagnostic_kinds: tuple[str, ...] = ()

    @property
    def status(self) -> RolloutStatus:
        return RolloutStatus.OPEN if self.snapshot is None else RolloutStatus.FROZEN


class CaptureStore(Protocol):
    #: True when other processes write the same store (PostgreSQL replicas): what a process
    #: cached of a rollout may be stale, so the linker reloads a rollout's index on a miss.
    shared: bool

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def put_call(
        self,
        record: CallRecord,
        request: RequestEncoding | None = None,
        digests: RecordDigests | None = None,
    ) -> int | None:
        """Store a record durably (``request``: its ``RequestEncoding``, if computed ahead;
        ``digests``: its ``RecordDigests``, the proxy's, whose token digests a store may take
        instead of hashing the prompt again). Returns the bytes written, or None when the store
        does not know (metrics only). Raises ConflictingRecord, RolloutDeleted or
        StoreError."""

    async def mark_rollout_incomplete(self, rollout_id: str, diagnostic: Diagnostic) -> None:
        """Flag a rollout as incomplete with a rollout-level diagnostic (kept once per kind);
        no retry clears it."""

    async def delete_rollout(self, rollout_id: str, *, known_elsewhere: bool = False) -> int | None:
        """Delete a rollout's calls and bookkeeping and leave a tombstone (idempotent).
        Returns the number of calls deleted, or None (nothing written) for a rollout the store
        never heard of unless ``known_elsewhere`` (a call of it is in flight)."""

    async def sweep_tombstones(self, older_than_s: float) -> int:
        """Remove tombstones older than ``older_than_s`` seconds. Returns how many."""

    async def freeze_rollout(self, rollout_id: str, *, known_elsewhere: bool = False) -> Snapshot:
        """Freeze the rollout (idempotent: a repeat returns the same snapshot, with the current
        version). ``known_elsewhere``: a call of it is in flight, so a rollout with nothing
        stored yet is frozen empty instead of refused. Raises RolloutNotFound, RolloutDeleted
        (tombstoned), StoreError."""

    async def set_metadata(self, rollout_id: str, metadata: RolloutMetadata) -> int:
        """Replace the rollout's metadata; returns the version after (unchanged when the
        metadata was already this). Raises RolloutNotFound, RolloutDeleted, StoreError."""

    async def retire_rollout(self, rollout_id: str, snapshot_id: str, version: int) -> Retirement:
        """Delete a frozen rollout whose snapshot id and current version are the given ones and
        leave a tombstone that remembers them; a repeat with the same identifiers returns the
        same ``Retirement`` while the tombstone lasts. Raises RolloutNotFound, RolloutNotFrozen,
        SnapshotMismatch (also for a rollout deleted without a snapshot), StoreError."""

    async def list_frozen(self, *, after: int = 0, limit: int | None = None) -> list[RolloutInfo]:
        """Frozen rollouts with ``snapshot.cursor > after``, in cursor order, at most
        ``limit``."""

    async def list_episodes(self, base_rollout_id: str) -> list[str]:
        """Ids of the episodes of ``base_rollout_id`` the store knows of (``core.episodes``:
        the base id itself and ``<base>-a<n>``), stored or tombstoned, sorted."""

    async def get_call(self, call_id: str) -> CallRecord | None: ...

    async def get_images(self, shas: list[str]) -> dict[str, PromptImage]:
        """The stored images among ``shas`` (hex SHA-256 of their bytes), by sha256: each
        image's bytes are stored once, whatever number of calls carry it."""
        ...

    async def get_rollout_calls(self, rollout_id: str) -> list[CallRecord]: ...

    async def rollout_index_facts(self, rollout_id: str) -> list[StoredCall] | None:
        """What the link index keeps of each of the rollout's calls, in stored order, read from
        the rows without decoding a record (``linking.stored.of_row``); None when a row cannot
        tell them or the store does not read them so (the caller reads the records)."""
        ...

    async def get_calls_by_child_digest(
        self, rollout_id: str, child_digest: str
    ) -> list[CallRecord]:
        """The rollout's calls stored with this child digest (``linking.child_digest``: the
        calls a history with this parent digest continues), in stored order; an index range,
        whatever the rollout's size. Calls stored without one are not found."""

    async def get_rollout(self, rollout_id: str) -> RolloutInfo | None: ...

    async def get_rollout_with_calls(
        self, rollout_id: str
    ) -> tuple[RolloutInfo, list[CallRecord]] | None:
        """``get_rollout`` and ``get_rollout_calls`` in one read of one snapshot (one hop off
        the event loop: on a busy proxy each hop waits for a turn of the loop); None for a
        rollout the store does not hold."""

    async def list_rollouts(
        self, *, limit: int | None = None, after: str | None = None
    ) -> list[RolloutInfo]:
        """Rollouts in rollout id order: at most ``limit``, only ids greater than ``after``."""

    async def health(self) -> dict[str, Any]: ...
