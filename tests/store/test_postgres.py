"""The PostgreSQL store's own: versioned migrations, several processes (here: store instances,
each with its own pool) writing one rollout and one database at once, the rollout lock, the
URL kept out of logs. The contract it shares with SQLite is tested in the other files here."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from capture_proxy.config import Settings
from capture_proxy.store import PostgresStore, SQLiteStore, open_store
from capture_proxy.store.base import StoreError
from capture_proxy.store.postgres import LAYOUT_VERSION, MIGRATIONS, redact_url
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
        assert LAYOUT_VERSION == len(MIGRATIONS) == 3
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
        parents = rows(a, "SELECT count(*) FROM calls c WHERE prompt_parent_call_id IS NOT NULL "
                          "AND NOT EXISTS (SELECT 1 FROM calls p WHERE p.call_id = "
                          "c.prompt_parent_call_id)")
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
        orphans = rows(a, "SELECT count(*) FROM call_json j WHERE NOT EXISTS "
                          "(SELECT 1 FROM json_blobs b WHERE b.sha256 = j.sha256)")
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
    assert isinstance(open_store(Settings(backend="http://x", store=str(tmp_path)).store),
                      SQLiteStore)
    assert redact_url("postgresql://u:p@h:5/d?x=1") == "postgresql://u:***@h:5/d?x=1"
    store = PostgresStore(pg_url, pool_size=1)
    await store.open()
    try:
        health = await store.health()
        assert health | {"url": None} == {
            "kind": "postgresql", "url": None, "pool_size": 1, "retries": 0,
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
