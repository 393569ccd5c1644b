"""The embedded store: one SQLite database in WAL mode, arrays as BLOBs.

Owns the table layout and the durability settings. ``synchronous=FULL`` in WAL mode (the
default) makes every committed transaction survive a crash or power loss, so a ``put_call``
that returned is durable; ``synchronous=NORMAL`` (opt-in) keeps that across a crash of this
process only (the commit is in the OS's page cache, fsynced at checkpoints). Record encoding
is the core codec's, what each operation decides ``lifecycle``'s and the async methods
``threaded``'s; this module holds the SQL and moves bytes.

Threads: the event loop never touches the database. Each store operation is ONE synchronous
function run on a ``WorkerThread`` (one thread, one queue), so it costs one hop off the loop
and back however many statements it runs:
- the writer thread (``capture-store-writer``) owns the read-write connection and runs every
  write transaction (``put_call`` encodes, chooses the prompt parent and commits there; the
  puts queued while a commit ran share the next one: group commit, ``sqlite_puts``). One
  thread: writes serialise on it, no lock is needed.
- the reader thread (``capture-store-reader``) owns a separate read-only connection and runs
  every read, decoding included. WAL readers neither block the writer nor wait for it, and
  each read sees every transaction committed before it started (autocommit: one snapshot per
  statement).
Each connection is used only by the thread that opened it (``check_same_thread``).

Layout (``<store dir>/captures.sqlite3``, ``PRAGMA user_version`` = ``LAYOUT_VERSION``):
- ``calls``: one row per call in the codec's stored form (schema v4): JSON metadata beside four
  BLOB arrays; ``prompt_token_ids`` holds only the ids after the call's prompt parent
  (``prompt_parent_call_id``, ``prompt_prefix_len``), chosen inside the write transaction by
  the core's prefix rule (``core.prefixes``) from the digests kept per row (``tokens_sha256``,
  ``num_prompt_tokens``, ``num_generation_tokens``). A prompt parent is always an earlier row
  of the same rollout, so deleting a rollout never orphans a prompt. ``messages_delta`` holds
  only the request messages after the first ``messages_prefix_len``, which are the prompt
  parent's (``codec.common_messages_prefix`` over the chain digests kept per row: usually one
  row read), so a chain's JSON grows linearly too.
- ``json_blobs``: content-addressed JSON (SHA-256 of the canonical text -> text): tools lists
  and large system messages, stored once however many calls refer to them. ``call_json``
  lists which call refers to which, except texts that one of the call's prompt ancestors
  refers to (the writer leaves those out when it remembers them, ``sqlite_puts``): every read
  of a call reads its ancestors' texts too. Deleting a rollout deletes the texts no other call
  refers to, in the same transaction. The writer remembers the addresses it stored (until any
  other write transaction, which may delete) and writes only the reference for those.
- ``rollouts``: first-seen time, the number of calls (``num_calls``, kept by every put and
  delete, so that a listing counts no rows), the number of chains a training read builds
  (``num_chains``, kept by every put, ``core.chain_counts``; NULL where it cannot be kept),
  the rollout-level incomplete flag (``incomplete``: set by ``mark_rollout_incomplete`` only)
  beside ``incomplete_calls`` (the calls counted in the rollout that are incomplete and that
  no complete retry supersedes, ``core.completeness``, recounted by ``put_call`` when it
  stores an incomplete call or a retry), rollout-level diagnostics, the revision
  (``version``), the trainer's ``metadata`` (JSON) and, once frozen, the snapshot
  (``snapshot_id``, ``frozen_at``, ``frozen_num_calls``, ``export_cursor``).
- ``calls.late``: 1 for a call stored after its rollout was frozen (decided inside
  ``put_call``'s transaction, so a call racing the freeze is either in the snapshot or late).
  ``calls.retry_of``: the call it retries (``CallRecord.retry_of``, also in ``meta``), kept
  as a column so that completeness is counted without decoding records, from the new call's
  retry family only (``sql.RETRY_FAMILY``). ``calls.child_digest``: ``linking.child_digest``,
  indexed for a replica's refresh (``get_calls_by_child_digest``).
- ``tombstones``: deleted rollouts and when (Unix s); writes to them are refused. A retired
  rollout's tombstone keeps the snapshot id, version and deleted-call count, so a retried
  retire answers the same.
- ``counters``: store-wide sequences (``export_cursor``: the last cursor handed out) and
  counts (``calls``: the calls stored, kept by every put and delete, for ``/health``).

Reads that span several statements (calls, then their JSON texts) run in one read
transaction, so they see one snapshot.

The statements and the transaction bodies of every operation but ``put_call`` are
``sql.py``'s (``SQLStore``, dialect ``SQLITE``); the DDL and the migration of an older store's
layout ``sqlite_layout.py``'s (``LAYOUT_VERSION``); ``put_call``'s statements and its group
commit ``sqlite_puts.py``'s. This module holds the threads, the connections and the writer
lock.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

from capture_proxy.core.episodes import episode_glob
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.stored import StoredCall, of_row
from capture_proxy.core.records import CallRecord
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.store import lifecycle
from capture_proxy.store.base import StoreError
from capture_proxy.store.sql import SQLITE
from capture_proxy.store.sqlite_layout import migrate_layout, write_transaction
from capture_proxy.store.sqlite_puts import SQLitePuts
from capture_proxy.store.sqlite_wal import WRITER_LOCK_WAIT_S
from capture_proxy.store.transactions import SQLStore
from capture_proxy.store.worker import WorkerThread

T = TypeVar("T")

#: A rollout's rows after a rowid, with the columns ``linking.stored.of_row`` reads.
_STORED_SINCE = (
    "SELECT rowid, call_id, created_at, status, schema_version, meta, tokens_sha256, "
    "tokens_block_sha256, retry_of, messages_prefix_len, num_messages, messages_chain "
    "FROM calls WHERE rollout_id = ? AND rowid > ? ORDER BY rowid"
)
_LAST_ROWID = "SELECT max(rowid) FROM calls WHERE rollout_id = ?"

DB_FILE_NAME = "captures.sqlite3"
#: Held (flock, exclusive) by the one process that writes the store; names its pid.
WRITER_LOCK_NAME = "writer.lock"
#: How long a connection waits for a lock held by another process before failing (ms).
BUSY_TIMEOUT_MS = 10_000


class SQLiteStore(SQLStore):
    """Embedded store in directory ``path`` (created on first use). Its ``CaptureStore``
    methods are ``ThreadedStore``'s: writes hop to the writer thread, reads to the reader."""

    #: One process owns the store: its caches are never stale.
    shared = False
    dialect = SQLITE
    _driver_error = sqlite3.Error

    def __init__(
        self,
        path: Path,
        *,
        synchronous: Literal["full", "normal"] = "full",
        exclusive: bool = True,
    ) -> None:
        """``synchronous``: SQLite's mode for the WAL. ``full`` (the default) fsyncs every
        commit, so a returned ``put_call`` survives a power loss; ``normal`` survives a crash
        of this process but not of the machine (see ``Settings.store_synchronous``).
        ``exclusive``: hold the store's writer lock while open, so a second proxy on the same
        directory refuses to start (``open`` raises StoreError) rather than keep a link index
        blind to the other's calls; False for readers (``serve --read-only``, ``show``)."""
        if synchronous not in ("full", "normal"):
            raise ValueError(f"synchronous: expected 'full' or 'normal', got {synchronous!r}")
        self.synchronous = synchronous
        self.path = Path(path)
        self.db_path = self.path / DB_FILE_NAME
        # Each worker is one thread, which alone uses the connection beside it.
        self._writer: WorkerThread | None = None
        self._reader: WorkerThread | None = None
        self._wdb: sqlite3.Connection | None = None  # writer thread only
        self._rdb: sqlite3.Connection | None = None  # reader thread only
        self.exclusive = exclusive
        self._lock_file: IO[str] | None = None
        #: the puts and what the writer remembers of them (writer thread only)
        self._puts = SQLitePuts(keep=exclusive)

    # --- threads -------------------------------------------------------------------------

    async def _write_hop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(writer connection, *args)`` on the writer thread (one hop)."""
        if self._writer is None:
            raise StoreError("store is not open")
        return await self._writer.run(self._with_writer, fn, *args)

    def _with_writer(self, fn: Callable[..., T], *args: Any) -> T:
        if self._wdb is None:
            raise StoreError("store is not open")
        return fn(self._wdb, *args)

    async def _read_hop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(reader connection, *args)`` on the reader thread (one hop); dropped unrun
        when its caller gave up before the thread took it (``WorkerThread``)."""
        if self._reader is None:
            raise StoreError("store is not open")
        return await self._reader.run_unless_abandoned(self._with_reader, fn, *args)

    def _with_reader(self, fn: Callable[..., T], *args: Any) -> T:
        if self._rdb is None:
            raise StoreError("store is not open")
        return fn(self._rdb, *args)

    # --- open / close --------------------------------------------------------------------

    def _take_writer_lock(self) -> None:
        """An exclusive advisory lock on ``<store>/writer.lock`` (released by the kernel when
        the process ends, also on SIGKILL). Raises StoreError when another process (or store
        object) holds it for ``WRITER_LOCK_WAIT_S``."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock = open(self.path / WRITER_LOCK_NAME, "a+")  # noqa: SIM115 (held while open)
        try:
            # A worker of a supervisor that died holds it a moment (``sqlite_wal``): wait.
            deadline = time.monotonic() + WRITER_LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.02)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise StoreError(
                f"store {self.path} is in use by {holder}: one proxy per embedded store "
                "(replicas share a PostgreSQL store: --store postgresql://...; browse a store in "
                "use with serve --read-only or show)"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        self._lock_file = lock

    def _release_writer_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing the descriptor releases the lock
            self._lock_file = None

    async def open(self) -> None:
        if self._writer is not None:
            raise StoreError("store is already open")
        if self.exclusive:
            try:
                self._take_writer_lock()
            except OSError as exc:
                raise StoreError(f"cannot open store at {self.path}: {exc}") from exc
        self._writer = WorkerThread("capture-store-writer")
        self._reader = WorkerThread("capture-store-reader")
        try:
            # The writer creates (or migrates) the schema before the read-only reader opens.
            await self._writer.run(self._open_writer)
            await self._reader.run(self._open_reader)
        except BaseException as exc:
            await self._shutdown()
            if isinstance(exc, OSError | sqlite3.Error):
                raise StoreError(f"cannot open store at {self.db_path}: {exc}") from exc
            raise

    def _open_writer(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.db_path, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self.synchronous.upper()}")
            db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            migrate_layout(db, self.db_path)
        except BaseException:
            db.close()
            raise
        self._wdb = db

    def _open_reader(self) -> None:
        uri = f"{self.db_path.resolve().as_uri()}?mode=ro"
        db = sqlite3.connect(uri, uri=True, isolation_level=None)
        try:
            db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        except BaseException:
            db.close()
            raise
        self._rdb = db

    async def close(self) -> None:
        await self._shutdown()

    async def _shutdown(self) -> None:
        """Close each connection on its own thread (after every operation queued before it),
        then stop the threads. Idempotent; later operations fail with "store is not open"."""
        reader, writer = self._reader, self._writer
        self._reader = self._writer = None  # no new operation from here on
        try:
            await self._stop_workers(reader, writer)
        finally:
            self._release_writer_lock()

    async def _stop_workers(self, reader: WorkerThread | None, writer: WorkerThread | None) -> None:
        # Reader first: the writer's connection, closed last, checkpoints the WAL.
        for worker, close in ((reader, self._close_reader), (writer, self._close_writer)):
            if worker is None:
                continue
            try:
                await worker.run(close)
            finally:
                await worker.stop()  # the thread is idle once ``close`` ran

    def _close_reader(self) -> None:
        if self._rdb is not None:
            db, self._rdb = self._rdb, None
            db.close()

    def _close_writer(self) -> None:
        if self._wdb is not None:
            db, self._wdb = self._wdb, None
            db.close()

    # --- transactions --------------------------------------------------------------------

    def _transaction(
        self, db: sqlite3.Connection, rollout_id: str | None, body: Callable[[], T]
    ) -> T:
        """One ``BEGIN IMMEDIATE`` transaction (writes serialise on the one writer thread, so
        ``rollout_id`` needs no lock of its own)."""
        self._puts.forget(rollout_id)  # it may delete texts and calls
        return write_transaction(db, body)

    def _read_transaction(self, db: sqlite3.Connection, body: Callable[[], T]) -> T:
        """Run ``body`` in one read transaction (one snapshot for all its statements)."""
        db.execute("BEGIN")
        try:
            return body()
        finally:
            if db.in_transaction:
                db.execute("ROLLBACK")

    # --- writes (writer thread) ----------------------------------------------------------

    async def _put_hop(
        self,
        record: CallRecord,
        request: RequestEncoding | None,
        digests: RecordDigests | None = None,
    ) -> int | None:
        """One put, committed with the puts queued behind it (``SQLitePuts.group``)."""
        if self._writer is None:
            raise StoreError("store is not open")
        return await self._writer.run_grouped(self._put_group, record, request, digests)  # type: ignore[no-any-return]

    def _put_group(
        self, items: list[tuple[Any, ...]]
    ) -> list[tuple[int | None, BaseException | None]]:
        if self._wdb is None:
            raise StoreError("store is not open")
        return self._puts.group(self._wdb, items)

    def _put(
        self, db: sqlite3.Connection, record: CallRecord, request: RequestEncoding | None
    ) -> int:
        """Store one record in its own transaction (writer thread); the bytes new to the
        store."""
        ((written, error),) = self._puts.group(db, [(record, request, None)])
        if error is not None:
            raise error
        assert written is not None
        return written

    # --- the link index's catch-up (reader thread; ``store.remote``) ---------------------

    async def rollout_index_facts(self, rollout_id: str) -> list[StoredCall] | None:
        """The index facts of the rollout's rows from its first (``_stored_since``)."""
        facts, _ = await self._read(self._stored_since, rollout_id, 0)
        return facts

    @staticmethod
    def _stored_since(
        db: sqlite3.Connection, rollout_id: str, after_rowid: int
    ) -> tuple[list[StoredCall] | None, int]:
        """The index facts of the rollout's calls stored after row ``after_rowid`` (in the
        order they were stored: a rollout's new rows get larger rowids, whatever was deleted),
        and the largest rowid read (``after_rowid`` when none); None for the facts when a row
        cannot tell them (read the rollout whole)."""
        rows = db.execute(_STORED_SINCE, (rollout_id, after_rowid)).fetchall()
        calls = [of_row(*row[1:]) for row in rows]
        last = rows[-1][0] if rows else after_rowid
        return (None if None in calls else calls), last  # type: ignore[return-value]

    @staticmethod
    def _last_rowid(db: sqlite3.Connection, rollout_id: str) -> int:
        row = db.execute(_LAST_ROWID, (rollout_id,)).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    @staticmethod
    def _list_episodes(db: sqlite3.Connection, base: str) -> list[str]:
        pattern = episode_glob(base)
        rows = db.execute(
            "SELECT rollout_id FROM rollouts WHERE rollout_id = ? OR rollout_id GLOB ? "
            "UNION SELECT rollout_id FROM tombstones WHERE rollout_id = ? OR rollout_id GLOB ?",
            (base, pattern, base, pattern),
        ).fetchall()
        return lifecycle.episodes_of(base, (r[0] for r in rows))

    def _health(self, db: sqlite3.Connection) -> dict[str, Any]:
        # The count kept by every put and delete (layout 7): one row, whatever the size.
        row = db.execute("SELECT value FROM counters WHERE name = 'calls'").fetchone()
        return {
            "kind": "sqlite",
            "path": str(self.db_path),
            "synchronous": self.synchronous,
            "calls": row[0] if row else 0,
        }
