"""The store contract (delta prompts, idempotency, conflicts, tombstones), on every store: the
tests taking ``store`` run on SQLite and PostgreSQL (``conftest.py``); the SQLite store's own
(migration of old files, its write lock, synchronous modes, threads) build a ``SQLiteStore``."""

import asyncio
import dataclasses
import json
import sqlite3
import threading

import numpy as np
import pytest

from capture_proxy.core.records import CallStatus, Diagnostic
from capture_proxy.proxy.recorder import Recorder, StoreWrite
from capture_proxy.store.base import ConflictingRecord, RolloutDeleted, StoreError
from capture_proxy.store.sqlite import DB_FILE_NAME, SQLiteStore
from capture_proxy.store.sqlite_layout import LAYOUT_VERSION
from tests.core.test_codec_v2 import assert_same, chain, v1_form
from tests.factories import record
from tests.store.conftest import rows


@pytest.fixture
async def sqlite_store(tmp_path):
    s = SQLiteStore(tmp_path / "store")
    await s.open()
    yield s
    await s.close()


def blob_sizes(store) -> list[tuple[str, int, str | None]]:
    return rows(
        store,
        "SELECT call_id, length(prompt_token_ids) + length(generation_token_ids) "
        "+ length(generation_log_probs) + coalesce(length(routed_experts), 0), "
        "prompt_parent_call_id FROM calls ORDER BY call_id",
    )


async def test_chain_round_trip_and_constant_bytes_per_turn(store):
    records = chain(40, new_prompt=50, gen=20)
    for rec in records:
        rec.routed_experts = np.full((20, 4, 2), 7, np.int32)
        rec.routed_experts_start = rec.num_prompt_tokens
        await store.put_call(rec)
    sizes = blob_sizes(store)
    assert {size for _, size, _ in sizes} == {(50 + 20 + 20) * 4 + 20 * 4 * 2}
    assert [p for _, _, p in sizes] == [None] + [r.call_id for r in records[:-1]]
    back = await store.get_rollout_calls("r1")
    for got, want in zip(back, records, strict=True):
        assert_same(got, want)
        assert got.routed_experts.dtype == np.uint8
    assert_same(await store.get_call(records[-1].call_id), records[-1])
    assert await store.get_call("nope") is None
    # The rollout and its calls in one read (the read API's): the same as the two reads.
    found = await store.get_rollout_with_calls("r1")
    assert found is not None and found[0] == await store.get_rollout("r1")
    for got, want in zip(found[1], records, strict=True):
        assert_same(got, want)
    assert await store.get_rollout_with_calls("nope") is None


async def test_only_complete_calls_with_output_are_prompt_parents(store):
    parent, child = chain(2)
    await store.put_call(parent.replace(status=CallStatus.INCOMPLETE))
    await store.put_call(child)
    assert [p for _, _, p in blob_sizes(store)] == [None, None]
    assert_same((await store.get_rollout_calls("r1"))[1], child)


async def test_child_before_parent_is_stored_whole(store):
    parent, child = chain(2)
    await store.put_call(child)
    await store.put_call(parent)
    assert [p for _, _, p in blob_sizes(store)] == [None, None]
    for got, want in zip(await store.get_rollout_calls("r1"), [parent, child], strict=True):
        assert_same(got, want)


async def test_prompt_parents_stay_within_the_rollout(store):
    parent, child = chain(2)
    await store.put_call(parent.replace(rollout_id="other"))
    await store.put_call(child)
    assert [p for _, _, p in blob_sizes(store)] == [None, None]


async def test_idempotent_re_put(store):
    records = chain(3)
    await store.put_call(records[0])
    await store.put_call(records[2])  # stored whole: c001 is not there yet
    await store.put_call(records[1])
    for rec in records:  # the same content again is a no-op, however the prompt was split
        await store.put_call(rec)
    assert (await store.get_rollout("r1")).num_calls == 3
    for got, want in zip(await store.get_rollout_calls("r1"), records, strict=True):
        assert_same(got, want)


async def test_conflicting_re_put_is_refused_and_original_kept(store):
    rec = record("c1", [1, 2, 3], [4, 5])
    await store.put_call(rec)
    changed = rec.replace(generation_token_ids=np.array([4, 6], np.uint32))
    with pytest.raises(ConflictingRecord, match="original kept"):
        await store.put_call(changed)
    with pytest.raises(ConflictingRecord):
        await store.put_call(rec.replace(finish_reason="length"))
    assert_same(await store.get_call("c1"), rec)
    # Through the recorder: refused by default (the call is not answered as a success) ...
    assert await Recorder(store).persist(changed) is StoreWrite.REFUSED
    assert not (await store.get_rollout("r1")).incomplete
    # ... or, answered anyway, the loss recorded on the rollout.
    recorder = Recorder(store, store_failure="answer")
    assert await recorder.persist(changed) is StoreWrite.LOST
    info = await store.get_rollout("r1")
    assert info.incomplete and info.diagnostics[0].kind == "store_failed"
    assert "ConflictingRecord" in info.diagnostics[0].details["reason"]
    assert info.diagnostics[0].details["call_ids"] == ["c1"]


