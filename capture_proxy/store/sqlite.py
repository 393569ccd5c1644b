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
  write transaction (``put_call`` encodes, chooses the prompt parent and commits there). One
  thread: writes serialise on it, no lock is needed.
- the reader thread (``capture-store-reader``) owns a separate read-only connection and runs
  every read, decoding included. WAL readers neither block the writer nor wait for it, and
  each read sees every transaction committed before it started (autocommit: one snapshot per
  statement).
Each connection is used only by the thread that opened it (``check_same_thread``).

Layout (``<store dir>/captures.sqlite3``, ``PRAGMA user_version`` = ``LAYOUT_VERSION``):
- ``calls``: one row per call in the codec's stored form (schema v3): JSON metadata beside four
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
  lists which call refers to which; deleting a rollout deletes the texts no other call
  refers to, in the same transaction.
- ``rollouts``: first-seen time, the rollout-level incomplete flag (``incomplete``: set by
  ``mark_rollout_incomplete`` only) beside ``incomplete_calls`` (the calls counted in the
  rollout that are incomplete and that no complete retry supersedes, ``core.completeness``,
  recounted by ``put_call`` when it stores an incomplete call or a retry), rollout-level
  diagnostics, the revision
  (``version``), the trainer's ``metadata`` (JSON) and, once frozen, the snapshot
  (``snapshot_id``, ``frozen_at``, ``frozen_num_calls``, ``export_cursor``).
