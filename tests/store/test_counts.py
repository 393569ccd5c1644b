"""The counts a listing and ``/health`` read are kept by every put and delete (issue 22), not
counted from the rows: they stay exact after puts, re-puts, late calls, deletes and retires,
on both stores, and an older SQLite store is recounted once when it opens."""

from __future__ import annotations

import sqlite3

from capture_proxy.store.sql import ROLLOUT_SELECT, SQLITE
from capture_proxy.store.sqlite import SQLiteStore
from capture_proxy.store.sqlite_layout import LAYOUT_VERSION
from tests.factories import record


async def _counts(store) -> dict[str, int]:
    return {r.rollout_id: r.num_calls for r in await store.list_rollouts()}


async def _sqlite_calls(store) -> int | None:
    health = await store.health()
    return health.get("calls")


async def test_counts_stay_exact_after_puts_deletes_and_retires(store):
    sqlite = isinstance(store, SQLiteStore)
    for i, rollout in enumerate(["r1", "r1", "r1", "r2", "r2", "r3"]):
        await store.put_call(record(f"c{i}", [1, 2, i], [3], rollout_id=rollout, created_at=i))
    await store.put_call(record("c0", [1, 2, 0], [3], rollout_id="r1", created_at=0))  # re-put
    assert await _counts(store) == {"r1": 3, "r2": 2, "r3": 1}
    if sqlite:
        assert await _sqlite_calls(store) == 6

    snap = await store.freeze_rollout("r1")
    assert snap.num_calls == 3
    await store.put_call(record("late", [1, 2, 9], [3], rollout_id="r1", created_at=9))
    info = await store.get_rollout("r1")
    assert (info.num_calls, info.late_call_ids) == (4, ("late",))

    assert await store.delete_rollout("r2") == 2
    assert await _counts(store) == {"r1": 4, "r3": 1}
    if sqlite:
        assert await _sqlite_calls(store) == 5

    retired = await store.retire_rollout("r1", snap.snapshot_id, snap.version)
    assert retired.deleted_calls == 4
    assert await store.delete_rollout("r2") == 0  # deleted before: nothing counted twice
    await store.put_call(record("d0", [5], [6], rollout_id="r4", created_at=20))
    assert await _counts(store) == {"r3": 1, "r4": 1}
    assert [r.num_calls for r in await store.list_rollouts(limit=1, after="r3")] == [1]
    if sqlite:
        assert await _sqlite_calls(store) == 2


async def test_a_sqlite_layout_6_store_is_recounted_on_open(tmp_path):
    store = SQLiteStore(tmp_path / "s")
    await store.open()
    for i, rollout in enumerate(["a", "a", "b"]):
        await store.put_call(record(f"c{i}", [1, i], [2], rollout_id=rollout, created_at=i))
    await store.close()
    with sqlite3.connect(store.db_path) as db:  # layout 6: no kept counts
        db.executescript(
            "ALTER TABLE rollouts DROP COLUMN num_calls; "
            "DELETE FROM counters WHERE name = 'calls'; PRAGMA user_version=6;"
        )
    store = SQLiteStore(tmp_path / "s")
    await store.open()
    try:
        assert await _counts(store) == {"a": 2, "b": 1}
        assert await _sqlite_calls(store) == 3
        await store.put_call(record("c3", [1, 3], [2], rollout_id="b", created_at=3))
        assert await _counts(store) == {"a": 2, "b": 2}
        assert await _sqlite_calls(store) == 4
    finally:
        await store.close()
    with sqlite3.connect(store.db_path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == LAYOUT_VERSION == 10


async def test_a_sqlite_listing_reads_no_call_rows_but_the_late_ones(tmp_path):
    store = SQLiteStore(tmp_path / "s")
    await store.open()
    await store.put_call(record("a", [1, 2], [3]))
    await store.close()
    listing = SQLITE.sql(ROLLOUT_SELECT + " WHERE r.rollout_id > ? ORDER BY r.rollout_id LIMIT ?")
    with sqlite3.connect(store.db_path) as db:
        plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + listing, ("", -1))]
    assert plan == [
        "SEARCH r USING INDEX sqlite_autoindex_rollouts_1 (rollout_id>?)",
        "CORRELATED SCALAR SUBQUERY 2",
        "CO-ROUTINE (subquery-1)",
        "SEARCH k USING PRIMARY KEY (rollout_id=?)",  # the calls' diagnostic kinds
        "SCAN (subquery-1)",
        "CORRELATED SCALAR SUBQUERY 4",
        "CO-ROUTINE (subquery-3)",
        "SEARCH c USING INDEX calls_late (rollout_id=?)",
        "SCAN (subquery-3)",
    ]
