"""The shared store: PostgreSQL, for proxy replicas past one machine. Same contract as SQLite.

Owns the PostgreSQL table layout, its versioned migrations, and the concurrency rules that let
several proxy processes write one store. Record encoding is the core codec's (schema v4, the
same ``EncodedRecord`` columns as ``sqlite.py``, arrays as ``bytea`` in the same little-endian
layout); the prompt parent is chosen by the same rule (``core.prefixes``). What an operation
decides is ``lifecycle``'s and its async method ``threaded``'s, as for ``sqlite.py``: one
synchronous function per store operation, taking a connection, written once in ``sql.py``.
The exception is ``put_call``, the hot path, written for round trips (below).

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
``PREFETCHED_MESSAGES``, the call's retry family when it counts, its linked parent's
status), then the inserts, the rollout's upsert and COMMIT (``benchmarks/pg_put_call.py``: 12
round trips before). ``health()`` is one catalog lookup (no row count).

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

Layout: the tables of ``sqlite.py`` plus ``schema_migrations``, applied on open by
``postgres_layout.py`` (``MIGRATIONS``, ``LAYOUT_VERSION``). The statements and the transaction
bodies of every operation but ``put_call`` are ``sql.py``'s (``SQLStore``, dialect
``POSTGRES``); this module holds the pool, its threads and retries, and ``put_call``.
Use a database of its own (or a schema of its own, via ``options=-csearch_path=...`` in the
URL).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from capture_proxy.core.completeness import RetryLink
from capture_proxy.core.prefixes import (
    PREFIX_BLOCK,
    StoredPrefix,
    block_digests,
    block_states,
    choose_prompt_parent,
    choose_with_digest,
    token_digests,
)
from capture_proxy.core.records import CallRecord, CallStatus
from capture_proxy.core.redact import redact_url
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.stored_form import COLUMNS, EncodedRecord, StoredMessages, column_values
from capture_proxy.store import image_rows, lifecycle, sql
from capture_proxy.store.base import StoreError
from capture_proxy.store.postgres_layout import migrate_layout
from capture_proxy.store.sql import POSTGRES
from capture_proxy.store.transactions import SQLStore
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
#: Seconds to wait for the pool's first connections on open.
OPEN_TIMEOUT_S = 30.0

# The codec's columns, then the store's own: ``late``, ``retry_of``, ``child_digest``,
# ``tokens_block_sha256``. No ON CONFLICT: ``put_call`` looked under the rollout's lock and
# found no such call; the same id stored meanwhile by another rollout's transaction is a
# UniqueViolation, retried.
_INSERT_CALL = (
    f"INSERT INTO calls ({sql.CALL_COLUMNS}, late, {sql.STORE_COLUMNS}, tokens_block_sha256) "
    f"VALUES ({', '.join(['%s'] * (len(COLUMNS) + 4))})"
)

#: The deepest prompt-parent candidates whose ``StoredMessages`` come with the candidates (the
#: chosen parent is nearly always among them; another is read when needed).
PREFETCHED_MESSAGES = 4
_N = "num_prompt_tokens + num_generation_tokens"
_CANDIDATE_OF = (
    f"SELECT call_id, created_at, {_N} AS n, tokens_sha256, prompt_parent_call_id, "
    "messages_prefix_len, num_messages, messages_chain FROM calls, depth "
    "WHERE rollout_id = %(rollout)s AND status = 'complete' AND num_generation_tokens > 0 AND "
)
# The rollout's prompt-parent candidates (``core.prefixes``): complete, with output, not longer
# than the prompt and, as in sqlite.py, at least as deep as the record's verified parent when
# that is one (the deepest candidate wins and the parent is a candidate). Those shorter than a
# block are a range of the partial index ``calls_by_prefix``; the others are those filed under
# one of the prompt's block digests (``calls_by_block``, ``prefixes.block_digests``): the calls
# that share the prompt's blocks, not every call of the rollout in the length range (other
# sessions' calls of the same depth); rows written before migration 7 (no block digest) are
# read as before. Then the ``StoredMessages`` columns, the chain only for the deepest few.
# Literal ``'complete'``, so that the planner may use the partial indexes.
_CANDIDATES = (
    "WITH depth AS (SELECT COALESCE((SELECT p.num_prompt_tokens + p.num_generation_tokens "
    "FROM calls p WHERE p.call_id = %(parent)s AND p.rollout_id = %(rollout)s "
    "AND p.status = 'complete' AND p.num_generation_tokens > 0 "
    "AND p.num_prompt_tokens + p.num_generation_tokens <= %(prompt)s), 0) AS d), c AS ("
    + _CANDIDATE_OF
    + f"{_N} BETWEEN depth.d AND LEAST(%(prompt)s, %(block)s - 1) UNION ALL "
    + _CANDIDATE_OF
    + f"tokens_block_sha256 = ANY(%(blocks)s) AND {_N} BETWEEN GREATEST(depth.d, %(block)s) "
    "AND %(prompt)s UNION ALL "
    + _CANDIDATE_OF
    + f"tokens_block_sha256 IS NULL AND {_N} BETWEEN GREATEST(depth.d, %(block)s) "
    "AND %(prompt)s) "
    "SELECT call_id, created_at, n, tokens_sha256, prompt_parent_call_id, messages_prefix_len, "
    "num_messages, CASE WHEN row_number() OVER (ORDER BY n DESC) <= "
    f"{PREFETCHED_MESSAGES} THEN messages_chain END FROM c"
)
# A late call (``version`` + 0) changes neither the revision nor the count of incomplete calls.
_LOCK_ROLLOUT = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"

T = TypeVar("T")
Conn = Any  # psycopg.Connection[tuple[Any, ...]]; Any so that the module imports without it


def is_postgres_url(value: str) -> bool:
    return value.startswith(URL_SCHEMES)


def _candidates(rows: list[Any]) -> tuple[list[StoredPrefix], dict[str, StoredMessages]]:
    """Rows of ``_CANDIDATES``: the ``StoredPrefix`` of each, the ``StoredMessages`` of those
    that came with their messages chain."""
    prefixes = [StoredPrefix(r[0], r[1], r[2], bytes(r[3])) for r in rows]
    messages = {
        r[0]: StoredMessages(r[0], r[4], r[5], r[6], bytes(r[7])) for r in rows if r[7] is not None
    }
    return prefixes, messages


def _block_sha256(record: CallRecord, states: list[Any]) -> bytes | None:
    """``calls.tokens_block_sha256`` of a call later prompts may extend (complete, with
    output), else None; ``states``: the prompt's ``prefixes.block_states``."""
    if record.status is not CallStatus.COMPLETE or record.num_generation_tokens == 0:
        return None
    return token_digests(record.prompt_token_ids, record.generation_token_ids, states)[1]


