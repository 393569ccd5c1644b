"""The event loop's own health: how late it runs what is due (lag), and the requests it holds.

Owns two measurements for ``/metrics`` (``proxy.metrics``):
- event-loop lag: a task sleeps ``interval_s`` again and again and observes how much later
  than asked it woke (``time.perf_counter``; uvloop's timers have millisecond resolution, so
  the floor is about 1 ms). A loop busy with other callbacks wakes it late: the lag is what
  every request waiting on the loop waited too, sampled uniformly in time (Node's
  ``monitorEventLoopDelay`` does the same). The field's gateway failure at a few hundred
  rollouts is this number going to seconds.
- requests in flight: every HTTP request from the moment the app's outermost middleware
  takes it until its handler returns (a stream's last byte), captured or not.

Must not: decide anything about a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from capture_proxy.proxy.metrics import METRICS_KEY

#: How often the lag is sampled (seconds): 20 samples a second. Each sample is a wake-up of
#: the loop, which costs about 0.1 ms of CPU when the loop was idle (uvloop, 2-core VM): at
#: 100 a second that was 1% of a core, about 0.13 ms per call at one client; 20 a second still
#: gives a one-minute window 1,200 samples for its p99.
LAG_INTERVAL_S = 0.05


async def sample_lag(observe: Callable[[float], None], interval_s: float = LAG_INTERVAL_S) -> None:
    """Observe the loop's lag (seconds late, >= 0) every ``interval_s``, until cancelled."""
    clock = time.perf_counter
    while True:
        asked = clock() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, clock() - asked))


def lag_monitor(interval_s: float = LAG_INTERVAL_S) -> Callable[[web.Application], Any]:
    """A cleanup context sampling the app's loop lag into its metrics while it runs."""

    @contextlib.asynccontextmanager
    async def monitor(app: web.Application) -> AsyncIterator[None]:
        observe = app[METRICS_KEY].event_loop_lag_seconds.observe
        task = asyncio.create_task(sample_lag(observe, interval_s), name="capture-loop-lag")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return monitor


@web.middleware
async def in_flight_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Counts the request in ``capture_proxy_requests_in_flight`` while its handler runs."""
    gauge = request.app[METRICS_KEY].requests_in_flight
    gauge.inc()
    try:
        return await handler(request)
    finally:
        gauge.dec()
