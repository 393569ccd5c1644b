"""The store's lifecycle contract, on both stores: freeze, late calls, metadata, retire, cursors,
episodes, each idempotent and surviving a reopen; the migration of a store from before the
lifecycle (SQLite layout 3, PostgreSQL layout 1); and, on PostgreSQL, two replicas freezing and
writing at once (cursors unique and increasing, a call racing a freeze in the snapshot or late)."""

from __future__ import annotations

import sqlite3
from typing import Any

import psycopg
import pytest

from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.store.base import (
    Retirement,
    RolloutDeleted,
    RolloutNotFound,
    RolloutNotFrozen,
    RolloutStatus,
    SnapshotMismatch,
)
from capture_proxy.store.postgres import PostgresStore
from capture_proxy.store.postgres_layout import LAYOUT_VERSION as PG_LAYOUT_VERSION
from capture_proxy.store.sqlite import DB_FILE_NAME, SQLiteStore
from capture_proxy.store.sqlite_layout import LAYOUT_VERSION
from tests.factories import record

# ``store`` (tests/store/conftest.py): one run on SQLite, one on PostgreSQL.


async def reopen(store: Any) -> Any:
    """The same store closed and opened again (a restart of the proxy)."""
    await store.close()
    if isinstance(store, PostgresStore):
        again: Any = PostgresStore(store.url, pool_size=store.pool_size)
    else:
        again = SQLiteStore(store.path)
    await again.open()
    return again


async def test_freeze_seals_the_calls_and_later_ones_are_late(store):
    await store.put_call(record("c1", [1, 2], [3]))
    await store.put_call(record("c2", [1, 2, 3, 4], [5], created_at=1.0))
    snap = await store.freeze_rollout("r1")
    assert (snap.version, snap.num_calls, snap.cursor) == (2, 2, 1)
    assert len(snap.snapshot_id) == 32
    assert await store.freeze_rollout("r1") == snap  # a retry: the same snapshot
    await store.put_call(record("c3", [1, 2, 3, 4, 5, 6], [7], created_at=2.0))
    await store.put_call(record("c3", [1, 2, 3, 4, 5, 6], [7], created_at=2.0))  # idempotent
    info = await store.get_rollout("r1")
    assert info is not None
    assert info.status is RolloutStatus.FROZEN
    assert (info.num_calls, info.version, info.late_call_ids) == (3, 2, ("c3",))
    assert info.snapshot == snap
    store = await reopen(store)
    try:
        assert await store.freeze_rollout("r1") == snap
        assert (await store.get_rollout("r1")).late_call_ids == ("c3",)  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_freeze_of_an_unknown_rollout_is_refused_unless_a_call_is_in_flight(store):
    with pytest.raises(RolloutNotFound):
        await store.freeze_rollout("typo")
    assert await store.get_rollout("typo") is None
    snap = await store.freeze_rollout("early", known_elsewhere=True)
    assert (snap.version, snap.num_calls) == (0, 0)
    await store.put_call(record("c1", [1], [2], rollout_id="early"))
    assert (await store.get_rollout("early")).late_call_ids == ("c1",)  # type: ignore[union-attr]


async def test_metadata_bumps_the_version_once_per_change(store):
    await store.put_call(record("c1", [1], [2]))
    meta = RolloutMetadata(reward={"pass": 1.0, "style": 0.5}, task_id="t7", tags={"k": "v"})
    assert await store.set_metadata("r1", meta) == 2
    assert await store.set_metadata("r1", meta) == 2  # a retry changes nothing
    snap = await store.freeze_rollout("r1")
    assert snap.version == 2
    assert await store.set_metadata("r1", RolloutMetadata(reward=0.5)) == 3  # after the freeze
    store = await reopen(store)
    try:
        info = await store.get_rollout("r1")
        assert info is not None
        assert info.metadata == RolloutMetadata(reward=0.5)
        assert info.version == 3 and info.snapshot is not None and info.snapshot.version == 3
        with pytest.raises(RolloutNotFound):
            await store.set_metadata("typo", meta)
    finally:
        await store.close()


async def test_retire_checks_the_identifiers_and_a_retry_answers_the_same(store):
    await store.put_call(record("c1", [1], [2]))
    with pytest.raises(RolloutNotFrozen):
        await store.retire_rollout("r1", "x" * 32, 1)
    snap = await store.freeze_rollout("r1")
    with pytest.raises(SnapshotMismatch) as bad_id:
        await store.retire_rollout("r1", "0" * 32, snap.version)
    assert bad_id.value.field == "snapshot_id"
    with pytest.raises(SnapshotMismatch) as bad_version:
        await store.retire_rollout("r1", snap.snapshot_id, snap.version + 1)
    assert bad_version.value.field == "version"
    done = await store.retire_rollout("r1", snap.snapshot_id, snap.version)
    assert isinstance(done, Retirement)
    assert (done.snapshot_id, done.version, done.deleted_calls) == (snap.snapshot_id, 1, 1)
    assert await store.get_rollout("r1") is None and await store.get_rollout_calls("r1") == []
    store = await reopen(store)
    try:
        assert await store.retire_rollout("r1", snap.snapshot_id, snap.version) == done
        with pytest.raises(SnapshotMismatch):
            await store.retire_rollout("r1", snap.snapshot_id, 9)
        with pytest.raises(RolloutDeleted):  # a late call cannot resurrect it
            await store.put_call(record("c9", [1], [2]))
        with pytest.raises(RolloutDeleted):
            await store.freeze_rollout("r1")
        with pytest.raises(RolloutNotFound):
            await store.retire_rollout("typo", snap.snapshot_id, 1)
        await store.put_call(record("d1", [1], [2], rollout_id="del"))
        await store.delete_rollout("del")
        with pytest.raises(SnapshotMismatch):  # deleted, never frozen: nothing to retire
            await store.retire_rollout("del", snap.snapshot_id, 1)
    finally:
        await store.close()


