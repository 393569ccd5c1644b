"""Group commit: the SQLite writer takes the puts queued while it was busy together and commits
them in one transaction (``sqlite_puts.SQLitePuts.group``), each under its own savepoint; the
worker thread's grouping (``WorkerThread.run_grouped``) keeps submission order."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from typing import Any

import pytest

from capture_proxy.store.base import ConflictingRecord, RolloutDeleted, StoreError
from capture_proxy.store.sqlite import SQLiteStore
from capture_proxy.store.worker import WorkerThread
from tests.core.test_codec_v2 import assert_same, chain
from tests.factories import record


@pytest.fixture
async def sqlite_store(tmp_path):
    s = SQLiteStore(tmp_path / "store")
    await s.open()
    yield s
    await s.close()


def _hold_writer(store: SQLiteStore) -> threading.Event:
    """Block the writer thread until the returned event is set (puts queue up meanwhile)."""
    gate = threading.Event()
    assert store._writer is not None
    asyncio.ensure_future(store._writer.run(lambda: gate.wait(timeout=10)))
    return gate


async def _queued(worker: WorkerThread | None, jobs: int) -> None:
    """Until ``jobs`` jobs wait in the worker's queue (bounded: 5 s)."""
    assert worker is not None
    async with asyncio.timeout(5):
        while worker._jobs.qsize() < jobs:
            await asyncio.sleep(0)


def _count_groups(store: SQLiteStore) -> list[int]:
    sizes: list[int] = []
    group = store._puts.group

    def counted(db: Any, items: list[tuple[Any, ...]]) -> Any:
        sizes.append(len(items))
        return group(db, items)

    store._puts.group = counted  # type: ignore[method-assign]
    return sizes


async def test_puts_queued_behind_a_busy_writer_share_one_commit(sqlite_store):
    sizes = _count_groups(sqlite_store)
    records = [record(f"c{i}", [1, 2, i], [3], rollout_id=f"r{i}") for i in range(12)]
    gate = _hold_writer(sqlite_store)
    puts = [asyncio.ensure_future(sqlite_store.put_call(r)) for r in records]
    await _queued(sqlite_store._writer, 12)
    assert not any(p.done() for p in puts)  # none answered before its commit
    gate.set()
    assert all(w > 0 for w in await asyncio.gather(*puts))
    assert sizes == [12]
    for r in records:
        assert_same(await sqlite_store.get_call(r.call_id), r)


async def test_a_refused_put_is_rolled_back_alone(sqlite_store):
    await sqlite_store.put_call(record("old", [1], [2], rollout_id="gone"))
    await sqlite_store.delete_rollout("gone")
    await sqlite_store.put_call(record("dup", [1, 2], [3]))
    sizes = _count_groups(sqlite_store)
    gate = _hold_writer(sqlite_store)
    first, second = chain(2)
    puts = [
        sqlite_store.put_call(first),
        sqlite_store.put_call(record("late", [1], [2], rollout_id="gone")),
        sqlite_store.put_call(record("dup", [1, 2], [9])),  # the same id, other content
        sqlite_store.put_call(second),
    ]
    tasks = [asyncio.ensure_future(p) for p in puts]
    await _queued(sqlite_store._writer, 4)
    gate.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert sizes == [4]
    assert isinstance(outcomes[1], RolloutDeleted)
    assert isinstance(outcomes[2], ConflictingRecord)
    assert isinstance(outcomes[0], int) and isinstance(outcomes[3], int)
    calls = await sqlite_store.get_rollout_calls(first.rollout_id)
    assert {c.call_id for c in calls} == {"dup", first.call_id, second.call_id}
    assert (await sqlite_store.get_call("dup")).generation_token_ids.tolist() == [3]
    # the child's prompt is stored as a delta on its parent, committed in the same group
    assert_same(await sqlite_store.get_call(second.call_id), second)


class _FailingCommit:
    """A connection whose ``COMMIT`` fails (a disk that refuses the write)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            raise sqlite3.OperationalError("disk I/O error")
        return self.db.execute(sql, *args)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction


async def test_a_failed_commit_fails_every_put_of_the_group_and_stores_none(sqlite_store):
    first, second = chain(2)
    await sqlite_store.put_call(first)
    writer_db = sqlite_store._wdb
    sqlite_store._wdb = _FailingCommit(writer_db)  # type: ignore[assignment]
    gate = _hold_writer(sqlite_store)
    tasks = [
        asyncio.ensure_future(sqlite_store.put_call(r))
        for r in (second, record("x", [5], [6], rollout_id="r2"))
    ]
    await _queued(sqlite_store._writer, 2)
    gate.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    sqlite_store._wdb = writer_db
    assert all(isinstance(o, StoreError) and "disk I/O error" in str(o) for o in outcomes)
    assert await sqlite_store.get_call(second.call_id) is None
    assert await sqlite_store.get_call("x") is None
    assert sqlite_store._puts.prompt_parents._rollouts == {}  # nothing kept of the rollback
    assert sqlite_store._puts.rollouts == {}
    # the writer goes on: the same puts succeed now, the child again a delta on its parent
    await sqlite_store.put_call(second)
    assert_same(await sqlite_store.get_call(second.call_id), second)


async def test_grouped_jobs_run_together_and_other_jobs_keep_their_turn():
    worker = WorkerThread("test-group")
    gate = threading.Event()
    log: list[Any] = []

    def group(items: list[tuple[Any, ...]]) -> list[tuple[Any, BaseException | None]]:
        log.append([i for (i,) in items])
        return [(i * 10, None) if i != 2 else (None, ValueError("two")) for (i,) in items]

    def single(tag: str) -> str:
        log.append(tag)
        return tag

    try:
        held = asyncio.ensure_future(worker.run(lambda: gate.wait(timeout=10)))
        async with asyncio.timeout(5):  # the worker holds the first job
            while worker._jobs.qsize():
                await asyncio.sleep(0)
        jobs = [
            worker.run_grouped(group, 1),
            worker.run_grouped(group, 2),
            worker.run_grouped(group, 3),
            worker.run(single, "between"),
            worker.run_grouped(group, 4),
        ]
        tasks = [asyncio.ensure_future(j) for j in jobs]
        await _queued(worker, 5)
        gate.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        await held
    finally:
        await worker.stop()
    assert log == [[1, 2, 3], "between", [4]]
    assert outcomes[0] == 10 and outcomes[2] == 30 and outcomes[4] == 40
    assert isinstance(outcomes[1], ValueError) and outcomes[3] == "between"