async def test_tombstone_refuses_late_writes_until_swept(store):
    a, b = chain(2)
    await store.put_call(a)
    await store.put_call(record("x", [1], [2], rollout_id="keep"))
    assert await store.delete_rollout("r1") == 1
    assert await store.get_rollout("r1") is None
    assert await store.get_rollout_calls("r1") == []
    assert await store.get_tombstone("r1") is not None
    with pytest.raises(RolloutDeleted):
        await store.put_call(b)
    assert isinstance(RolloutDeleted("x"), StoreError)
    # The recorder swallows it and cannot resurrect the rollout by marking it incomplete.
    assert await Recorder(store, store_failure="answer").persist(b) is StoreWrite.LATE
    await store.mark_rollout_incomplete("r1", Diagnostic("store_failed", {}))
    assert await store.get_rollout("r1") is None
    assert await store.delete_rollout("r1") == 0  # idempotent
    assert [i.rollout_id for i in await store.list_rollouts()] == ["keep"]
    assert await store.sweep_tombstones(3600) == 0
    assert await store.sweep_tombstones(-1) == 1
    assert await store.get_tombstone("r1") is None
    await store.put_call(b)
    assert (await store.get_rollout("r1")).num_calls == 1


_V1_SCHEMA = """
CREATE TABLE calls (
    call_id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL, created_at REAL NOT NULL,
    status TEXT NOT NULL, schema_version INTEGER NOT NULL, meta TEXT NOT NULL,
    prompt_token_ids BLOB NOT NULL, generation_token_ids BLOB NOT NULL,
    generation_log_probs BLOB NOT NULL, routed_experts BLOB
);
CREATE INDEX calls_by_rollout ON calls (rollout_id, created_at);
CREATE TABLE rollouts (
    rollout_id TEXT PRIMARY KEY, created_at REAL NOT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0, diagnostics TEXT NOT NULL DEFAULT '[]'
);
"""


async def test_v1_store_is_migrated_on_open(tmp_path):
    *records, nxt = chain(4)
    records[1].routed_experts = np.arange(8).reshape(2, 2, 2)
    path = tmp_path / "old"
    path.mkdir()
    with sqlite3.connect(path / DB_FILE_NAME) as db:
        db.executescript(_V1_SCHEMA)
        for rec in records:
            enc = v1_form(rec)
            db.execute(
                "INSERT INTO calls VALUES (?,?,?,?,?,?,?,?,?,?)", dataclasses.astuple(enc)[:10]
            )
            db.execute("INSERT OR IGNORE INTO rollouts VALUES (?, 0, 0, '[]')", (rec.rollout_id,))
    s = SQLiteStore(path)
    await s.open()
    try:
        for got, want in zip(await s.get_rollout_calls("r1"), records, strict=True):
            assert_same(got, want)
            assert got.schema_version == 4
        await s.put_call(records[0])  # idempotent against a migrated row
        await s.put_call(nxt)  # a new child gets a delta against a migrated parent
        assert blob_sizes(s)[-1][2] == "c002"
    finally:
        await s.close()
    with sqlite3.connect(path / DB_FILE_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == LAYOUT_VERSION
        assert db.execute("SELECT DISTINCT schema_version FROM calls").fetchall() == [(4,)]


async def test_newer_layout_is_refused(tmp_path):
    path = tmp_path / "new"
    path.mkdir()
    with sqlite3.connect(path / DB_FILE_NAME) as db:
        db.execute(f"PRAGMA user_version={LAYOUT_VERSION + 1}")
    s = SQLiteStore(path)
    with pytest.raises(StoreError, match="layout"):
        await s.open()
    await s.close()


async def test_reads_do_not_queue_behind_a_waiting_write(sqlite_store):
    """Reads use their own connection and thread: a write stuck on SQLite's write lock (held
    here by another connection) does not delay them, and they see the last committed state."""
    store = sqlite_store
    a, b = chain(2)
    await store.put_call(a)
    other = sqlite3.connect(store.db_path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # the write lock, until ROLLBACK below
        put = asyncio.create_task(store.put_call(b))
        await asyncio.sleep(0.05)
        assert not put.done()
        got = await asyncio.wait_for(store.get_rollout_calls("r1"), timeout=2)
        assert [r.call_id for r in got] == [a.call_id]
        assert (await asyncio.wait_for(store.health(), timeout=2))["calls"] == 1
        other.execute("ROLLBACK")
        await asyncio.wait_for(put, timeout=5)
    finally:
        other.close()
    assert [r.call_id for r in await store.get_rollout_calls("r1")] == [a.call_id, b.call_id]


async def test_concurrent_writes_and_reads_are_consistent(store):
    records = chain(30)
    puts = [store.put_call(rec) for rec in records]
    reads = [store.list_rollouts() for _ in range(10)]
    await asyncio.gather(*puts, *reads)
    for got, want in zip(await store.get_rollout_calls("r1"), records, strict=True):
        assert_same(got, want)


async def test_close_is_idempotent_and_a_closed_store_refuses_work(tmp_path):
    def store_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("capture-store-")}

    before = store_threads()
    s = SQLiteStore(tmp_path / "s")
    await s.open()
    await s.put_call(record("c1", [1, 2], [3]))
    await s.close()
    await s.close()
    with pytest.raises(StoreError, match="not open"):
        await s.put_call(record("c2", [1, 2], [3]))
    with pytest.raises(StoreError, match="not open"):
        await s.get_call("c1")
    assert store_threads() <= before  # both threads were stopped
    await s.open()  # reopens on fresh threads
    try:
        assert (await s.health())["calls"] == 1
    finally:
        await s.close()


@pytest.mark.parametrize(("synchronous", "pragma"), [("full", 2), ("normal", 1)])
async def test_synchronous_mode_is_the_writers(tmp_path, synchronous, pragma):
    store = SQLiteStore(tmp_path / "s", synchronous=synchronous)
    await store.open()
    try:
        got = await store._write_hop(lambda db: db.execute("PRAGMA synchronous").fetchone()[0])
        assert got == pragma
        assert (await store.health())["synchronous"] == synchronous
    finally:
        await store.close()


def test_unknown_synchronous_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="synchronous: expected 'full' or 'normal', got 'off'"):
        SQLiteStore(tmp_path / "s", synchronous="off")  # type: ignore[arg-type]


