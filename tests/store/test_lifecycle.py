"""The store's lifecycle contract: freeze, late calls, metadata, retire, cursors, episodes,
each idempotent and surviving a reopen; and the migration of a layout-3 store."""

from __future__ import annotations

import sqlite3

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
from capture_proxy.store.sqlite import DB_FILE_NAME, SQLiteStore
from tests.factories import record


@pytest.fixture
async def store(tmp_path):
    s = SQLiteStore(tmp_path / "store")
    await s.open()
    yield s
    await s.close()


async def reopen(store: SQLiteStore) -> SQLiteStore:
    await store.close()
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
        db.execute("DROP INDEX rollouts_by_cursor")
        db.execute("ALTER TABLE calls DROP COLUMN late")
        db.executescript(_V3_ROLLOUTS)
    s = SQLiteStore(tmp_path / "v3")
    await s.open()
    try:
        info = await s.get_rollout("r1")
        assert info is not None
        assert (info.version, info.status, info.late_call_ids) == (2, RolloutStatus.OPEN, ())
        assert info.metadata == RolloutMetadata()
        snap = await s.freeze_rollout("r1")
        assert (snap.version, snap.num_calls, snap.cursor) == (2, 2, 1)
        with pytest.raises(SnapshotMismatch):  # an old tombstone is a deletion
            await s.retire_rollout("old", snap.snapshot_id, 1)
    finally:
        await s.close()
    with sqlite3.connect(tmp_path / "v3" / DB_FILE_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 4
