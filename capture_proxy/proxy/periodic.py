"""A step run every few seconds while the app runs (the tombstone sweeper, the engines' health
probes, the marks of lost calls).

Owns the task's life: started on entering, cancelled and awaited on leaving, so nothing of it
outlives the app. Must not: decide what the step does or swallow its errors (a step logs its
own; one that raises ends the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable


@contextlib.asynccontextmanager
async def every(
    interval_s: float,
    step: Callable[[], Awaitable[object]],
    *,
    name: str,
    first_now: bool = True,
) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``step`` every ``interval_s`` seconds while inside (``first_now``: the first at
    once, else after one interval); yields the task, named ``name`` (for ``asyncio`` and
    py-spy)."""

    async def loop() -> None:
        if not first_now:
            await asyncio.sleep(interval_s)
        while True:
            await step()
            await asyncio.sleep(interval_s)

    task = asyncio.create_task(loop(), name=name)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
