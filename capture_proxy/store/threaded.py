"""The async face both stores share: one method per ``CaptureStore`` operation, each ONE hop to
a worker thread that runs the store's synchronous function for it; a driver error becomes a
``StoreError`` here, saying what was being done.

Owns no connection, no thread and no SQL. A store (``sqlite.py``, ``postgres.py``) provides:
- the hops, ``_write_hop`` and ``_read_hop``: run ``fn(connection, *args)`` on one of its
  worker threads with one of its connections (SQLite: the writer or the reader thread;
  PostgreSQL: any pool thread, with its retries);
- ``_driver_error``: its driver's exception class (``sqlite3.Error``, ``psycopg.Error``);
- the synchronous functions, connection first, each one transaction: ``_put``, ``_mark``,
  ``_delete``, ``_freeze``, ``_set_metadata``, ``_retire``, ``_sweep``; the reads
  ``_get_tombstone``, ``_get_call``, ``_get_rollout_calls``, ``_get_calls_by_child_digest``,
  ``_get_rollout``, ``_get_rollout_with_calls``,
  ``_list_rollouts``, ``_list_frozen``, ``_list_episodes``, ``_health``. What they decide
  is ``lifecycle``'s; they hold the SQL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from capture_proxy.core.images import PromptImage
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.stored import StoredCall
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.records import CallRecord, Diagnostic
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.store.base import Retirement, RolloutInfo, Snapshot, StoreError

T = TypeVar("T")


class ThreadedStore:
    """The ``CaptureStore`` methods over a store's synchronous functions (module docstring)."""

    #: The driver's exception class (or classes), turned into ``StoreError`` by every method.
    _driver_error: type[Exception] | tuple[type[Exception], ...] = ()

    # The store's synchronous functions (connection first), run on its worker threads.
    _put: Callable[..., int | None]
    _mark: Callable[..., None]
    _delete: Callable[..., int | None]
    _freeze: Callable[..., Snapshot]
    _set_metadata: Callable[..., int]
    _retire: Callable[..., Retirement]
    _sweep: Callable[..., int]
    _get_tombstone: Callable[..., float | None]
    _get_call: Callable[..., CallRecord | None]
    _get_images: Callable[..., dict[str, PromptImage]]
    _get_rollout_calls: Callable[..., list[CallRecord]]
    _get_calls_by_child_digest: Callable[..., list[CallRecord]]
    _get_rollout: Callable[..., RolloutInfo | None]
    _get_rollout_with_calls: Callable[..., tuple[RolloutInfo, list[CallRecord]] | None]
    _list_rollouts: Callable[..., list[RolloutInfo]]
    _list_frozen: Callable[..., list[RolloutInfo]]
    _list_episodes: Callable[..., list[str]]
    _health: Callable[..., dict[str, Any]]

    async def _write_hop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(connection, *args)`` where the store writes (one hop)."""
        raise NotImplementedError

    async def _read_hop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(connection, *args)`` where the store reads (one hop)."""
        raise NotImplementedError

    async def _put_hop(
        self,
        record: CallRecord,
        request: RequestEncoding | None,
        digests: RecordDigests | None = None,
    ) -> int | None:
        """Store one record where the store writes (one hop); a store may commit several
        records' puts together (SQLite: group commit), answering each after its commit.
        ``digests``: see ``put_call`` (PostgreSQL's put hashes the prompt itself)."""
        return await self._write_hop(self._put, record, request)

    async def _write(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await self._write_hop(fn, *args)
        except self._driver_error as exc:
            raise StoreError(f"{what} failed: {exc}") from exc

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await self._read_hop(fn, *args)
        except self._driver_error as exc:
            raise StoreError(f"reading the store failed: {exc}") from exc

    # --- writes --------------------------------------------------------------------------

    async def put_call(
        self,
        record: CallRecord,
        request: RequestEncoding | None = None,
        digests: RecordDigests | None = None,
    ) -> int | None:
        """Store ``record`` durably (committed before returning). ``request``: the record's
        ``RequestEncoding`` if the caller computed it ahead (used when it belongs to the
        record, see ``RequestEncoding.belongs_to``). ``digests``: the record's
        ``RecordDigests`` (verification's), whose prompt block states and token key a put
        takes when they are of the record's very arrays (``record_digests.token_states``).
        Returns the bytes written when the store counts them (SQLite: the record's metadata,
        arrays and message delta and the JSON texts new to the store, 0 for a re-put), else
        None.

        Raises RolloutDeleted for a tombstoned rollout, ConflictingRecord when the call id is
        stored with other content (the original is kept), StoreError on failure."""
        try:
            return await self._put_hop(record, request, digests)
        except self._driver_error as exc:
            raise StoreError(f"storing call {record.call_id} failed: {exc}") from exc

    async def mark_rollout_incomplete(self, rollout_id: str, diagnostic: Diagnostic) -> None:
        """See ``CaptureStore.mark_rollout_incomplete``; nothing for a deleted rollout."""
        what = f"marking rollout {rollout_id} incomplete"
        await self._write(what, self._mark, rollout_id, diagnostic)

    async def delete_rollout(self, rollout_id: str, *, known_elsewhere: bool = False) -> int | None:
        """Delete the rollout's calls and bookkeeping and leave a tombstone. Returns the
        number of calls deleted (0 when it was deleted before), or None, writing nothing,
        when the store has never heard of the rollout and ``known_elsewhere`` is False (the
        caller knows of no call of it in flight): a typo must not block a rollout id."""
        what = f"deleting rollout {rollout_id}"
        return await self._write(what, self._delete, rollout_id, known_elsewhere)

    async def freeze_rollout(self, rollout_id: str, *, known_elsewhere: bool = False) -> Snapshot:
        """See ``CaptureStore.freeze_rollout``."""
        what = f"freezing rollout {rollout_id}"
        return await self._write(what, self._freeze, rollout_id, known_elsewhere)

    async def set_metadata(self, rollout_id: str, metadata: RolloutMetadata) -> int:
        """See ``CaptureStore.set_metadata``."""
        what = f"setting metadata of rollout {rollout_id}"
        return await self._write(what, self._set_metadata, rollout_id, metadata)

    async def retire_rollout(self, rollout_id: str, snapshot_id: str, version: int) -> Retirement:
        """See ``CaptureStore.retire_rollout``."""
        what = f"retiring rollout {rollout_id}"
        return await self._write(what, self._retire, rollout_id, snapshot_id, version)

    async def sweep_tombstones(self, older_than_s: float) -> int:
        """See ``CaptureStore.sweep_tombstones``."""
        return await self._write("sweeping tombstones", self._sweep, older_than_s)

    # --- reads ---------------------------------------------------------------------------

    async def get_tombstone(self, rollout_id: str) -> float | None:
        """When the rollout was deleted (Unix s), or None when it has no tombstone."""
        return await self._read(self._get_tombstone, rollout_id)

    async def get_call(self, call_id: str) -> CallRecord | None:
        return await self._read(self._get_call, call_id)

    async def get_images(self, shas: list[str]) -> dict[str, PromptImage]:
        """The stored images among ``shas`` (hex SHA-256 of their bytes), by sha256."""
        return await self._read(self._get_images, list(shas))

    async def get_rollout_calls(self, rollout_id: str) -> list[CallRecord]:
        return await self._read(self._get_rollout_calls, rollout_id)

    async def rollout_index_facts(self, rollout_id: str) -> list[StoredCall] | None:
        """None here: a store that reads its rows' index facts says so (``SQLiteStore``)."""
        return None

    async def get_calls_by_child_digest(
        self, rollout_id: str, child_digest: str
    ) -> list[CallRecord]:
        return await self._read(self._get_calls_by_child_digest, rollout_id, child_digest)

    async def get_rollout(self, rollout_id: str) -> RolloutInfo | None:
        return await self._read(self._get_rollout, rollout_id)

    async def get_rollout_with_calls(
        self, rollout_id: str
    ) -> tuple[RolloutInfo, list[CallRecord]] | None:
        return await self._read(self._get_rollout_with_calls, rollout_id)

    async def list_rollouts(
        self, *, limit: int | None = None, after: str | None = None
    ) -> list[RolloutInfo]:
        """Rollouts in rollout id order: at most ``limit``, only ids greater than ``after``
        (a page after the last id of the previous one)."""
        return await self._read(self._list_rollouts, limit, after)

    async def list_frozen(self, *, after: int = 0, limit: int | None = None) -> list[RolloutInfo]:
        """Frozen rollouts with a cursor greater than ``after``, in cursor order."""
        return await self._read(self._list_frozen, after, limit)

    async def list_episodes(self, base_rollout_id: str) -> list[str]:
        """Episode ids of ``base_rollout_id``, stored or tombstoned, sorted."""
        return await self._read(self._list_episodes, base_rollout_id)

    async def health(self) -> dict[str, Any]:
        return await self._read(self._health)
