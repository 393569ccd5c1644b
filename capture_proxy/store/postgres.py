"""The shared store: PostgreSQL, for proxy replicas past one machine. Same contract as SQLite.

Owns the PostgreSQL table layout, its versioned migrations, and the concurrency rules that let
several proxy processes write one store. Record encoding is the core codec's (schema v3, the
same ``EncodedRecord`` columns as ``sqlite.py``, arrays as ``bytea`` in the same little-endian
layout); the prompt parent is chosen by the same rule (``core.prefixes``). What an operation
decides is ``lifecycle``'s and its async method ``threaded``'s, as for ``sqlite.py``, which
this module mirrors statement for statement where it can: one synchronous function per store
operation, taking a connection, so a function added there is added here the same way. The
exception is ``put_call``, the hot path, written for round trips (below).

Driver: psycopg 3 (libpq, the C build from ``psycopg[binary]``) with ``psycopg_pool``, sync,
on ``pool_size`` worker threads that share one job queue (``WorkerThread(threads=n)``); each
job takes a pooled connection for its one transaction. Measured against asyncpg on this
store's write transaction (``benchmarks/pg_drivers.py``, 2 CPUs): about 1,000 vs 480 writes/s
at the same CPU per write; and the codec's encoding and decoding (numpy, SHA-256) stay off the
event loop, as with SQLite.

Round trips: ``put_call`` is one transaction in two round trips, in pipeline mode (BEGIN and
COMMIT sent as statements, so that psycopg's transaction block adds no syncs of its own):
first the rollout's lock and every read the write depends on (the rollout's state, the call
if stored, the prompt-parent candidates with the ``StoredMessages`` of the deepest
``PREFETCHED_MESSAGES``, the retry links when they count), then the inserts, the rollout's
upsert and COMMIT (``benchmarks/pg_put_call.py``: 12 round trips before). ``health()`` is one
catalog lookup (no row count).

Durability: a ``put_call`` returns after ``COMMIT``, which with the server's default
``synchronous_commit = on`` has flushed the WAL: the promise "committed before the answer
ends" holds, for any replica.

Concurrency (several replicas, one rollout): every write transaction of a rollout first takes a
transaction-scoped advisory lock on the rollout id (``pg_advisory_xact_lock``), so writes of
one rollout serialise across processes: the prompt parent chosen inside the transaction cannot
vanish before the insert (a concurrent ``delete_rollout`` waits), and a write cannot slip in
between a delete and its tombstone. ``calls.call_id`` is the primary key: a re-put finds the
stored call under the lock and is compared by content; the same call id inserted meanwhile by
another rollout's transaction (not under this lock) fails the insert with a unique violation,
and the retry finds it stored. Content-addressed JSON is shared across rollouts:
``call_json.sha256`` references ``json_blobs``, so a delete that would remove a text another
rollout's transaction just referred to fails with a foreign-key violation instead of orphaning
it; such failures, unique violations, serialization failures, deadlocks and lost connections
are retried (``MAX_ATTEMPTS``, jittered backoff). Every write is idempotent, so a retry after
an ambiguous commit is harmless. Blobs are inserted and deleted in SHA-256 order (one lock
order for all transactions).

Lifecycle across replicas: ``freeze_rollout``, ``set_metadata`` and ``retire_rollout`` take the
same rollout lock as ``put_call``, and ``put_call`` reads the frozen flag under it, so a call
racing a freeze (on any replica) is stored either before it (counted in the snapshot and the
version) or after it (marked late), never both or neither. The export cursor comes from a row
of ``counters``, incremented by the freeze transaction and locked until its COMMIT (not a
SEQUENCE, whose numbers are handed out outside transactions and can commit out of order):
cursors are unique, store-wide, and commit in increasing order, so a reader paging
``list_frozen`` never sees a cursor before a smaller one that is still to come. Freezes of
different rollouts serialise on that row for the length of one short transaction; the row lock
is always taken after the rollout lock, so no lock cycle arises.

Layout: the tables of ``sqlite.py`` (``calls``, ``json_blobs``, ``call_json``, ``rollouts``,
``tombstones``, ``counters``) plus ``schema_migrations`` (one row per applied step of
``MIGRATIONS``; 2 added the lifecycle, 3 the retry link and the count of incomplete calls, 4
the indexes that keep a put's reads bounded whatever the rollout's size).
Opening applies the missing steps in one transaction under a global advisory lock (replicas starting
together migrate once), refuses a layout newer than it knows, and rewrites records older than
the codec's schema version through ``codec.migrate`` (none today: this store began at v3).
Use a database of its own (or a schema of its own, via ``options=-csearch_path=...`` in the
URL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from capture_proxy.core.codec import (
    COLUMNS,
    SCHEMA_VERSION,
    EncodedRecord,
    RequestEncoding,
    StoredMessages,
    column_values,
    decode_records,
    migrate,
)
from capture_proxy.core.completeness import RetryLink, unsuperseded_incomplete
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.prefixes import StoredPrefix, choose_prompt_parent
from capture_proxy.core.records import CallRecord, Diagnostic
from capture_proxy.core.redact import redact_url
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

try:  # an optional extra: ``pip install 'capture-proxy[postgres]'``
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg import pq
    from psycopg_pool import ConnectionPool
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

log = logging.getLogger("capture_proxy")

URL_SCHEMES = ("postgresql://", "postgres://")
#: Attempts of one store operation on a retryable failure (see the module docstring).
MAX_ATTEMPTS = 6
#: Advisory lock key held while migrating (any constant; "capture" in ASCII).
_MIGRATION_LOCK = 0x63617074757265
#: Seconds to wait for the pool's first connections on open.
OPEN_TIMEOUT_S = 30.0

#: One step per layout version; applied in order, each recorded in ``schema_migrations``.
MIGRATIONS: tuple[str, ...] = (
    # 1: the layout of schema v3 records (sqlite.py's LAYOUT_VERSION 3).
    """
    CREATE TABLE calls (
        call_id text PRIMARY KEY,
        rollout_id text NOT NULL,
        created_at double precision NOT NULL,
        status text NOT NULL,
        schema_version integer NOT NULL,
        meta text NOT NULL,
        prompt_token_ids bytea NOT NULL,
        generation_token_ids bytea NOT NULL,
        generation_log_probs bytea NOT NULL,
        routed_experts bytea,
        prompt_parent_call_id text,
        prompt_prefix_len integer NOT NULL DEFAULT 0,
        num_prompt_tokens integer NOT NULL DEFAULT 0,
        num_generation_tokens integer NOT NULL DEFAULT 0,
        tokens_sha256 bytea NOT NULL DEFAULT '',
        messages_delta text NOT NULL DEFAULT '[]',
        messages_prefix_len integer NOT NULL DEFAULT 0,
        num_messages integer NOT NULL DEFAULT 0,
        messages_sha256 bytea NOT NULL DEFAULT '',
        messages_chain bytea NOT NULL DEFAULT ''
    );
    CREATE INDEX calls_by_rollout ON calls (rollout_id, created_at, call_id);
    CREATE TABLE json_blobs (
        sha256 bytea PRIMARY KEY,
        json text NOT NULL
    );
    CREATE TABLE call_json (
        call_id text NOT NULL,
        sha256 bytea NOT NULL REFERENCES json_blobs (sha256),
        PRIMARY KEY (call_id, sha256)
    );
    CREATE INDEX call_json_by_sha ON call_json (sha256);
    CREATE TABLE tombstones (
        rollout_id text PRIMARY KEY,
        deleted_at double precision NOT NULL
    );
    CREATE TABLE rollouts (
        rollout_id text PRIMARY KEY,
        created_at double precision NOT NULL,
        incomplete boolean NOT NULL DEFAULT false,
        diagnostics text NOT NULL DEFAULT '[]'
    );
    """,
    # 2: the lifecycle (sqlite.py's LAYOUT_VERSION 4): snapshots, late calls, metadata,
    # retirements, the store-wide export cursor. Before it every stored call counted, so a
    # rollout's revision is its number of calls.
    """
    ALTER TABLE calls ADD COLUMN late boolean NOT NULL DEFAULT false;
    ALTER TABLE rollouts
        ADD COLUMN version bigint NOT NULL DEFAULT 0,
        ADD COLUMN metadata text NOT NULL DEFAULT '{}',
        ADD COLUMN snapshot_id text,
        ADD COLUMN frozen_at double precision,
        ADD COLUMN frozen_num_calls integer,
        ADD COLUMN export_cursor bigint;
    ALTER TABLE tombstones
        ADD COLUMN snapshot_id text,
        ADD COLUMN version bigint,
        ADD COLUMN deleted_calls integer;
    UPDATE rollouts SET version = (SELECT count(*) FROM calls c
        WHERE c.rollout_id = rollouts.rollout_id);
    CREATE UNIQUE INDEX rollouts_by_cursor ON rollouts (export_cursor)
        WHERE export_cursor IS NOT NULL;
    CREATE TABLE counters (
        name text PRIMARY KEY,
        value bigint NOT NULL
    );
    INSERT INTO counters (name, value) VALUES ('export_cursor', 0);
    """,
    # 3: the retry link as a column (sqlite.py's LAYOUT_VERSION 5) and the rollout's count of
    # incomplete calls no complete retry supersedes (``core.completeness``; counted after the
    # steps, ``_count_incomplete_calls``); ``rollouts.incomplete`` says from now on only that
    # a rollout-level diagnostic marked it (``mark_rollout_incomplete`` always adds one).
    """
    ALTER TABLE calls ADD COLUMN retry_of text;
    ALTER TABLE rollouts ADD COLUMN incomplete_calls integer NOT NULL DEFAULT 0;
    UPDATE calls SET retry_of = meta::json ->> 'retry_of'
        WHERE meta::json ->> 'retry_of' IS NOT NULL;
    UPDATE rollouts SET incomplete = false WHERE diagnostics = '[]';
    """,
    # 4: the indexes that keep a put's reads bounded whatever the rollout's size (sqlite.py's
    # LAYOUT_VERSION 6): prompt-parent candidates by prompt + generation length, the retry
    # links, the late calls.
    """
    CREATE INDEX IF NOT EXISTS calls_by_prefix ON calls
        (rollout_id, (num_prompt_tokens + num_generation_tokens))
        WHERE status = 'complete' AND num_generation_tokens > 0;
    CREATE INDEX IF NOT EXISTS calls_retry_links ON calls (rollout_id)
        WHERE NOT late AND (status = 'incomplete' OR retry_of IS NOT NULL);
    CREATE INDEX IF NOT EXISTS calls_late ON calls (rollout_id, created_at, call_id) WHERE late;
    """,
)
LAYOUT_VERSION = len(MIGRATIONS)

_CALL_COLUMNS = ", ".join(COLUMNS)
# The codec's columns, then the store's own: ``late``, ``retry_of``.
# No ON CONFLICT: ``put_call`` looked under the rollout's lock and found no such call; the same
# id stored meanwhile by another rollout's transaction is a UniqueViolation, retried.
_INSERT_CALL = (
    f"INSERT INTO calls ({_CALL_COLUMNS}, late, retry_of) "
    f"VALUES ({', '.join(['%s'] * (len(COLUMNS) + 2))})"
)
_STORED_CALL = f"SELECT {_CALL_COLUMNS} FROM calls WHERE call_id = %s"
#: The deepest prompt-parent candidates whose ``StoredMessages`` come with the candidates (the
#: chosen parent is nearly always among them; another is read when needed).
PREFETCHED_MESSAGES = 4
# The rollout's prompt-parent candidates (``core.prefixes``): complete, with output, not longer
# than the prompt and, as in sqlite.py, at least as deep as the record's verified parent when
# that is one (the deepest candidate wins and the parent is a candidate: a range of the partial
# index ``calls_by_prefix``, so a call of a long rollout reads a row or two); then the
# ``StoredMessages`` columns, the chain only for the deepest few. Literal ``'complete'``, so
# that the planner may use the partial index.
_CANDIDATES = (
    "SELECT call_id, created_at, num_prompt_tokens + num_generation_tokens, tokens_sha256, "
    "prompt_parent_call_id, messages_prefix_len, num_messages, CASE WHEN row_number() OVER "
    "(ORDER BY num_prompt_tokens + num_generation_tokens DESC) <= "
    f"{PREFETCHED_MESSAGES} THEN messages_chain END "
    "FROM calls WHERE rollout_id = %(rollout)s AND status = 'complete' "
    "AND num_generation_tokens > 0 "
    "AND num_prompt_tokens + num_generation_tokens <= %(prompt)s "
    "AND num_prompt_tokens + num_generation_tokens >= COALESCE((SELECT "
    "p.num_prompt_tokens + p.num_generation_tokens FROM calls p WHERE p.call_id = %(parent)s "
    "AND p.rollout_id = %(rollout)s AND p.status = 'complete' AND p.num_generation_tokens > 0 "
    "AND p.num_prompt_tokens + p.num_generation_tokens <= %(prompt)s), 0)"
)
# A late call (``version`` + 0) changes neither the revision nor the count of incomplete calls.
_UPSERT_ROLLOUT = (
    "INSERT INTO rollouts (rollout_id, created_at, incomplete_calls, version) "
    "VALUES (%s, %s, %s, %s) ON CONFLICT (rollout_id) DO UPDATE SET "
    "incomplete_calls = CASE WHEN %s THEN excluded.incomplete_calls "
    "ELSE rollouts.incomplete_calls END, version = rollouts.version + excluded.version"
)
# A rollout's tombstone and ``rollouts`` row (``lifecycle.state_of``); one row, NULLs for none.
_STATE = (
    f"SELECT {lifecycle.STATE_COLUMNS} FROM (SELECT %s::text AS id) k "
    "LEFT JOIN tombstones t ON t.rollout_id = k.id LEFT JOIN rollouts r ON r.rollout_id = k.id"
)
# The calls completeness depends on (``core.completeness``): counted, incomplete or a retry.
_RETRY_LINKS = (
    "SELECT call_id, status, retry_of FROM calls WHERE rollout_id = %s AND NOT late "
    "AND (status = 'incomplete' OR retry_of IS NOT NULL)"
)
_BLOBS_OF = (
    "SELECT b.sha256, b.json FROM json_blobs b WHERE b.sha256 IN "
    "(SELECT j.sha256 FROM call_json j WHERE j.call_id IN ({calls}))"
)
_ANCESTRY = (
    "WITH RECURSIVE anc(id) AS (SELECT %s::text UNION ALL SELECT c.prompt_parent_call_id "
    "FROM calls c JOIN anc ON c.call_id = anc.id "
    "WHERE c.prompt_parent_call_id IS NOT NULL) "
)
_ROLLOUT_SELECT = (
    "SELECT r.rollout_id, r.created_at, r.incomplete OR r.incomplete_calls > 0, "
    "r.diagnostics, (SELECT count(*) FROM calls c WHERE c.rollout_id = r.rollout_id), "
    "r.version, r.metadata, r.snapshot_id, r.frozen_at, r.frozen_num_calls, r.export_cursor, "
    "array(SELECT c.call_id FROM calls c WHERE c.rollout_id = r.rollout_id AND c.late "
    "ORDER BY c.created_at, c.call_id) "
    "FROM rollouts r"
)
_LOCK_ROLLOUT = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"

T = TypeVar("T")
Conn = Any  # psycopg.Connection[tuple[Any, ...]]; Any so that the module imports without it


def is_postgres_url(value: str) -> bool:
    return value.startswith(URL_SCHEMES)


def _row_to_encoded(row: tuple[Any, ...], blobs: dict[str, str] | None = None) -> EncodedRecord:
    encoded = EncodedRecord(*row)
    return encoded if blobs is None else dataclasses.replace(encoded, json_blobs=blobs)


def _blobs(db: Conn, calls_sql: str, args: tuple[Any, ...]) -> dict[str, str]:
    rows = db.execute(_BLOBS_OF.format(calls=calls_sql), args).fetchall()
    return {bytes(sha).hex(): text for sha, text in rows}


def _store_json(db: Conn, enc: EncodedRecord) -> None:
    """Keep the record's content-addressed JSON (once per content) and its references, in
    SHA-256 order (one lock order across transactions)."""
    for sha, text in sorted(enc.json_blobs.items()):
        key = bytes.fromhex(sha)
        db.execute(
            "INSERT INTO json_blobs (sha256, json) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            (key, text),
        )
        db.execute(
            "INSERT INTO call_json (call_id, sha256) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            (enc.call_id, key),
        )


def _read_transaction(db: Conn, body: Callable[[], T]) -> T:
    """Run ``body`` in one read-only REPEATABLE READ transaction (one snapshot)."""
    with db.transaction():
        db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        return body()


def _transaction(db: Conn, rollout_id: str | None, body: Callable[[], T]) -> T:
    """Run ``body`` in one transaction (rolled back on any exception), holding the rollout's
    advisory lock from the start when ``rollout_id`` is given."""
    with db.transaction():
        if rollout_id is not None:
            db.execute(_LOCK_ROLLOUT, (rollout_id,))
        return body()


def _info(row: tuple[Any, ...]) -> RolloutInfo:
    """From a row of ``_ROLLOUT_SELECT`` (late call ids as an array)."""
    return lifecycle.rollout_info(row[:-1], row[-1])


def _next_cursor(db: Conn) -> int:
    """The next export cursor, from the ``counters`` row (inside the caller's transaction).

    Not a SEQUENCE: ``nextval`` is handed out outside transactions, so a freeze could take 5,
    commit after another's 6, and a trainer that had already read past 6 would never see it.
    The row update holds the row's lock until COMMIT: freezes of any replica take cursors one
    at a time, each after the previous one committed (or rolled back, giving its number back),
    so cursors commit in increasing order and a reader never sees a cursor before a smaller one
    that is still to come."""
    row = db.execute(
        "INSERT INTO counters (name, value) VALUES ('export_cursor', 1) "
        "ON CONFLICT (name) DO UPDATE SET value = counters.value + 1 RETURNING value"
    ).fetchone()
    return int(row[0])


def _delete_rows(db: Conn, rollout_id: str) -> int:
    """Delete a rollout's calls, their unshared JSON texts and its bookkeeping (inside the
    caller's transaction, under the rollout's lock). Returns the number of calls deleted."""
    calls = "SELECT call_id FROM calls WHERE rollout_id = %s"
    shas = [
        bytes(r[0])
        for r in db.execute(
            f"SELECT DISTINCT sha256 FROM call_json WHERE call_id IN ({calls})",
            (rollout_id,),
        ).fetchall()
    ]
    db.execute(f"DELETE FROM call_json WHERE call_id IN ({calls})", (rollout_id,))
    for sha in sorted(shas):  # texts no remaining call refers to
        db.execute(
            "DELETE FROM json_blobs WHERE sha256 = %s AND NOT EXISTS "
            "(SELECT 1 FROM call_json WHERE sha256 = %s)",
            (sha, sha),
        )
    deleted = db.execute("DELETE FROM calls WHERE rollout_id = %s", (rollout_id,)).rowcount
    db.execute("DELETE FROM rollouts WHERE rollout_id = %s", (rollout_id,))
    return int(deleted)


def _stored_messages(db: Conn, call_id: str) -> StoredMessages | None:
    row = db.execute(
        "SELECT prompt_parent_call_id, messages_prefix_len, num_messages, messages_chain "
        "FROM calls WHERE call_id = %s",
        (call_id,),
    ).fetchone()
    return StoredMessages(call_id, row[0], row[1], row[2], bytes(row[3])) if row else None


def _count_incomplete(db: Conn, rollout_id: str) -> int:
    """The rollout's counted calls that are incomplete and superseded by no complete retry."""
    links = [RetryLink(*r) for r in db.execute(_RETRY_LINKS, (rollout_id,)).fetchall()]
    return len(unsuperseded_incomplete(links))


