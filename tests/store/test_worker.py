"""The store's worker thread: jobs in order on one named thread, outcomes back to the loop,
cancelled callers, stopping."""

from __future__ import annotations

import asyncio
import threading

import pytest

from capture_proxy.store.worker import WorkerClosed, WorkerThread


async def test_jobs_run_in_order_on_the_worker_and_hand_back_results_and_errors():
    worker = WorkerThread("test-worker")
    seen: list[tuple[int, str]] = []

    def job(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        if i == 3:
            raise KeyError("three")
        return i * 10

    try:
        results = await asyncio.gather(
            *(worker.run(job, i) for i in range(6)), return_exceptions=True
        )
    finally:
        await worker.stop()
    assert seen == [(i, "test-worker") for i in range(6)]
    assert results[:3] == [0, 10, 20] and results[4:] == [40, 50]
    assert isinstance(results[3], KeyError)


async def test_a_cancelled_caller_does_not_stop_its_job_and_nothing_leaks():
    worker = WorkerThread("test-worker")
    gate, done = threading.Event(), threading.Event()
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))

    def slow() -> str:
        assert gate.wait(timeout=10)
        done.set()
        return "finished"

    task = asyncio.ensure_future(worker.run(slow))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    assert await worker.run(lambda: "after") == "after"  # runs after the cancelled job
    assert done.is_set()
    await worker.stop()
    assert errors == []


async def test_stop_lets_queued_jobs_finish_then_refuses_more():
    worker = WorkerThread("test-worker")
    gate = threading.Event()
    first = asyncio.ensure_future(worker.run(lambda: gate.wait(timeout=10)))
    second = asyncio.ensure_future(worker.run(lambda: "queued"))
    await asyncio.sleep(0)
    stopping = asyncio.ensure_future(worker.stop())
    await asyncio.sleep(0)
    gate.set()
    assert await first is True
    assert await second == "queued"
    await stopping
    await worker.stop()  # idempotent
    assert not any(t.is_alive() for t in worker._threads)
    with pytest.raises(WorkerClosed, match="test-worker is stopped"):
        await worker.run(lambda: None)


async def test_an_abandoned_job_not_yet_started_is_dropped_unrun():
    """``run_unless_abandoned``: a caller cancelled while its job waits in the queue leaves no
    work behind; a job already running ends, its outcome discarded; later jobs run."""
    worker = WorkerThread("test-worker")
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def blocking() -> str:
        started.set()
        assert gate.wait(timeout=10)
        ran.append("blocking")
        return "blocking"

    def queued() -> str:
        ran.append("queued")
        return "queued"

    try:
        first = asyncio.ensure_future(worker.run_unless_abandoned(blocking))
        second = asyncio.ensure_future(worker.run_unless_abandoned(queued))
        assert await asyncio.to_thread(started.wait, 10)
        for task in (first, second):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        gate.set()
        assert await worker.run_unless_abandoned(lambda: "after") == "after"
    finally:
        gate.set()
        await worker.stop()
    assert ran == ["blocking"]  # started before its caller left: it ran
    assert worker.dropped == 1