- ``calls.late``: 1 for a call stored after its rollout was frozen (decided inside
  ``put_call``'s transaction, so a call racing the freeze is either in the snapshot or late).
  ``calls.retry_of``: the call it retries (``CallRecord.retry_of``, also in ``meta``), kept
  as a column so that completeness is counted without decoding records.
- ``tombstones``: deleted rollouts and when (Unix s); writes to them are refused. A retired
  rollout's tombstone keeps the snapshot id, version and deleted-call count, so a retried
  retire answers the same.
- ``counters``: store-wide sequences (``export_cursor``: the last cursor handed out).

Reads that span several statements (calls, then their JSON texts) run in one read
transaction, so they see one snapshot.

Opening an older store migrates it in one transaction: missing columns and tables are added,
every record older than the codec's schema version is rewritten through ``codec.migrate``, and
v2 records' whole messages are re-split against their prompt parents' (``rebase_messages``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

from capture_proxy.core.codec import (
    COLUMNS,
    SCHEMA_VERSION,
    EncodedRecord,
    RequestEncoding,
    StoredMessages,
    column_values,
    decode_records,
    migrate,
    rebase_messages,
)
from capture_proxy.core.completeness import RetryLink, unsuperseded_incomplete
from capture_proxy.core.episodes import episode_glob
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.prefixes import StoredPrefix, choose_prompt_parent
from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic
from capture_proxy.store import lifecycle
from capture_proxy.store.base import (
    Retirement,
    RolloutInfo,
    Snapshot,
    StoreError,
)
from capture_proxy.store.lifecycle import LifecycleRow, Tombstone
from capture_proxy.store.threaded import ThreadedStore
from capture_proxy.store.worker import WorkerThread

DB_FILE_NAME = "captures.sqlite3"
#: Held (flock, exclusive) by the one process that writes the store; names its pid.
WRITER_LOCK_NAME = "writer.lock"
#: Table layout version (``PRAGMA user_version``); 0 is the layout of schema v1 records,
#: 4 added the lifecycle (snapshots, late calls, metadata, retirements), 5 the retry link
#: (``calls.retry_of``) and ``rollouts.incomplete_calls``, 6 the indexes that keep a put's
#: reads bounded whatever the rollout's size (``calls_by_prefix``, ``calls_retry_links``,
#: ``calls_late``).
LAYOUT_VERSION = 6
#: How long a connection waits for a lock held by another process before failing (ms).
BUSY_TIMEOUT_MS = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,
    schema_version INTEGER NOT NULL,
    meta TEXT NOT NULL,
    prompt_token_ids BLOB NOT NULL,
    generation_token_ids BLOB NOT NULL,
    generation_log_probs BLOB NOT NULL,
    routed_experts BLOB,
    prompt_parent_call_id TEXT,
    prompt_prefix_len INTEGER NOT NULL DEFAULT 0,
    num_prompt_tokens INTEGER NOT NULL DEFAULT 0,
    num_generation_tokens INTEGER NOT NULL DEFAULT 0,
    tokens_sha256 BLOB NOT NULL DEFAULT x'',
    messages_delta TEXT NOT NULL DEFAULT '[]',
    messages_prefix_len INTEGER NOT NULL DEFAULT 0,
    num_messages INTEGER NOT NULL DEFAULT 0,
    messages_sha256 BLOB NOT NULL DEFAULT x'',
    messages_chain BLOB NOT NULL DEFAULT x'',
    late INTEGER NOT NULL DEFAULT 0,
    retry_of TEXT
);
CREATE INDEX IF NOT EXISTS calls_by_rollout ON calls (rollout_id, created_at);
CREATE TABLE IF NOT EXISTS json_blobs (
    sha256 BLOB PRIMARY KEY,
    json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS call_json (
    call_id TEXT NOT NULL,
    sha256 BLOB NOT NULL,
    PRIMARY KEY (call_id, sha256)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS call_json_by_sha ON call_json (sha256);
CREATE TABLE IF NOT EXISTS tombstones (
    rollout_id TEXT PRIMARY KEY,
    deleted_at REAL NOT NULL,
    snapshot_id TEXT,
    version INTEGER,
    deleted_calls INTEGER
);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0,
    diagnostics TEXT NOT NULL DEFAULT '[]',
    version INTEGER NOT NULL DEFAULT 0,
    incomplete_calls INTEGER NOT NULL DEFAULT 0,
    metadata TEXT NOT NULL DEFAULT '{}',
    snapshot_id TEXT,
    frozen_at REAL,
    frozen_num_calls INTEGER,
    export_cursor INTEGER
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""
# Created after the columns exist (an older store gets them in the migration first).
_INDEXES = """
CREATE UNIQUE INDEX IF NOT EXISTS rollouts_by_cursor ON rollouts (export_cursor)
    WHERE export_cursor IS NOT NULL;
CREATE INDEX IF NOT EXISTS calls_by_prefix ON calls
    (rollout_id, num_prompt_tokens + num_generation_tokens, tokens_sha256, created_at, call_id)
    WHERE status = 'complete' AND num_generation_tokens > 0;
CREATE INDEX IF NOT EXISTS calls_retry_links ON calls (rollout_id)
    WHERE late = 0 AND (status = 'incomplete' OR retry_of IS NOT NULL);
CREATE INDEX IF NOT EXISTS calls_late ON calls (rollout_id, created_at, call_id) WHERE late = 1;
"""

# In ``EncodedRecord`` field order.
_CALL_COLUMNS = ", ".join(COLUMNS)
# The codec's columns, then the store's own: ``late``, ``retry_of``.
_INSERT_CALL = (
    f"INSERT OR IGNORE INTO calls ({_CALL_COLUMNS}, late, retry_of) "
    f"VALUES ({','.join('?' * (len(COLUMNS) + 2))})"
)
_V2_COLUMNS = {
    "prompt_parent_call_id": "TEXT",
    "prompt_prefix_len": "INTEGER NOT NULL DEFAULT 0",
    "num_prompt_tokens": "INTEGER NOT NULL DEFAULT 0",
    "num_generation_tokens": "INTEGER NOT NULL DEFAULT 0",
    "tokens_sha256": "BLOB NOT NULL DEFAULT x''",
}
_V3_COLUMNS = {
    "messages_delta": "TEXT NOT NULL DEFAULT '[]'",
    "messages_prefix_len": "INTEGER NOT NULL DEFAULT 0",
    "num_messages": "INTEGER NOT NULL DEFAULT 0",
    "messages_sha256": "BLOB NOT NULL DEFAULT x''",
    "messages_chain": "BLOB NOT NULL DEFAULT x''",
}
# Layout 4, per table.
_V4_COLUMNS = {
    "calls": {"late": "INTEGER NOT NULL DEFAULT 0"},
    "rollouts": {
        "version": "INTEGER NOT NULL DEFAULT 0",
        "metadata": "TEXT NOT NULL DEFAULT '{}'",
        "snapshot_id": "TEXT",
        "frozen_at": "REAL",
        "frozen_num_calls": "INTEGER",
        "export_cursor": "INTEGER",
    },
    "tombstones": {"snapshot_id": "TEXT", "version": "INTEGER", "deleted_calls": "INTEGER"},
}
_V5_COLUMNS = {
    "calls": {"retry_of": "TEXT"},
    "rollouts": {"incomplete_calls": "INTEGER NOT NULL DEFAULT 0"},
}
# A rollout's tombstone and ``rollouts`` row (``lifecycle.state_of``); one row, NULLs for none.
_STATE = (
    f"SELECT {lifecycle.STATE_COLUMNS} FROM (SELECT ? AS id) k "
    "LEFT JOIN tombstones t ON t.rollout_id = k.id LEFT JOIN rollouts r ON r.rollout_id = k.id"
)
# The calls completeness depends on (``core.completeness``): counted, incomplete or a retry.
_RETRY_LINKS = (
    "SELECT call_id, status, retry_of FROM calls WHERE rollout_id = ? AND late = 0 "
    "AND (status = 'incomplete' OR retry_of IS NOT NULL)"
)
# The JSON texts the given calls refer to (``{calls}``: a subquery of call ids).
_BLOBS_OF = (
    "SELECT b.sha256, b.json FROM json_blobs b WHERE b.sha256 IN "
    "(SELECT j.sha256 FROM call_json j WHERE j.call_id IN ({calls}))"
)
_ANCESTRY = (
    "WITH RECURSIVE anc(id) AS (SELECT ? UNION ALL SELECT c.prompt_parent_call_id "
    "FROM calls c JOIN anc ON c.call_id = anc.id "
    "WHERE c.prompt_parent_call_id IS NOT NULL) "
)
_ROLLOUT_SELECT = (
    "SELECT r.rollout_id, r.created_at, r.incomplete <> 0 OR r.incomplete_calls > 0, "
    "r.diagnostics, (SELECT count(*) FROM calls c WHERE c.rollout_id = r.rollout_id), "
    "r.version, r.metadata, r.snapshot_id, r.frozen_at, r.frozen_num_calls, r.export_cursor, "
    "(SELECT json_group_array(call_id) FROM (SELECT call_id FROM calls c "
    "WHERE c.rollout_id = r.rollout_id AND c.late = 1 ORDER BY created_at, call_id)) "
    "FROM rollouts r"
)

T = TypeVar("T")


def _row_to_encoded(
    row: sqlite3.Row | tuple[Any, ...], blobs: dict[str, str] | None = None
) -> EncodedRecord:
    encoded = EncodedRecord(*row)
    return encoded if blobs is None else dataclasses.replace(encoded, json_blobs=blobs)


def _blobs(db: sqlite3.Connection, calls_sql: str, args: tuple[Any, ...]) -> dict[str, str]:
    rows = db.execute(_BLOBS_OF.format(calls=calls_sql), args).fetchall()
    return {bytes(sha).hex(): text for sha, text in rows}


def _store_json(db: sqlite3.Connection, enc: EncodedRecord) -> int:
    """Keep the record's content-addressed JSON (once per content) and its references.
    Returns the UTF-8 bytes of the texts that were new to the store."""
    written = 0
    for sha, text in enc.json_blobs.items():
        key = bytes.fromhex(sha)
        cur = db.execute(
            "INSERT OR IGNORE INTO json_blobs (sha256, json) VALUES (?, ?)", (key, text)
        )
        if cur.rowcount:
            written += len(text.encode())
        db.execute(
            "INSERT OR IGNORE INTO call_json (call_id, sha256) VALUES (?, ?)", (enc.call_id, key)
        )
    return written


def _encoded_bytes(enc: EncodedRecord) -> int:
    """The bytes of a call's own row: metadata, arrays and message delta (not SQLite's
    page overhead)."""
    return (
        len(enc.meta.encode())
        + len(enc.prompt_token_ids)
        + len(enc.generation_token_ids)
        + len(enc.generation_log_probs)
        + len(enc.routed_experts or b"")
        + len(enc.messages_delta.encode())
    )


def _read_transaction(db: sqlite3.Connection, body: Callable[[], T]) -> T:
    """Run ``body`` in one read transaction (one snapshot for all its statements)."""
    db.execute("BEGIN")
    try:
        return body()
    finally:
        if db.in_transaction:
            db.execute("ROLLBACK")


def _info(row: tuple[Any, ...]) -> RolloutInfo:
    """From a row of ``_ROLLOUT_SELECT`` (late call ids as a JSON array)."""
    return lifecycle.rollout_info(row[:-1], json.loads(row[-1]))


def _next_counter(db: sqlite3.Connection, name: str) -> int:
    db.execute(
        "INSERT INTO counters (name, value) VALUES (?, 1) "
        "ON CONFLICT(name) DO UPDATE SET value = value + 1",
        (name,),
    )
    row = db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
    return int(row[0])


def _delete_rows(db: sqlite3.Connection, rollout_id: str) -> int:
    """Delete a rollout's calls, their unshared JSON texts and its bookkeeping (inside the
    caller's transaction). Returns the number of calls deleted."""
    calls = "SELECT call_id FROM calls WHERE rollout_id = ?"
    shas = [
        r[0]
        for r in db.execute(
            f"SELECT DISTINCT sha256 FROM call_json WHERE call_id IN ({calls})", (rollout_id,)
        ).fetchall()
    ]
    db.execute(f"DELETE FROM call_json WHERE call_id IN ({calls})", (rollout_id,))
    for sha in shas:  # texts no remaining call refers to
        db.execute(
            "DELETE FROM json_blobs WHERE sha256 = ? AND NOT EXISTS "
            "(SELECT 1 FROM call_json WHERE sha256 = ?)",
            (sha, sha),
        )
    deleted = db.execute("DELETE FROM calls WHERE rollout_id = ?", (rollout_id,)).rowcount
    db.execute("DELETE FROM rollouts WHERE rollout_id = ?", (rollout_id,))
    return int(deleted)


def _transaction(db: sqlite3.Connection, body: Callable[[], T]) -> T:
    """Run ``body`` in ``BEGIN IMMEDIATE`` ... ``COMMIT``; roll back on any exception (unless
    SQLite already did, e.g. after SQLITE_FULL, so the original error is the one raised)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        result = body()
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    return result


def _stored_messages(db: sqlite3.Connection, call_id: str) -> StoredMessages | None:
    row = db.execute(
        "SELECT prompt_parent_call_id, messages_prefix_len, num_messages, messages_chain "
        "FROM calls WHERE call_id = ?",
        (call_id,),
    ).fetchone()
    return StoredMessages(call_id, row[0], row[1], row[2], bytes(row[3])) if row else None


def _retry_links(db: sqlite3.Connection, rollout_id: str) -> list[RetryLink]:
    return [RetryLink(*r) for r in db.execute(_RETRY_LINKS, (rollout_id,)).fetchall()]


def _count_incomplete(db: sqlite3.Connection, rollout_id: str) -> int:
    """The rollout's counted calls that are incomplete and superseded by no complete retry."""
    return len(unsuperseded_incomplete(_retry_links(db, rollout_id)))


def _state(db: sqlite3.Connection, rollout_id: str) -> tuple[Tombstone | None, LifecycleRow | None]:
    """The rollout's tombstone and ``rollouts`` row (``lifecycle.state_of``), one statement."""
    row = db.execute(_STATE, (rollout_id,)).fetchone()
    return lifecycle.state_of(row)


# The rollout's prompt-parent candidates in a range of prompt + generation lengths: a range
# of the partial index ``calls_by_prefix`` (literal ``'complete'``, so that the planner may
# use it), read from the index alone, never the rollout's other rows.
_CANDIDATES = (
    "SELECT call_id, created_at, num_prompt_tokens + num_generation_tokens, tokens_sha256 "
    "FROM calls INDEXED BY calls_by_prefix WHERE rollout_id = ? AND status = 'complete' "
    "AND num_generation_tokens > 0 "
    "AND num_prompt_tokens + num_generation_tokens BETWEEN ? AND ?"
)


def _candidates(db: sqlite3.Connection, record: CallRecord, floor: int) -> list[StoredPrefix]:
    """The rollout's complete calls with output whose prompt + generation length is in
    ``[floor, len(record prompt)]``: the prompt parents it may have (an index range: the
    rows read are the ones returned)."""
    return [
        StoredPrefix(r[0], r[1], r[2], r[3])
        for r in db.execute(
            _CANDIDATES, (record.rollout_id, floor, record.num_prompt_tokens)
        ).fetchall()
    ]


def _parent_depth(db: sqlite3.Connection, record: CallRecord) -> int:
    """Prompt + generation length of the record's verified parent when it is a stored
    complete call of the rollout with output (its tokens are a prefix of the record's prompt,
    the linker checked), else 0."""
    if record.parent_call_id is None:
        return 0
    row = db.execute(
        "SELECT num_prompt_tokens + num_generation_tokens FROM calls WHERE call_id = ? "
        "AND rollout_id = ? AND status = ? AND num_generation_tokens > 0",
        (record.parent_call_id, record.rollout_id, CallStatus.COMPLETE.value),
    ).fetchone()
    if row is None or row[0] > record.num_prompt_tokens:
        return 0
    return int(row[0])


class SQLiteStore(ThreadedStore):
    """Embedded store in directory ``path`` (created on first use). Its ``CaptureStore``
    methods are ``ThreadedStore``'s: writes hop to the writer thread, reads to the reader."""

    #: One process owns the store: its caches are never stale.
    shared = False
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
        """Run ``fn(reader connection, *args)`` on the reader thread (one hop)."""
        if self._reader is None:
            raise StoreError("store is not open")
        return await self._reader.run(self._with_reader, fn, *args)

    def _with_reader(self, fn: Callable[..., T], *args: Any) -> T:
        if self._rdb is None:
            raise StoreError("store is not open")
        return fn(self._rdb, *args)

    # --- open / close --------------------------------------------------------------------

    def _take_writer_lock(self) -> None:
        """An exclusive advisory lock on ``<store>/writer.lock`` (released by the kernel when
        the process ends, also on SIGKILL). Raises StoreError when another process (or store
        object) holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock = open(self.path / WRITER_LOCK_NAME, "a+")  # noqa: SIM115 (held while open)
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
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
            self._migrate_layout(db)
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

    def _migrate_layout(self, db: sqlite3.Connection) -> None:
        """Create the tables, or bring an older store's to ``LAYOUT_VERSION`` (one
        transaction: a crash leaves the old layout, and the next open migrates again)."""
        row = db.execute("PRAGMA user_version").fetchone()
        version = int(row[0]) if row else 0
        if version > LAYOUT_VERSION:
            raise StoreError(
                f"store at {self.db_path} has layout {version}; this reader knows up to "
                f"{LAYOUT_VERSION}"
            )
        # CREATE ... IF NOT EXISTS leaves an older ``calls`` table as it is; executescript
        # runs outside the transaction below, which adds the missing columns.
        db.executescript(_SCHEMA)

        def body() -> None:
            columns = {
                "calls": _V2_COLUMNS | _V3_COLUMNS | _V4_COLUMNS["calls"] | _V5_COLUMNS["calls"],
                "rollouts": _V4_COLUMNS["rollouts"] | _V5_COLUMNS["rollouts"],
                "tombstones": _V4_COLUMNS["tombstones"],
            }
            for table, wanted in columns.items():
                existing = {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
                for name, decl in wanted.items():
                    if name not in existing:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
            if version < 4:
                # Before the lifecycle every stored call counted: the revision is their count.
                db.execute(
                    "UPDATE rollouts SET version = (SELECT count(*) FROM calls c "
                    "WHERE c.rollout_id = rollouts.rollout_id)"
                )
            # The indexes need the columns (executescript would commit: one statement each).
            for statement in _INDEXES.strip().split(";"):
                if statement.strip():
                    db.execute(statement)
            rollouts = [
                r[0]
                for r in db.execute(
                    "SELECT DISTINCT rollout_id FROM calls WHERE schema_version < ?",
                    (SCHEMA_VERSION,),
                ).fetchall()
            ]
            for rollout_id in rollouts:  # one rollout in memory at a time
                self._migrate_rollout(db, rollout_id)
            if version < 5:
                self._count_incomplete_calls(db)
            db.execute(f"PRAGMA user_version={LAYOUT_VERSION}")

        _transaction(db, body)

    @staticmethod
    def _count_incomplete_calls(db: sqlite3.Connection) -> None:
        """Layout 5: the retry links out of the records' metadata, the incomplete calls counted
        per rollout, and ``rollouts.incomplete`` kept only where a rollout-level diagnostic
        set it (before, it also said that some call was incomplete, superseded or not)."""
        db.execute(
            "UPDATE calls SET retry_of = json_extract(meta, '$.retry_of') "
            "WHERE json_valid(meta) AND json_extract(meta, '$.retry_of') IS NOT NULL"
        )
        db.execute("UPDATE rollouts SET incomplete = 0 WHERE diagnostics = '[]'")
        rollouts = db.execute(
            "SELECT DISTINCT rollout_id FROM calls WHERE late = 0 "
            "AND (status = 'incomplete' OR retry_of IS NOT NULL)"
        ).fetchall()
        for (rollout_id,) in rollouts:
            db.execute(
                "UPDATE rollouts SET incomplete_calls = ? WHERE rollout_id = ?",
                (_count_incomplete(db, rollout_id), rollout_id),
            )

    @staticmethod
    def _migrate_rollout(db: sqlite3.Connection, rollout_id: str) -> None:
        """Rewrite a rollout's older records in the current schema. Records that held whole
        messages (v1, v2) are re-split against their prompt parents' messages when those were
        whole too, so an old store's chains grow linearly from now on."""
        rows = [
            _row_to_encoded(tuple(r))
            for r in db.execute(
                f"SELECT {_CALL_COLUMNS} FROM calls WHERE rollout_id = ? "
                "ORDER BY created_at, call_id",
                (rollout_id,),
            ).fetchall()
        ]
        old_ids = {r.call_id for r in rows if r.schema_version < SCHEMA_VERSION}
        whole: dict[str, list[Any]] = {}  # call id -> full messages of a v1/v2 record
        for enc in rows:
            if enc.call_id in old_ids:
                whole[enc.call_id] = json.loads(enc.meta).get("request_messages") or []
        # Children after their parents is not needed: bases are v1/v2 rows' whole messages.
        for enc in rows:
            if enc.schema_version >= SCHEMA_VERSION:
                continue
            new = migrate(enc)
            parent = new.prompt_parent_call_id
            if parent is not None and parent in whole:
                new = rebase_messages(new, whole[new.call_id], whole[parent])
            sets = ", ".join(f"{c}=?" for c in COLUMNS[1:])
            db.execute(
                f"UPDATE calls SET {sets} WHERE call_id=?", (*column_values(new)[1:], new.call_id)
            )
            _store_json(db, new)

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

    # --- writes (writer thread) ----------------------------------------------------------

    @staticmethod
    def _put(db: sqlite3.Connection, record: CallRecord, request: RequestEncoding | None) -> int:
        """Store one record (writer thread); the JSON bytes new to the store."""

        def body() -> int:
            tomb, rollout = _state(db, record.rollout_id)
            lifecycle.refuse_deleted(record, tomb is not None)
            frozen = rollout is not None and rollout.frozen
            links = _retry_links(db, record.rollout_id) if lifecycle.may_recount(record) else []
            # Inside the transaction: no candidate can appear or vanish before the insert.
            # The deepest candidate wins, and a verified parent is one (its tokens are a prefix
            # of the record's prompt): only candidates at least as deep are read, so a call of
            # a long rollout reads a row or two, not every call before it.
            # (A parent that is not a prefix, a record put by hand, falls back to all.)
            floor = _parent_depth(db, record)
            parent = choose_prompt_parent(
                record.prompt_token_ids, _candidates(db, record, floor), exclude=record.call_id
            )
            if parent is None and floor > 0:
                parent = choose_prompt_parent(
                    record.prompt_token_ids, _candidates(db, record, 0), exclude=record.call_id
                )
            enc = lifecycle.encode_with_parent(
                record, request, parent, lambda c: _stored_messages(db, c)
            )
            written = 0
            cur = db.execute(_INSERT_CALL, (*column_values(enc), int(frozen), record.retry_of))
            inserted = bool(cur.rowcount)
            if inserted:
                written = _encoded_bytes(enc) + _store_json(db, enc)
            else:
                row = db.execute(
                    f"SELECT {_CALL_COLUMNS} FROM calls WHERE call_id = ?", (enc.call_id,)
                ).fetchone()
                lifecycle.check_re_put(None if row is None else _row_to_encoded(tuple(row)), enc)
            effect = lifecycle.call_effect(record, frozen=frozen, inserted=inserted)
            db.execute(
                "INSERT INTO rollouts (rollout_id, created_at, incomplete_calls, version) "
                "VALUES (?,?,?,?) ON CONFLICT(rollout_id) DO UPDATE SET "
                "incomplete_calls = CASE WHEN ? THEN excluded.incomplete_calls "
                "ELSE incomplete_calls END, version = version + excluded.version",
                (
                    enc.rollout_id,
                    enc.created_at,
                    lifecycle.incomplete_calls(links, record) if effect.recount else 0,
                    effect.version_delta,
                    effect.recount,
                ),
            )
            return written

        return _transaction(db, body)

    @staticmethod
    def _mark(db: sqlite3.Connection, rollout_id: str, diagnostic: Diagnostic) -> None:
        def body() -> None:
            tomb, row = _state(db, rollout_id)
            if tomb is not None:
                # A deleted rollout stays deleted; the failed write was logged by the caller.
                return
            text = lifecycle.with_diagnostic(row, diagnostic)
            db.execute(
                "INSERT INTO rollouts (rollout_id, created_at, incomplete, diagnostics) "
                "VALUES (?,?,1,?) ON CONFLICT(rollout_id) DO UPDATE SET incomplete = 1, "
                "diagnostics = excluded.diagnostics",
                (rollout_id, time.time(), text),
            )

        _transaction(db, body)

    @staticmethod
    def _delete(db: sqlite3.Connection, rollout_id: str, known_elsewhere: bool) -> int | None:
        def body() -> int | None:
            if not known_elsewhere and not any(
                db.execute(sql, (rollout_id,)).fetchone()
                for sql in (
                    "SELECT 1 FROM rollouts WHERE rollout_id = ?",
                    "SELECT 1 FROM calls WHERE rollout_id = ? LIMIT 1",
                    "SELECT 1 FROM tombstones WHERE rollout_id = ?",
                )
            ):
                return None
            deleted = _delete_rows(db, rollout_id)
            db.execute(
                "INSERT OR IGNORE INTO tombstones (rollout_id, deleted_at) VALUES (?, ?)",
                (rollout_id, time.time()),
            )
            return deleted

        return _transaction(db, body)

    # --- lifecycle (writer thread) -------------------------------------------------------

    @staticmethod
    def _freeze(db: sqlite3.Connection, rollout_id: str, known_elsewhere: bool) -> Snapshot:
        def body() -> Snapshot:
            tomb, row = _state(db, rollout_id)
            earlier = lifecycle.earlier_freeze(
                rollout_id, tomb, row, known_elsewhere=known_elsewhere
            )
            if earlier is not None:
                return earlier
            now = time.time()
            if row is None:  # nothing stored yet, a first call in flight: frozen empty
                db.execute(
                    "INSERT INTO rollouts (rollout_id, created_at) VALUES (?, ?)", (rollout_id, now)
                )
            (num_calls,) = db.execute(
                "SELECT count(*) FROM calls WHERE rollout_id = ? AND late = 0", (rollout_id,)
            ).fetchone()
            snapshot = lifecycle.new_snapshot(
                row, num_calls=num_calls, now=now, cursor=_next_counter(db, "export_cursor")
            )
            db.execute(
                "UPDATE rollouts SET snapshot_id = ?, frozen_at = ?, frozen_num_calls = ?, "
                "export_cursor = ? WHERE rollout_id = ?",
                (snapshot.snapshot_id, now, snapshot.num_calls, snapshot.cursor, rollout_id),
            )
            return snapshot

        return _transaction(db, body)

    @staticmethod
    def _set_metadata(db: sqlite3.Connection, rollout_id: str, metadata: RolloutMetadata) -> int:
        def body() -> int:
            after, text = lifecycle.metadata_change(rollout_id, *_state(db, rollout_id), metadata)
            if text is not None:
                db.execute(
                    "UPDATE rollouts SET metadata = ?, version = ? WHERE rollout_id = ?",
                    (text, after, rollout_id),
                )
            return after

        return _transaction(db, body)

    @staticmethod
    def _retire(
        db: sqlite3.Connection, rollout_id: str, snapshot_id: str, version: int
    ) -> Retirement:
        def body() -> Retirement:
            tomb, row = _state(db, rollout_id)
            earlier = lifecycle.earlier_retirement(rollout_id, snapshot_id, version, tomb, row)
            if earlier is not None:  # a retry with the same identifiers: the same answer
                return earlier
            deleted = _delete_rows(db, rollout_id)
            now = time.time()
            db.execute(
                "INSERT INTO tombstones (rollout_id, deleted_at, snapshot_id, version, "
                "deleted_calls) VALUES (?, ?, ?, ?, ?)",
                (rollout_id, now, snapshot_id, version, deleted),
            )
            return Retirement(rollout_id, snapshot_id, version, deleted, now)

        return _transaction(db, body)

    @staticmethod
    def _sweep(db: sqlite3.Connection, older_than_s: float) -> int:
        cur = db.execute(
            "DELETE FROM tombstones WHERE deleted_at < ?", (time.time() - older_than_s,)
        )
        return cur.rowcount

    # --- reads (reader thread) -----------------------------------------------------------

    @staticmethod
    def _get_tombstone(db: sqlite3.Connection, rollout_id: str) -> float | None:
        row = db.execute(
            "SELECT deleted_at FROM tombstones WHERE rollout_id = ?", (rollout_id,)
        ).fetchone()
        return float(row[0]) if row else None

    @staticmethod
    def _get_call(db: sqlite3.Connection, call_id: str) -> CallRecord | None:
        def body() -> tuple[list[Any], dict[str, str]]:
            # The call and its prompt ancestors, in one recursive query; then their JSON.
            rows = db.execute(
                _ANCESTRY
                + f"SELECT {_CALL_COLUMNS} FROM calls WHERE call_id IN (SELECT id FROM anc)",
                (call_id,),
            ).fetchall()
            blobs = _blobs(db, _ANCESTRY + "SELECT id FROM anc", (call_id,)) if rows else {}
            return rows, blobs

        rows, blobs = _read_transaction(db, body)
        encoded = [_row_to_encoded(tuple(r), blobs) for r in rows]
        if not any(r.call_id == call_id for r in encoded):
            return None
        return next(r for r in decode_records(encoded) if r.call_id == call_id)

    @staticmethod
    def _get_rollout_calls(db: sqlite3.Connection, rollout_id: str) -> list[CallRecord]:
        def body() -> tuple[list[Any], dict[str, str]]:
            rows = db.execute(
                f"SELECT {_CALL_COLUMNS} FROM calls WHERE rollout_id = ? "
                "ORDER BY created_at, call_id",
                (rollout_id,),
            ).fetchall()
            calls = "SELECT call_id FROM calls WHERE rollout_id = ?"
            blobs = _blobs(db, calls, (rollout_id,)) if rows else {}
            return rows, blobs

        rows, blobs = _read_transaction(db, body)
        return decode_records(_row_to_encoded(tuple(r), blobs) for r in rows)

    @staticmethod
    def _get_rollout(db: sqlite3.Connection, rollout_id: str) -> RolloutInfo | None:
        row = db.execute(_ROLLOUT_SELECT + " WHERE r.rollout_id = ?", (rollout_id,)).fetchone()
        return _info(tuple(row)) if row else None

    @staticmethod
    def _list_rollouts(
        db: sqlite3.Connection, limit: int | None, after: str | None
    ) -> list[RolloutInfo]:
        rows = db.execute(
            _ROLLOUT_SELECT + " WHERE r.rollout_id > ? ORDER BY r.rollout_id LIMIT ?",
            (after if after is not None else "", limit if limit is not None else -1),
        ).fetchall()
        return [_info(tuple(r)) for r in rows]

    @staticmethod
    def _list_frozen(db: sqlite3.Connection, after: int, limit: int | None) -> list[RolloutInfo]:
        rows = db.execute(
            _ROLLOUT_SELECT + " WHERE r.export_cursor > ? ORDER BY r.export_cursor LIMIT ?",
            (after, limit if limit is not None else -1),
        ).fetchall()
        return [_info(tuple(r)) for r in rows]

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
        row = db.execute("SELECT count(*) FROM calls").fetchone()
        return {
            "kind": "sqlite",
            "path": str(self.db_path),
            "synchronous": self.synchronous,
            "calls": row[0] if row else 0,
        }