def _state(db: Conn, rollout_id: str) -> tuple[Tombstone | None, LifecycleRow | None]:
    """The rollout's tombstone and ``rollouts`` row (``lifecycle.state_of``), one statement."""
    row = db.execute(_STATE, (rollout_id,)).fetchone()
    return lifecycle.state_of(row)


def _candidates(rows: list[Any]) -> tuple[list[StoredPrefix], dict[str, StoredMessages]]:
    """Rows of ``_CANDIDATES``: the ``StoredPrefix`` of each, the ``StoredMessages`` of those
    that came with their messages chain."""
    prefixes = [StoredPrefix(r[0], r[1], r[2], bytes(r[3])) for r in rows]
    messages = {
        r[0]: StoredMessages(r[0], r[4], r[5], r[6], bytes(r[7])) for r in rows if r[7] is not None
    }
    return prefixes, messages


def _retryable(exc: BaseException) -> bool:
    """Failures a second attempt of the whole (idempotent) operation can get past (a
    UniqueViolation: another rollout's transaction stored the same call id first)."""
    return isinstance(
        exc,
        pg_errors.SerializationFailure
        | pg_errors.DeadlockDetected
        | pg_errors.ForeignKeyViolation
        | pg_errors.UniqueViolation
        | psycopg.OperationalError,
    )