def _retry_family(db: Conn, record: CallRecord) -> Any:
    """The cursor of the record's retry family (``sql.RETRY_FAMILY``), for the pipeline."""
    rid, cid = record.rollout_id, record.call_id
    args = (record.retry_of, rid, cid, rid, rid, cid)
    return db.execute(POSTGRES.sql(sql.RETRY_FAMILY), args)


def _parent_status(db: Conn, record: CallRecord) -> Any:
    """The cursor of the record's linked parent's status (``sql.PARENT_STATUS``), or None when
    the number of chains does not ask it (``core.chain_counts``)."""
    if record.parent_call_id is None or not record.linkable or record.linking is None:
        return None
    return db.execute(POSTGRES.sql(sql.PARENT_STATUS), (record.parent_call_id, record.rollout_id))


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


class PostgresStore(SQLStore):
    """Shared store at ``url`` (``postgresql://user[:password]@host[:port]/database``).
    ``pool_size``: pooled connections, and worker threads, of this process. Its
    ``CaptureStore`` methods are ``ThreadedStore``'s: reads and writes hop to any pool thread."""

    #: Other processes write this store too: a rollout's link index may be stale (the linker
    #: reloads it on a digest miss).
    shared = True
    dialect = POSTGRES

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
        """A read: dropped unrun when its caller gave up before a thread took it."""
        if self._worker is None:
            raise StoreError("store is not open")
        return await self._worker.run_unless_abandoned(self._with_connection, fn, *args)

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
            await self._run(migrate_layout, redact_url(self.url))
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

    # --- transactions --------------------------------------------------------------------

    def _transaction(self, db: Conn, rollout_id: str | None, body: Callable[[], T]) -> T:
        """Run ``body`` in one transaction (rolled back on any exception), holding the rollout's
        advisory lock from the start when ``rollout_id`` is given."""
        with db.transaction():
            if rollout_id is not None:
                db.execute(_LOCK_ROLLOUT, (rollout_id,))
            return body()

    def _read_transaction(self, db: Conn, body: Callable[[], T]) -> T:
        """Run ``body`` in one read-only REPEATABLE READ transaction (one snapshot)."""
        with db.transaction():
            db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            return body()

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
                state = db.execute(POSTGRES.sql(sql.STATE), (rid,))
                stored = db.execute(POSTGRES.sql(sql.STORED_CALL), (record.call_id,), binary=True)
                states = block_states(record.prompt_token_ids)
                args = {
                    "rollout": rid,
                    "prompt": record.num_prompt_tokens,
                    "block": PREFIX_BLOCK,
                    "blocks": block_digests(record.prompt_token_ids, states),
                }
                candidates = db.execute(
                    _CANDIDATES, {**args, "parent": record.parent_call_id}, binary=True
                )
                links = _retry_family(db, record) if lifecycle.may_recount(record) else None
                parent_row = _parent_status(db, record)
                tomb, rollout = lifecycle.state_of(state.fetchone())  # the first round trip
                lifecycle.refuse_deleted(record, tomb is not None)
                frozen = rollout is not None and rollout.frozen
                prefixes, messages = _candidates(candidates.fetchall())
                parent, tokens_sha256 = choose_with_digest(
                    record.prompt_token_ids,
                    record.generation_token_ids,
                    prefixes,
                    exclude=record.call_id,
                )
                if parent is None and record.parent_call_id is not None:
                    # A parent that is not a prefix (a record put by hand): all candidates.
                    again = db.execute(_CANDIDATES, {**args, "parent": None}, binary=True)
                    prefixes, messages = _candidates(again.fetchall())
                    parent = choose_prompt_parent(
                        record.prompt_token_ids, prefixes, exclude=record.call_id
                    )
                enc = lifecycle.encode_with_parent(
                    record,
                    request,
                    parent,
                    lambda c: messages.get(c) or sql.stored_messages(POSTGRES, db, c),
                    tokens_sha256,
                )
                row = stored.fetchone()
                if row is not None:  # stored before: the same content, or refused
                    lifecycle.check_re_put(sql.encoded_row(row), enc)
                    db.execute("COMMIT")
                    return
                family = [RetryLink(*r) for r in links.fetchall()] if links is not None else []
                found = parent_row.fetchone() if parent_row is not None else None
                parent_status = None if found is None else str(found[0])
                PostgresStore._insert(db, record, enc, states, frozen, family, parent_status)
                db.execute("COMMIT")
            # The second round trip: the pipeline's sync at its end (errors are raised here).
        except BaseException:
            if db.pgconn.transaction_status != pq.TransactionStatus.IDLE:
                with contextlib.suppress(psycopg.Error):  # a lost connection: nothing to undo
                    db.execute("ROLLBACK")
            raise

    @staticmethod
    def _insert(
        db: Conn,
        record: CallRecord,
        enc: EncodedRecord,
        states: list[Any],
        frozen: bool,
        family: list[RetryLink],
        parent_status: str | None,
    ) -> None:
        """The write half of ``_put``, queued in its pipeline before COMMIT: the call's row,
        its JSON parts, the rollout's counters and the diagnostic kinds. No round trip."""
        effect = lifecycle.call_effect(record, frozen=frozen, inserted=True)
        incomplete, chains = lifecycle.count_deltas(record, effect, family, parent_status)
        block = _block_sha256(record, states)
        own = sql.store_columns(record)
        db.execute(_INSERT_CALL, (*column_values(enc), frozen, *own, block))
        sql.store_json(POSTGRES, db, enc, count=False)
        image_rows.store_images(POSTGRES, db, record, count=False)
        db.execute(
            POSTGRES.sql(sql.UPSERT_ROLLOUT),
            (
                record.rollout_id,
                enc.created_at,
                incomplete,
                effect.version_delta,
                1,
                chains,
                *lifecycle.call_tally(record),
            ),
        )
        sql.keep_kinds(POSTGRES, db, record.rollout_id, (d.kind for d in record.diagnostics))

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