async def test_cursors_follow_freeze_order_and_are_never_reused(store):
    for rid in ("b", "a", "c"):
        await store.put_call(record(f"{rid}1", [1], [2], rollout_id=rid))
    cursors = {rid: (await store.freeze_rollout(rid)).cursor for rid in ("c", "a")}
    assert cursors == {"c": 1, "a": 2}
    assert [i.rollout_id for i in await store.list_frozen()] == ["c", "a"]
    assert [i.rollout_id for i in await store.list_frozen(after=1)] == ["a"]
    snap = (await store.get_rollout("a")).snapshot  # type: ignore[union-attr]
    assert snap is not None
    await store.retire_rollout("a", snap.snapshot_id, snap.version)
    store = await reopen(store)
    try:
        assert (await store.freeze_rollout("b")).cursor == 3  # 2 is gone, not handed out again
        assert [(i.rollout_id, i.snapshot.cursor) for i in await store.list_frozen(limit=5)] == [  # type: ignore[union-attr]
            ("c", 1),
            ("b", 3),
        ]
        assert await store.list_frozen(after=3) == []
    finally:
        await store.close()


async def test_episodes_are_found_stored_or_tombstoned(store):
    for rid in ("t1", "t1-a1", "t1-a2", "t1-b", "t10", "t1-a1-a1"):
        await store.put_call(record(f"{rid}-c", [1], [2], rollout_id=rid))
    await store.delete_rollout("t1-a2")
    assert await store.list_episodes("t1") == ["t1", "t1-a1", "t1-a2"]
    assert await store.list_episodes("t1-a1") == ["t1-a1", "t1-a1-a1"]


_V3_ROLLOUTS = """
DROP TABLE rollouts; DROP TABLE tombstones;
CREATE TABLE tombstones (rollout_id TEXT PRIMARY KEY, deleted_at REAL NOT NULL);
CREATE TABLE rollouts (
    rollout_id TEXT PRIMARY KEY, created_at REAL NOT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0, diagnostics TEXT NOT NULL DEFAULT '[]'
);
DROP TABLE counters;
INSERT INTO rollouts VALUES ('r1', 0, 0, '[]');
INSERT INTO tombstones VALUES ('old', 5.0);
PRAGMA user_version=3;
"""