class PostgresStore(ThreadedStore):
    """Shared store at ``url`` (``postgresql://user[:password]@host[:port]/database``).
    ``pool_size``: pooled connections, and worker threads, of this process. Its
    ``CaptureStore`` methods are ``ThreadedStore``'s: reads and writes hop to any pool thread."""

    #: Other processes write this store too: a rollout's link index may be stale (the linker
    #: reloads it on a digest miss).
    shared = True

    def __init__(self, url: str, *, pool_size: int = 8) -> None:
        if psycopg is None:
            raise StoreError(
                "the PostgreSQL store needs psycopg: pip install 'capture-proxy[postgres]'"
            )
        if not is_postgres_url(url):
            raise ValueError(f"expected a postgresql:// URL, got {redact_url(url)!r}")
        if pool_size < 1:
            raise ValueError(f"pool_size: expected at least 1, got {pool_size}")
        self._driver_error = psycopg.Error
        self.url = url
        self.pool_size = pool_size
        self._pool: Any = None  # ConnectionPool, used by the worker threads only
        self._worker: WorkerThread | None = None
        self.retries = 0  # operations retried (all threads; a statistic)
        #: seconds ``open`` waits for the pool's first connections
        self.open_timeout_s = OPEN_TIMEOUT_S

    # --- threads -------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(connection, *args)`` on a worker thread with a pooled connection (one
        hop), retrying retryable failures."""
        if self._worker is None:
            raise StoreError("store is not open")
        return await self._worker.run(self._with_connection, fn, *args)

    async def _write_hop(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run(fn, *args)

    async def _read_hop(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run(fn, *args)

    def _with_connection(self, fn: Callable[..., T], *args: Any) -> T:
        pool = self._pool
        if pool is None:
            raise StoreError("store is not open")
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                with pool.connection() as db:
                    return fn(db, *args)
            except psycopg.Error as exc:
                if attempt == MAX_ATTEMPTS or not _retryable(exc):
                    raise
                self.retries += 1
                log.debug("store: retrying after %s (attempt %d)", type(exc).__name__, attempt)
                # Backoff against a conflicting transaction; not a synchronisation sleep.
                time.sleep(random.uniform(0, 0.005 * 2**attempt))
        raise AssertionError("unreachable")

    # --- open / close --------------------------------------------------------------------

    async def open(self) -> None:
        if self._worker is not None:
            raise StoreError("store is already open")
        self._worker = WorkerThread("capture-store-pg", threads=self.pool_size)
        try:
            await self._worker.run(self._open_pool)
            await self._run(self._migrate_layout)
        except BaseException as exc:
            await self._shutdown()
            if isinstance(exc, psycopg.Error | OSError):
                raise StoreError(f"cannot open store at {redact_url(self.url)}: {exc}") from exc
            raise

    def _open_pool(self) -> None:
        pool = ConnectionPool(
            self.url,
            min_size=self.pool_size,
            max_size=self.pool_size,
            kwargs={"autocommit": True},
            open=False,
            name="capture-store",
        )
        try:
            pool.open(wait=True, timeout=self.open_timeout_s)
        except Exception as exc:
            pool.close()
            raise StoreError(f"cannot connect to {redact_url(self.url)}: {exc}") from exc
        self._pool = pool

    def _migrate_layout(self, db: Conn) -> None:
        """Apply the missing steps of ``MIGRATIONS`` and rewrite older records, in one
        transaction under the migration lock (a crash leaves the old layout)."""
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            db.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY, "
                "applied_at double precision NOT NULL)"
            )
            row = db.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()
            version = int(row[0])
            if version > LAYOUT_VERSION:
                raise StoreError(
                    f"store at {redact_url(self.url)} has layout {version}; this reader knows "
                    f"up to {LAYOUT_VERSION}"
                )
            for step in range(version + 1, LAYOUT_VERSION + 1):
                db.execute(MIGRATIONS[step - 1])
                db.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (%s, %s)",
                    (step, time.time()),
                )
            if version < 3:
                self._count_incomplete_calls(db)
            rollouts = [
                r[0]
                for r in db.execute(
                    "SELECT DISTINCT rollout_id FROM calls WHERE schema_version < %s",
                    (SCHEMA_VERSION,),
                ).fetchall()
            ]
            for rollout_id in rollouts:  # one rollout in memory at a time
                self._migrate_rollout(db, rollout_id)

    @staticmethod
    def _count_incomplete_calls(db: Conn) -> None:
        """Layout 3: count each rollout's incomplete calls (after ``retry_of`` is filled)."""
        rollouts = db.execute(
            "SELECT DISTINCT rollout_id FROM calls WHERE NOT late "
            "AND (status = 'incomplete' OR retry_of IS NOT NULL)"
        ).fetchall()
        for (rollout_id,) in rollouts:
            db.execute(
                "UPDATE rollouts SET incomplete_calls = %s WHERE rollout_id = %s",
                (_count_incomplete(db, rollout_id), rollout_id),
            )

    @staticmethod
    def _migrate_rollout(db: Conn, rollout_id: str) -> None:
        """Rewrite a rollout's records older than the codec's schema in the current one."""
        rows = db.execute(
            f"SELECT {_CALL_COLUMNS} FROM calls WHERE rollout_id = %s AND schema_version < %s "
            "ORDER BY created_at, call_id",
            (rollout_id, SCHEMA_VERSION),
        ).fetchall()
        sets = ", ".join(f"{c} = %s" for c in COLUMNS[1:])
        for row in rows:
            new = migrate(_row_to_encoded(tuple(row)))
            db.execute(
                f"UPDATE calls SET {sets} WHERE call_id = %s",
                (*column_values(new)[1:], new.call_id),
            )
            _store_json(db, new)

    async def close(self) -> None:
        await self._shutdown()

    async def _shutdown(self) -> None:
        """Close the pool on a worker thread after every queued operation, then stop the
        threads. Idempotent; later operations fail with "store is not open"."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        try:
            await worker.run(self._close_pool)
        finally:
            await worker.stop()

    def _close_pool(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()

    # --- writes --------------------------------------------------------------------------

    @staticmethod
    def _put(db: Conn, record: CallRecord, request: RequestEncoding | None) -> None:
        """One transaction in two round trips (pipeline mode, BEGIN and COMMIT sent as
        statements): the rollout's lock and all the write depends on (its state, the call if
        stored, the prompt-parent candidates with the deepest ones' ``StoredMessages``, the
        retry links when they count), then the writes and COMMIT. A re-put writes nothing."""
        rid = record.rollout_id
        try:
            with db.pipeline():
                db.execute("BEGIN")
                # Under the rollout's lock, as the freeze is: a call racing a freeze is either
                # counted in its snapshot (stored first) or late (stored after), never both;
                # and no candidate can appear or vanish before the insert.
                db.execute(_LOCK_ROLLOUT, (rid,))
                state = db.execute(_STATE, (rid,))
                stored = db.execute(_STORED_CALL, (record.call_id,), binary=True)
                args = {"rollout": rid, "prompt": record.num_prompt_tokens}
                candidates = db.execute(
                    _CANDIDATES, {**args, "parent": record.parent_call_id}, binary=True
                )
                links = db.execute(_RETRY_LINKS, (rid,)) if lifecycle.may_recount(record) else None
                tomb, rollout = lifecycle.state_of(state.fetchone())  # the first round trip
                lifecycle.refuse_deleted(record, tomb is not None)
                frozen = rollout is not None and rollout.frozen
                prefixes, messages = _candidates(candidates.fetchall())
                parent = choose_prompt_parent(
                    record.prompt_token_ids, prefixes, exclude=record.call_id
                )
                if parent is None and record.parent_call_id is not None:
                    # A parent that is not a prefix (a record put by hand): all candidates.
                    again = db.execute(_CANDIDATES, {**args, "parent": None}, binary=True)
                    prefixes, messages = _candidates(again.fetchall())
                    parent = choose_prompt_parent(
                        record.prompt_token_ids, prefixes, exclude=record.call_id
                    )
                enc = lifecycle.encode_with_parent(
                    record, request, parent, lambda c: messages.get(c) or _stored_messages(db, c)
                )
                row = stored.fetchone()
                if row is not None:  # stored before: the same content, or refused
                    lifecycle.check_re_put(_bytes_row(row), enc)
                    db.execute("COMMIT")
                    return
                effect = lifecycle.call_effect(record, frozen=frozen, inserted=True)
                count = 0
                if effect.recount and links is not None:
                    count = lifecycle.incomplete_calls(
                        (RetryLink(*r) for r in links.fetchall()), record
                    )
                db.execute(_INSERT_CALL, (*column_values(enc), frozen, record.retry_of))
                _store_json(db, enc)
                db.execute(
                    _UPSERT_ROLLOUT,
                    (rid, enc.created_at, count, effect.version_delta, effect.recount),
                )
                db.execute("COMMIT")
            # The second round trip: the pipeline's sync at its end (errors are raised here).
        except BaseException:
            if db.pgconn.transaction_status != pq.TransactionStatus.IDLE:
                with contextlib.suppress(psycopg.Error):  # a lost connection: nothing to undo
                    db.execute("ROLLBACK")
            raise

    @staticmethod
    def _mark(db: Conn, rollout_id: str, diagnostic: Diagnostic) -> None:
        def body() -> None:
            tomb, row = _state(db, rollout_id)
            if tomb is not None:
                # A deleted rollout stays deleted; the failed write was logged by the caller.
                return
            text = lifecycle.with_diagnostic(row, diagnostic)
            db.execute(
                "INSERT INTO rollouts (rollout_id, created_at, incomplete, diagnostics) "
                "VALUES (%s, %s, true, %s) ON CONFLICT (rollout_id) DO UPDATE SET "
                "incomplete = true, diagnostics = excluded.diagnostics",
                (rollout_id, time.time(), text),
            )

        _transaction(db, rollout_id, body)

    @staticmethod
    def _delete(db: Conn, rollout_id: str, known_elsewhere: bool) -> int | None:
        def body() -> int | None:
            if not known_elsewhere and not any(
                db.execute(sql, (rollout_id,)).fetchone()
                for sql in (
                    "SELECT 1 FROM rollouts WHERE rollout_id = %s",
                    "SELECT 1 FROM calls WHERE rollout_id = %s LIMIT 1",
                    "SELECT 1 FROM tombstones WHERE rollout_id = %s",
                )
            ):
                return None
            deleted = _delete_rows(db, rollout_id)
            db.execute(
                "INSERT INTO tombstones (rollout_id, deleted_at) VALUES (%s, %s) "
                "ON CONFLICT DO NOTHING",
                (rollout_id, time.time()),
            )
            return deleted

        return _transaction(db, rollout_id, body)

    # --- lifecycle -----------------------------------------------------------------------

    @staticmethod
    def _freeze(db: Conn, rollout_id: str, known_elsewhere: bool) -> Snapshot:
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
                    "INSERT INTO rollouts (rollout_id, created_at) VALUES (%s, %s)",
                    (rollout_id, now),
                )
            (num_calls,) = db.execute(
                "SELECT count(*) FROM calls WHERE rollout_id = %s AND NOT late", (rollout_id,)
            ).fetchone()
            # Last: the counter row's lock is held from here to COMMIT (``_next_cursor``).
            snapshot = lifecycle.new_snapshot(
                row, num_calls=num_calls, now=now, cursor=_next_cursor(db)
            )
            db.execute(
                "UPDATE rollouts SET snapshot_id = %s, frozen_at = %s, frozen_num_calls = %s, "
                "export_cursor = %s WHERE rollout_id = %s",
                (snapshot.snapshot_id, now, snapshot.num_calls, snapshot.cursor, rollout_id),
            )
            return snapshot

        return _transaction(db, rollout_id, body)

    @staticmethod
    def _set_metadata(db: Conn, rollout_id: str, metadata: RolloutMetadata) -> int:
        def body() -> int:
            after, text = lifecycle.metadata_change(rollout_id, *_state(db, rollout_id), metadata)
            if text is not None:
                db.execute(
                    "UPDATE rollouts SET metadata = %s, version = %s WHERE rollout_id = %s",
                    (text, after, rollout_id),
                )
            return after

        return _transaction(db, rollout_id, body)

    @staticmethod
    def _retire(db: Conn, rollout_id: str, snapshot_id: str, version: int) -> Retirement:
        def body() -> Retirement:
            tomb, row = _state(db, rollout_id)
            earlier = lifecycle.earlier_retirement(rollout_id, snapshot_id, version, tomb, row)
            if earlier is not None:  # a retry with the same identifiers: the same answer
                return earlier
            deleted = _delete_rows(db, rollout_id)
            now = time.time()
            db.execute(
                "INSERT INTO tombstones (rollout_id, deleted_at, snapshot_id, version, "
                "deleted_calls) VALUES (%s, %s, %s, %s, %s)",
                (rollout_id, now, snapshot_id, version, deleted),
            )
            return Retirement(rollout_id, snapshot_id, version, deleted, now)

        return _transaction(db, rollout_id, body)

    @staticmethod
    def _sweep(db: Conn, older_than_s: float) -> int:
        cur = db.execute(
            "DELETE FROM tombstones WHERE deleted_at < %s", (time.time() - older_than_s,)
        )
        return int(cur.rowcount)

    # --- reads ---------------------------------------------------------------------------

    @staticmethod
    def _get_tombstone(db: Conn, rollout_id: str) -> float | None:
        row = db.execute(
            "SELECT deleted_at FROM tombstones WHERE rollout_id = %s", (rollout_id,)
        ).fetchone()
        return float(row[0]) if row else None

    @staticmethod
    def _get_call(db: Conn, call_id: str) -> CallRecord | None:
        def body() -> tuple[list[Any], dict[str, str]]:
            # The call and its prompt ancestors, in one recursive query; then their JSON.
            rows = db.execute(
                _ANCESTRY
                + f"SELECT {_CALL_COLUMNS} FROM calls WHERE call_id IN (SELECT id FROM anc)",
                (call_id,),
                binary=True,
            ).fetchall()
            blobs = _blobs(db, _ANCESTRY + "SELECT id FROM anc", (call_id,)) if rows else {}
            return rows, blobs

        rows, blobs = _read_transaction(db, body)
        encoded = [_bytes_row(r, blobs) for r in rows]
        if not any(r.call_id == call_id for r in encoded):
            return None
        return next(r for r in decode_records(encoded) if r.call_id == call_id)

    @staticmethod
    def _get_rollout_calls(db: Conn, rollout_id: str) -> list[CallRecord]:
        def body() -> tuple[list[Any], dict[str, str]]:
            rows = db.execute(
                f"SELECT {_CALL_COLUMNS} FROM calls WHERE rollout_id = %s "
                "ORDER BY created_at, call_id",
                (rollout_id,),
                binary=True,
            ).fetchall()
            calls = "SELECT call_id FROM calls WHERE rollout_id = %s"
            blobs = _blobs(db, calls, (rollout_id,)) if rows else {}
            return rows, blobs

        rows, blobs = _read_transaction(db, body)
        return decode_records(_bytes_row(r, blobs) for r in rows)

    @staticmethod
    def _get_rollout(db: Conn, rollout_id: str) -> RolloutInfo | None:
        row = db.execute(_ROLLOUT_SELECT + " WHERE r.rollout_id = %s", (rollout_id,)).fetchone()
        return _info(tuple(row)) if row else None

    @staticmethod
    def _list_rollouts(db: Conn, limit: int | None, after: str | None) -> list[RolloutInfo]:
        # COLLATE "C": byte order, as SQLite compares text (the database's collation may not).
        rows = db.execute(
            _ROLLOUT_SELECT + ' WHERE r.rollout_id > %s COLLATE "C" '
            'ORDER BY r.rollout_id COLLATE "C" LIMIT %s',
            (after if after is not None else "", limit),
        ).fetchall()
        return [_info(tuple(r)) for r in rows]

    @staticmethod
    def _list_frozen(db: Conn, after: int, limit: int | None) -> list[RolloutInfo]:
        rows = db.execute(
            _ROLLOUT_SELECT + " WHERE r.export_cursor > %s ORDER BY r.export_cursor LIMIT %s",
            (after, limit),
        ).fetchall()
        return [_info(tuple(r)) for r in rows]

    @staticmethod
    def _list_episodes(db: Conn, base: str) -> list[str]:
        # starts_with, not LIKE: a rollout id may hold LIKE's wildcards (``_``, ``%``).
        rows = db.execute(
            "SELECT rollout_id FROM rollouts WHERE rollout_id = %s OR starts_with(rollout_id, %s) "
            "UNION SELECT rollout_id FROM tombstones "
            "WHERE rollout_id = %s OR starts_with(rollout_id, %s)",
            (base, f"{base}-a", base, f"{base}-a"),
        ).fetchall()
        return lifecycle.episodes_of(base, (r[0] for r in rows))

    def _health(self, db: Conn) -> dict[str, Any]:
        """One catalog lookup, whatever the store's size: ``calls_estimate`` is the planner's
        row count of ``calls`` (as of the last VACUUM or ANALYZE; None before the first)."""
        (estimate,) = db.execute(
            "SELECT reltuples FROM pg_class WHERE oid = 'calls'::regclass"
        ).fetchone()
        return {
            "kind": "postgresql",
            "url": redact_url(self.url),
            "pool_size": self.pool_size,
            "retries": self.retries,
            "calls_estimate": int(estimate) if estimate >= 0 else None,
        }


def _bytes_row(row: tuple[Any, ...], blobs: dict[str, str] | None = None) -> EncodedRecord:
    """An ``EncodedRecord`` from a ``calls`` row, bytea values as ``bytes`` (psycopg may hand
    back ``memoryview``-like buffers in binary mode)."""
    values = [bytes(v) if isinstance(v, memoryview) else v for v in row]
    return _row_to_encoded(tuple(values), blobs)
