"""The store interface: what the proxy and the REST API need from any store.

Owns the contract, not an implementation: an acknowledged ``put_call`` is durable; ``put_call``
is idempotent by call id (the same content again is a no-op, different content is refused with
``ConflictingRecord`` and the original kept); reads return decoded ``CallRecord`` objects with
full prompts. ``delete_rollout`` leaves a tombstone: a later ``put_call`` for that rollout is
refused with ``RolloutDeleted`` until ``sweep_tombstones`` removes the tombstone.

Exceptions::

    StoreError                 any store failure; the proxy still answers the harness
    +-- ConflictingRecord      same call id, different content; the original is kept
    +-- RolloutDeleted         a write to a deleted (tombstoned) rollout; nothing is written
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from capture_proxy.core.codec import RequestEncoding
from capture_proxy.core.records import CallRecord, Diagnostic


class StoreError(Exception):
    """A store operation failed (I/O, corruption). The proxy still answers the harness."""


class ConflictingRecord(StoreError):
    """A call id was stored before with different content; the original is kept."""


class RolloutDeleted(StoreError):
    """The rollout was deleted and its tombstone is still there; a late write cannot
    resurrect it."""


@dataclass(frozen=True)
class RolloutInfo:
    """Per-rollout bookkeeping kept beside the calls.

    ``created_at`` is Unix seconds of the first call seen; ``incomplete`` is True once any call
    of the rollout lost token data or failed to store; ``diagnostics`` are rollout-level
    conditions (one per kind, with details), e.g. ``store_failed``.
    """

    rollout_id: str
    created_at: float
    num_calls: int
    incomplete: bool
    diagnostics: list[Diagnostic] = field(default_factory=list)


class CaptureStore(Protocol):
    #: True when other processes write the same store (PostgreSQL replicas): what a process
    #: cached of a rollout may be stale, so the linker reloads a rollout's index on a miss.
    shared: bool

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def put_call(self, record: CallRecord, request: RequestEncoding | None = None) -> None:
        """Store a record durably (``request``: its ``RequestEncoding``, if computed ahead).
        Raises ConflictingRecord, RolloutDeleted or StoreError."""

    async def mark_rollout_incomplete(self, rollout_id: str, diagnostic: Diagnostic) -> None:
        """Flag a rollout as incomplete with a rollout-level diagnostic (kept once per kind)."""

    async def delete_rollout(self, rollout_id: str, *, known_elsewhere: bool = False) -> int | None:
        """Delete a rollout's calls and bookkeeping and leave a tombstone (idempotent).
        Returns the number of calls deleted, or None (nothing written) for a rollout the store
        never heard of unless ``known_elsewhere`` (a call of it is in flight)."""

    async def sweep_tombstones(self, older_than_s: float) -> int:
        """Remove tombstones older than ``older_than_s`` seconds. Returns how many."""

    async def get_call(self, call_id: str) -> CallRecord | None: ...

    async def get_rollout_calls(self, rollout_id: str) -> list[CallRecord]: ...

    async def get_rollout(self, rollout_id: str) -> RolloutInfo | None: ...

    async def list_rollouts(
        self, *, limit: int | None = None, after: str | None = None
    ) -> list[RolloutInfo]:
        """Rollouts in rollout id order: at most ``limit``, only ids greater than ``after``."""

    async def health(self) -> dict[str, Any]: ...
