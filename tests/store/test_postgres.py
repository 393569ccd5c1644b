"""The PostgreSQL store's own: versioned migrations, several processes (here: store instances,
each with its own pool) writing one rollout and one database at once, the rollout lock, the
URL kept out of logs. The contract it shares with SQLite is tested in the other files here."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from capture_proxy.config import Settings
from capture_proxy.core.records import CallStatus
from capture_proxy.core.stored_form import COLUMNS
from capture_proxy.store import PostgresStore, SQLiteStore, open_store
from capture_proxy.store.base import ConflictingRecord, RolloutDeleted, StoreError
from capture_proxy.store.postgres import redact_url
from capture_proxy.store.postgres_layout import LAYOUT_VERSION, MIGRATIONS
from tests.core.test_codec_v2 import assert_same, chain
from tests.core.test_codec_v3 import assert_same_json, session
from tests.store.conftest import rows

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_url(postgres_server) -> str:
    return str(postgres_server.create_database())


async def test_migrations_apply_once_and_a_newer_layout_is_refused(pg_url):
    stores = [PostgresStore(pg_url, pool_size=2) for _ in range(3)]
    await asyncio.gather(*(s.open() for s in stores))  # replicas starting together
    try:
        applied = rows(stores[0], "SELECT version FROM schema_migrations ORDER BY version")
        assert applied == [(v,) for v in range(1, len(MIGRATIONS) + 1)]
        assert LAYOUT_VERSION == len(MIGRATIONS) == 8
    finally:
        for s in stores:
            await s.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("INSERT INTO schema_migrations VALUES (%s, 0)", (LAYOUT_VERSION + 1,))
    newer = PostgresStore(pg_url)
    with pytest.raises(StoreError, match=f"has layout {LAYOUT_VERSION + 1}; this reader knows"):
        await newer.open()
    await newer.close()


async def test_replicas_writing_one_rollout_at_once_lose_nothing(pg_url):
    """Two store instances put the calls of one chain concurrently, in any order: every call is
    stored once, reads are equal from both, and each prompt parent is a stored call."""
    a, b = PostgresStore(pg_url, pool_size=4), PostgresStore(pg_url, pool_size=4)
    await a.open()
    await b.open()
    try:
        records = chain(40)
        await asyncio.gather(
            *(((a if i % 2 else b).put_call(rec)) for i, rec in enumerate(records)),
            *(a.put_call(rec) for rec in records[::3]),  # re-puts race their first put
        )
        for store in (a, b):
            got = await store.get_rollout_calls("r1")
            assert [r.call_id for r in got] == [r.call_id for r in records]
            for g, want in zip(got, records, strict=True):
                assert_same(g, want)
        parents = rows(
            a,
            "SELECT count(*) FROM calls c WHERE prompt_parent_call_id IS NOT NULL "
            "AND NOT EXISTS (SELECT 1 FROM calls p WHERE p.call_id = "
            "c.prompt_parent_call_id)",
        )
        assert parents == [(0,)]
        assert (await a.get_rollout("r1")).num_calls == 40
    finally:
        await a.close()
        await b.close()


async def test_deletes_racing_writes_that_share_json_keep_every_reference(pg_url):
    """Rollouts share their tools and system prompt (content-addressed). Deleting some while
    others are written, from two instances, never leaves a call referring to a deleted text."""
    a, b = PostgresStore(pg_url, pool_size=4), PostgresStore(pg_url, pool_size=4)
    await a.open()
    await b.open()
    try:

        def rollout(n: int) -> list:
            return [r.replace(rollout_id=f"r{n}", call_id=f"r{n}-{r.call_id}") for r in session(3)]

        for n in range(0, 8, 2):
            for rec in rollout(n):
                await a.put_call(rec)
        writes = [b.put_call(rec) for n in range(1, 8, 2) for rec in rollout(n)]
        deletes = [a.delete_rollout(f"r{n}") for n in range(0, 8, 2)]
        await asyncio.gather(*writes, *deletes)
        orphans = rows(
            a,
            "SELECT count(*) FROM call_json j WHERE NOT EXISTS "
            "(SELECT 1 FROM json_blobs b WHERE b.sha256 = j.sha256)",
        )
        assert orphans == [(0,)]
        assert [i.rollout_id for i in await a.list_rollouts()] == ["r1", "r3", "r5", "r7"]
        for n in range(1, 8, 2):
            for got, want in zip(await a.get_rollout_calls(f"r{n}"), rollout(n), strict=True):
                assert_same_json(got, want)
        assert rows(a, "SELECT count(*) FROM json_blobs") == [(2,)]  # tools, system prompt
    finally:
        await a.close()
        await b.close()


async def test_a_write_waits_for_the_rollout_lock_and_reads_do_not(pg_url):
    """Another process holding the rollout's lock (a write in progress) delays a write of that
    rollout, not of others, and no read."""
    store = PostgresStore(pg_url, pool_size=4)
    await store.open()
    try:
        first, second = chain(2)
        await store.put_call(first)
        other = psycopg.connect(pg_url)
        try:
            other.execute("SELECT pg_advisory_xact_lock(hashtextextended('r1', 0))")
            put = asyncio.create_task(store.put_call(second))
            await store.put_call(first.replace(rollout_id="r2", call_id="x"))  # not blocked
            got = await asyncio.wait_for(store.get_rollout_calls("r1"), timeout=5)
            assert [r.call_id for r in got] == [first.call_id]
            assert not put.done()
            other.rollback()  # releases the lock
            await asyncio.wait_for(put, timeout=10)
        finally:
            other.close()
        got = await store.get_rollout_calls("r1")
        assert [r.call_id for r in got] == [first.call_id, second.call_id]
    finally:
        await store.close()


async def test_the_store_setting_takes_a_url_and_logs_no_password(pg_url, tmp_path):
    secret = pg_url.replace("capture@", "capture:hunter2@")
    settings = Settings(backend="http://127.0.0.1:1", store=secret)
    assert settings.store == secret
    assert "hunter2" not in settings.store_label and ":***@" in settings.store_label
    assert isinstance(open_store(settings.store), PostgresStore)
    assert isinstance(
        open_store(Settings(backend="http://x", store=str(tmp_path)).store), SQLiteStore
    )
    assert redact_url("postgresql://u:p@h:5/d?x=1") == "postgresql://u:***@h:5/d?x=1"
    store = PostgresStore(pg_url, pool_size=1)
    await store.open()
    try:
        health = await store.health()
        assert health | {"url": None} == {
            "kind": "postgresql",
            "url": None,
            "pool_size": 1,
            "retries": 0,
            "calls_estimate": None,  # never analyzed
        }
    finally:
        await store.close()
    await store.close()  # idempotent
    with pytest.raises(StoreError, match="not open"):
        await store.get_call("c1")


async def test_an_unreachable_server_fails_open_with_a_store_error(postgres_server):
    from benchmarks.infra import free_port

    store = PostgresStore(f"postgresql://capture@127.0.0.1:{free_port()}/x", pool_size=1)
    store.open_timeout_s = 1.0
    with pytest.raises(StoreError, match="cannot connect"):
        await asyncio.wait_for(store.open(), timeout=30)


def _turns(trace: str) -> int:
    """Client-server turns in a libpq trace: frontend messages answered by the backend."""
    turns, last = 0, ""
    for line in trace.splitlines():
        if line[:1] == "B" and last == "F":
            turns += 1
        last = line[:1] if line[:1] in ("F", "B") else last
    return turns


async def _traced(store: PostgresStore, tmp_path, action) -> int:
    """Round trips the one pooled connection of ``store`` makes while ``action`` runs."""
    from psycopg import pq

    path = tmp_path / "trace.txt"
    with path.open("w") as f:
        with store._pool.connection() as conn:
            conn.pgconn.trace(f.fileno())
            conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            await action()
        finally:
            with store._pool.connection() as conn:
                conn.pgconn.untrace()
    return _turns(path.read_text())


async def test_put_call_is_two_round_trips_and_health_one(pg_url, tmp_path):
    """A new call: the lock and every read at once, then the writes and COMMIT; a re-put:
    the reads, then COMMIT, nothing written; a cut-off call and its retry likewise (the retry
    links come with the reads); ``health`` is one catalog lookup."""
    from tests.factories import record

    store = PostgresStore(pg_url, pool_size=1)
    await store.open()
    try:
        first, second, third = session(3)
        await store.put_call(first)
        await store.put_call(second)
        assert await _traced(store, tmp_path, lambda: store.put_call(third)) == 2
        assert await _traced(store, tmp_path, lambda: store.put_call(third)) == 2
        cut = record("cut", [1, 2], [3], status=CallStatus.INCOMPLETE, rollout_id="r2")
        retry = record("ok", [1, 2], [3, 4], rollout_id="r2").replace(retry_of="cut")
        for rec in (cut, retry):
            assert await _traced(store, tmp_path, lambda rec=rec: store.put_call(rec)) == 2
        assert not (await store.get_rollout("r2")).incomplete
        assert await _traced(store, tmp_path, store.health) == 1
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("ANALYZE calls")
        assert (await store.health())["calls_estimate"] == 5
        for got, want in zip(await store.get_rollout_calls("r1"), session(3), strict=True):
            assert_same_json(got, want)
    finally:
        await store.close()


async def test_a_refused_put_leaves_its_connection_clean(pg_url):
    """ConflictingRecord and RolloutDeleted are raised between the two round trips: the
    transaction is rolled back and the one pooled connection serves the next call."""
    from tests.factories import record

    store = PostgresStore(pg_url, pool_size=1)
    await store.open()
    try:
        await store.put_call(record("c1", [1, 2], [3]))
        with pytest.raises(ConflictingRecord):
            await store.put_call(record("c1", [1, 2], [4]))
        await store.put_call(record("d1", [1], [2], rollout_id="gone"))
        await store.delete_rollout("gone")
        with pytest.raises(RolloutDeleted):
            await store.put_call(record("d2", [1], [2], rollout_id="gone"))
        await store.put_call(record("c2", [1, 2, 3, 5], [6], created_at=1.0))
        assert [r.call_id for r in await store.get_rollout_calls("r1")] == ["c1", "c2"]
        assert rows(store, "SELECT call_id FROM calls ORDER BY call_id") == [("c1",), ("c2",)]
        assert rows(store, "SELECT version FROM rollouts") == [(2,)]
    finally:
        await store.close()


async def test_a_call_id_stored_meanwhile_by_another_rollout_is_refused_after_a_retry(pg_url):
    """Another rollout's transaction inserts the same call id after this put looked (its row
    uncommitted): the insert waits on it, fails on the unique key once it commits, and the
    retry finds the stored call and refuses this one; nothing of it is written."""
    from capture_proxy.core.codec import encode_record
    from capture_proxy.core.stored_form import column_values
    from tests.factories import record

    store = PostgresStore(pg_url, pool_size=1)
    await store.open()
    other = psycopg.connect(pg_url)
    try:
        theirs = encode_record(record("x", [9], [9], rollout_id="other"))
        other.execute(
            f"INSERT INTO calls ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * len(COLUMNS))})",
            column_values(theirs),
        )
        put = asyncio.create_task(store.put_call(record("x", [1], [2])))
        async with asyncio.timeout(10):
            while not rows(store, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"):
                await asyncio.sleep(0.01)
        other.commit()
        with pytest.raises(ConflictingRecord, match="call x is already stored"):
            await asyncio.wait_for(put, timeout=10)
        assert store.retries == 1
        assert rows(store, "SELECT rollout_id FROM calls") == [("other",)]
        assert rows(store, "SELECT count(*) FROM rollouts") == [(0,)]
    finally:
        other.close()
        await store.close()
