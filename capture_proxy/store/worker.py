"""Threads that run blocking jobs for the event loop: the store's threading unit.

Owns the hand-off between the loop and a thread that owns one SQLite connection. A job is a
plain function; ``run`` queues it and awaits its result. The thread takes jobs from a
``queue.SimpleQueue`` and posts each outcome back with one ``call_soon_threadsafe``. That is
the least a hop can cost: ``run_in_executor`` on a one-thread ``ThreadPoolExecutor`` does the
same through a ``concurrent.futures.Future``, its condition variable and callbacks, which
measured 0.1-0.15 ms more per write on the 2-core machine the load benchmark runs on (the
write sits on every streamed call's path before ``[DONE]``).

With ``threads > 1`` (the PostgreSQL store: one thread per pooled connection) the threads take
jobs from the same queue: jobs start in submission order and may finish in any order.

A job whose caller was cancelled still runs (jobs are never dropped half-way; the store's
writes are idempotent) and its outcome is discarded; except a job submitted with
``run_unless_abandoned`` (a read: nothing depends on its running) whose caller was cancelled
before the job started: it is dropped unrun, so reads that timed out (``rest.deadline``) do not
keep the thread busy for no one. Whether the caller was cancelled is read from the thread
(``Future.cancelled()``: one attribute read; a cancel racing the start lets the job run, as
before).

Grouped jobs (``run_grouped``): the thread takes a grouped job together with every job of the
same group function queued behind it (up to ``MAX_GROUP``, stopping at any other job, which
runs next) and runs the group function once for all of them; each caller gets its own
outcome. The SQLite store's puts are such a group: one transaction and one commit (one fsync)
for the calls that arrived while the previous commit ran (group commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: A group function: the argument tuples of its jobs in submission order -> one
#: (result, error) per job, in the same order.
GroupFn = Callable[[list[tuple[Any, ...]]], list[tuple[Any, BaseException | None]]]
_Job = tuple[
    asyncio.AbstractEventLoop,
    "asyncio.Future[Any]",
    Callable[..., Any] | None,
    tuple[Any, ...],
    GroupFn | None,
    bool,  # dropped unrun when its caller was cancelled before it started
]
#: Most jobs one group function call takes.
MAX_GROUP = 256
_NOTHING: Any = object()


class WorkerClosed(RuntimeError):
    """A job was submitted after ``stop``."""


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled: nobody waits for the outcome
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class WorkerThread:
    """A named daemon thread running submitted jobs one at a time, in submission order (or
    ``threads`` such threads sharing one queue, named ``<name>-<i>``)."""

    def __init__(self, name: str, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads: expected at least 1, got {threads}")
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopped = False
        #: jobs dropped unrun, their callers cancelled (``run_unless_abandoned``)
        self.dropped = 0
        names = [name] if threads == 1 else [f"{name}-{i}" for i in range(threads)]
        self._threads = [threading.Thread(target=self._serve, name=n, daemon=True) for n in names]
        for thread in self._threads:
            thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread after every job queued before it; its result or
        exception. Raises WorkerClosed after ``stop``."""
        return await self._submit(fn, args, droppable=False)

    async def run_unless_abandoned(self, fn: Callable[..., T], *args: Any) -> T:
        """``run``, but the job is dropped unrun when the caller was cancelled before the
        thread took it (module docstring): for jobs nothing depends on but their outcome."""
        return await self._submit(fn, args, droppable=True)

    async def _submit(self, fn: Callable[..., T], args: tuple[Any, ...], *, droppable: bool) -> T:
        if self._stopped:
            raise WorkerClosed(f"{self.name} is stopped")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args, None, droppable))
        return await future

    async def run_grouped(self, group: GroupFn, *args: Any) -> Any:
        """Run ``args`` as one job of ``group`` (see the module docstring): taken with the
        jobs of the same group queued behind it, after every job queued before it; its own
        result or exception. Raises WorkerClosed after ``stop``."""
        if self._stopped:
            raise WorkerClosed(f"{self.name} is stopped")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._jobs.put((loop, future, None, args, group, False))
        return await future

    async def stop(self) -> None:
        """Let the queued jobs finish, then end the thread (idempotent)."""
        if not self._stopped:
            self._stopped = True
            for _ in self._threads:
                self._jobs.put(None)  # one end marker per thread
        loop = asyncio.get_running_loop()
        for thread in self._threads:
            await loop.run_in_executor(None, thread.join)

    def _serve(self) -> None:
        job: _Job | None = self._jobs.get()
        while job is not None:
            later: Any = _NOTHING
            loop, future, fn, args, group, droppable = job
            if droppable and future.cancelled():
                self.dropped += 1  # its caller gave up before it started: nobody waits
            elif group is None:
                assert fn is not None
                result, error = None, None
                try:
                    result = fn(*args)
                except BaseException as exc:  # handed to the caller, whatever it is
                    error = exc
                _post(loop, future, result, error)
            else:
                jobs = [job]
                while len(jobs) < MAX_GROUP:
                    try:
                        queued = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if queued is None or queued[4] != group:
                        later = queued  # runs next, in its turn
                        break
                    jobs.append(queued)
                self._run_group(group, jobs)
            job = self._jobs.get() if later is _NOTHING else later

    @staticmethod
    def _run_group(group: GroupFn, jobs: list[_Job]) -> None:
        try:
            outcomes = group([j[3] for j in jobs])
        except BaseException as exc:  # every job of the group fails with it
            outcomes = [(None, exc)] * len(jobs)
        for (loop, future, *_), (result, error) in zip(jobs, outcomes, strict=True):
            _post(loop, future, result, error)


def _post(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any, error: Any
) -> None:
    # A closed loop (RuntimeError): nobody is left to tell.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_settle, future, result, error)