async def test_a_layout_3_store_is_migrated_and_takes_the_lifecycle(tmp_path):
    s = SQLiteStore(tmp_path / "v3")
    await s.open()
    await s.put_call(record("c1", [1, 2], [3]))
    await s.put_call(record("c2", [1, 2, 3, 4], [5], created_at=1.0))
    await s.close()
    with sqlite3.connect(s.db_path) as db:  # back to layout 3: no lifecycle columns
        for index in ("rollouts_by_cursor", "calls_retry_links", "calls_late", "calls_by_prefix"):
            db.execute(f"DROP INDEX {index}")
        db.execute("ALTER TABLE calls DROP COLUMN late")
        db.executescript(_V3_ROLLOUTS)
    s = SQLiteStore(tmp_path / "v3")
    await s.open()
    try:
        info = await s.get_rollout("r1")
        assert info is not None
        assert (info.version, info.status, info.late_call_ids) == (2, RolloutStatus.OPEN, ())
        assert info.num_calls == 2  # counted once by the migration, kept from then on
        assert info.num_chains is None  # records without a verdict: not kept
        assert info.metadata == RolloutMetadata()
        snap = await s.freeze_rollout("r1")
        assert (snap.version, snap.num_calls, snap.cursor) == (2, 2, 1)
        with pytest.raises(SnapshotMismatch):  # an old tombstone is a deletion
            await s.retire_rollout("old", snap.snapshot_id, 1)
    finally:
        await s.close()
    with sqlite3.connect(tmp_path / "v3" / DB_FILE_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == LAYOUT_VERSION


# A PostgreSQL store from before the lifecycle: layout 1 (MIGRATIONS[0] only).
_PG_LAYOUT_1 = """
ALTER TABLE calls DROP COLUMN retry_of, DROP COLUMN child_digest;
ALTER TABLE rollouts DROP COLUMN incomplete_calls, DROP COLUMN num_calls, DROP COLUMN num_chains;
DROP INDEX rollouts_by_cursor;
DROP TABLE counters;
ALTER TABLE calls DROP COLUMN late;
ALTER TABLE rollouts DROP COLUMN version, DROP COLUMN metadata, DROP COLUMN snapshot_id,
    DROP COLUMN frozen_at, DROP COLUMN frozen_num_calls, DROP COLUMN export_cursor;
ALTER TABLE tombstones DROP COLUMN snapshot_id, DROP COLUMN version, DROP COLUMN deleted_calls;
DELETE FROM schema_migrations WHERE version > 1;
INSERT INTO tombstones VALUES ('old', 5.0);
"""


@pytest.mark.postgres
async def test_a_postgres_layout_1_store_is_migrated_and_takes_the_lifecycle(postgres_server):
    url = postgres_server.create_database()
    s = PostgresStore(url, pool_size=2)
    await s.open()
    await s.put_call(record("c1", [1, 2], [3]))
    await s.put_call(record("c2", [1, 2, 3, 4], [5], created_at=1.0))
    await s.close()
    with psycopg.connect(url, autocommit=True) as conn:  # back to layout 1
        conn.execute(_PG_LAYOUT_1)
    s = PostgresStore(url, pool_size=2)
    await s.open()
    try:
        info = await s.get_rollout("r1")
        assert info is not None
        assert (info.version, info.status, info.late_call_ids) == (2, RolloutStatus.OPEN, ())
        assert info.num_calls == 2  # counted once by the migration, kept from then on
        assert info.num_chains is None  # records without a verdict: not kept
        assert info.metadata == RolloutMetadata()
        snap = await s.freeze_rollout("r1")
        assert (snap.version, snap.num_calls, snap.cursor) == (2, 2, 1)
        with pytest.raises(SnapshotMismatch):  # an old tombstone is a deletion
            await s.retire_rollout("old", snap.snapshot_id, 1)
    finally:
        await s.close()
    with psycopg.connect(url) as conn:
        applied = conn.execute("SELECT version FROM schema_migrations ORDER BY version")
        assert [r[0] for r in applied.fetchall()] == list(range(1, PG_LAYOUT_VERSION + 1))


async def _replicas(postgres_server, n: int = 2) -> list[PostgresStore]:
    url = postgres_server.create_database()
    stores = [PostgresStore(url, pool_size=4) for _ in range(n)]
    for s in stores:
        await s.open()
    return stores


@pytest.mark.postgres
async def test_replicas_freezing_at_once_hand_out_each_cursor_once_in_commit_order(
    postgres_server,
):
    """Two replicas freeze 30 rollouts, each rollout from both at once, while a reader pages
    the export: one snapshot per rollout, cursors 1..30, and every listing the reader saw was a
    gap-free prefix (a cursor is never visible before a smaller one that is still to come)."""
    import asyncio

    a, b = await _replicas(postgres_server)
    ids = [f"r{i:02d}" for i in range(30)]
    try:
        for rid in ids:
            await a.put_call(record(f"{rid}-c", [1], [2], rollout_id=rid))
        listings: list[list[int]] = []
        done = asyncio.Event()

        async def read() -> None:
            while not done.is_set():
                frozen = await b.list_frozen()
                listings.append([i.snapshot.cursor for i in frozen])  # type: ignore[union-attr]

        reader = asyncio.create_task(read())
        snaps = await asyncio.gather(*(s.freeze_rollout(rid) for rid in ids for s in (a, b)))
        done.set()
        await reader
        by_rollout = {rid: snaps[2 * i : 2 * i + 2] for i, rid in enumerate(ids)}
        assert all(x == y for x, y in by_rollout.values())  # the same snapshot from both
        assert sorted(x.cursor for x, _ in by_rollout.values()) == list(range(1, 31))
        assert listings and all(seen == list(range(1, len(seen) + 1)) for seen in listings)
        assert [i.snapshot.cursor for i in await a.list_frozen()] == list(range(1, 31))  # type: ignore[union-attr]
    finally:
        for s in (a, b):
            await s.close()


@pytest.mark.postgres
async def test_a_call_racing_a_freeze_on_another_replica_is_in_the_snapshot_or_late(
    postgres_server,
):
    """One replica stores calls while the other freezes: every call is stored, and each one is
    either counted by the snapshot (and its version) or late, never both or neither."""
    import asyncio

    a, b = await _replicas(postgres_server)
    try:
        for n in range(8):
            rid = f"race{n}"
            await a.put_call(record(f"{rid}-c0", [1], [2], rollout_id=rid))
            puts = [
                a.put_call(record(f"{rid}-c{i}", [1, 2, i], [3], rollout_id=rid, created_at=i))
                for i in range(1, 13)
            ]
            results = await asyncio.gather(*puts[:6], b.freeze_rollout(rid), *puts[6:])
            snap = results[6]
            info = await b.get_rollout(rid)
            assert info is not None and info.snapshot == snap
            assert info.num_calls == 13
            assert snap.num_calls + len(info.late_call_ids) == 13
            assert snap.version == info.version == snap.num_calls  # late calls never count
            stored = {r.call_id for r in await a.get_rollout_calls(rid)}
            assert set(info.late_call_ids) <= stored and len(stored) == 13
    finally:
        for s in (a, b):
            await s.close()