async def test_deleting_a_rollout_never_heard_of_writes_no_tombstone(store):
    assert await store.delete_rollout("typo") is None
    assert await store.get_tombstone("typo") is None
    await store.put_call(record("c1", [1, 2], [3], rollout_id="typo"))  # not blocked
    assert (await store.get_rollout("typo")).num_calls == 1
    # A call in flight that the store has not seen: the caller says so, the tombstone is left.
    assert await store.delete_rollout("inflight", known_elsewhere=True) == 0
    assert await store.get_tombstone("inflight") is not None
    with pytest.raises(RolloutDeleted):
        await store.put_call(record("c2", [1, 2], [3], rollout_id="inflight"))
    assert await store.delete_rollout("inflight") == 0  # a repeat: tombstoned, known


async def test_a_verified_parent_narrows_the_prompt_parent_search_to_deeper_calls(store):
    # A call names its verified parent (the linker checked its tokens are a prefix): only
    # calls at least as deep are candidates, and the choice is the one a full scan makes.
    records = chain(6, new_prompt=5, gen=2)
    linked = [records[0]] + [
        r.replace(parent_call_id=p.call_id) for p, r in zip(records, records[1:], strict=False)
    ]
    for rec in linked:
        await store.put_call(rec)
    assert [p for _, _, p in blob_sizes(store)] == [None] + [r.call_id for r in records[:-1]]
    for got, want in zip(await store.get_rollout_calls("r1"), linked, strict=True):
        assert_same(got, want)
    # A parent that is not a prefix (a record put by hand): the search falls back to all calls.
    b0, b1, _ = (r.replace(rollout_id="r2", call_id=f"b{i}") for i, r in enumerate(chain(3)))
    await store.put_call(b0)
    await store.put_call(b1.replace(parent_call_id="b0"))
    prompt = np.concatenate([b0.full_token_ids(), np.arange(900, 910, dtype=np.uint32)])
    b2 = record("b2", prompt.tolist(), [5, 6], rollout_id="r2", created_at=9.0)
    await store.put_call(b2.replace(parent_call_id="b1"))  # b1 is not a prefix of it
    assert [p for c, _, p in blob_sizes(store) if c == "b2"] == ["b0"]
    assert_same((await store.get_rollout_calls("r2"))[2], b2.replace(parent_call_id="b1"))


async def test_a_text_deleted_with_its_rollout_is_stored_again_by_a_later_call(store):
    # The SQLite writer skips the insert of texts it stored before; a delete in between
    # must not leave a later call referring to a text that is gone.
    tools = [{"type": "function", "function": {"name": "bash", "description": "x" * 600}}]
    first = record("a", [1, 2], [3], rollout_id="r1").replace(request_tools=tools)
    again = record("b", [1, 2], [3], rollout_id="r2").replace(request_tools=tools)
    same = record("c", [4], [5], rollout_id="r2").replace(request_tools=tools)
    written = [await store.put_call(first)]
    assert rows(store, "SELECT count(*) FROM json_blobs") == [(1,)]
    assert await store.delete_rollout("r1") == 1
    assert rows(store, "SELECT count(*) FROM json_blobs") == [(0,)]
    written += [await store.put_call(again), await store.put_call(same)]
    assert rows(store, "SELECT count(*) FROM json_blobs") == [(1,)]
    assert [c.request_tools for c in await store.get_rollout_calls("r2")] == [tools, tools]
    if written[0] is not None:  # SQLite counts the bytes: the text twice, not a third time
        text_bytes = len(json.dumps(tools, separators=(",", ":")))
        assert written[0] == written[1] > text_bytes > written[2]
