"""The graceful stop: what it waits for, for how long, and what it says.

On SIGINT or SIGTERM the server stops accepting, answers what comes on the connections still
open with a 503 (``proxy.server``), and lets the captured calls in flight finish for at most
``shutdown_timeout_s``; then it cancels the handlers of the calls still running,
as when their clients leave: a call cut while it waits on or streams from the engine is
stored incomplete (``proxy.executor``: the record is written shielded, then the cancellation
goes on). aiohttp's own ``shutdown_timeout`` (the same setting, on the runner; aiohttp 3.14
waits for a handler up to twice it before cancelling) runs after the app's shutdown, once the
store is closing, so a call on a hung engine was cut with no store to record it; the cut here
happens first, while the store is open. Requests that are not captured calls (the read API's
downloads, forwarded paths) are left to aiohttp's bound.

Owns ``CallsInFlight`` (the captured calls whose handler runs: call id, rollout, task) and
the stop's two log lines: when it begins, the calls it waits for; at the bound, the calls it
cuts. Must not: decide a call's record (the flow does), or end the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from aiohttp import web

log = logging.getLogger("capture_proxy")

#: Calls named in one log line at most (the rest are counted).
NAMED_CALLS = 20
#: Longest wait for the cut calls' handlers to write their records and end.
CUT_WAIT_S = 10.0


@dataclass
class _Call:
    rollout_id: str
    started: float
    task: asyncio.Task[object] | None


@dataclass
class CallsInFlight:
    """The captured calls whose handler runs, by call id (``track``)."""

    clock: Callable[[], float] = time.monotonic
    calls: dict[str, _Call] = field(default_factory=dict)
    _idle: asyncio.Event | None = None

    @contextlib.contextmanager
    def track(self, call_id: str, rollout_id: str) -> Iterator[None]:
        """While the handler of ``call_id`` runs (its task is the current one)."""
        self.calls[call_id] = _Call(rollout_id, self.clock(), asyncio.current_task())
        try:
            yield
        finally:
            self.calls.pop(call_id, None)
            if not self.calls and self._idle is not None:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is in flight, at most ``timeout_s``; True when none is."""
        if not self.calls:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def describe(self) -> str:
        """``call-1 (rollout r1, 12.5 s), ...``, oldest first, at most ``NAMED_CALLS``."""
        now = self.clock()
        ordered = sorted(self.calls.items(), key=lambda item: (item[1].started, item[0]))
        named = [
            f"{call_id} (rollout {call.rollout_id}, {now - call.started:.1f} s)"
            for call_id, call in ordered[:NAMED_CALLS]
        ]
        if len(ordered) > NAMED_CALLS:
            named.append(f"and {len(ordered) - NAMED_CALLS} more")
        return ", ".join(named)

    async def cut(self) -> None:
        """Cancel the handlers of the calls in flight and wait (at most ``CUT_WAIT_S``) for
        them to write their records and end."""
        tasks = [c.task for c in self.calls.values() if c.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CUT_WAIT_S)


CALLS_IN_FLIGHT_KEY = web.AppKey("calls_in_flight", CallsInFlight)


def graceful_stop(app: web.Application, bound_s: float) -> None:
    """The stop of ``app`` (``on_shutdown``: the listening socket is closed, new requests are
    answered 503 and the connections stay open until this returns, the calls in flight go on):
    log the calls it waits for and the bound, wait for them at most
    ``bound_s``, then log and cut the calls still in flight (stored incomplete)."""
    calls = app[CALLS_IN_FLIGHT_KEY]

    async def on_shutdown(app: web.Application) -> None:
        if not calls.calls:
            log.info("stopping: no calls in flight")
            return
        log.warning(
            "stopping: finishing %d calls in flight, at most %g s (shutdown_timeout_s): %s",
            len(calls.calls), bound_s, calls.describe(),
        )  # fmt: skip
        if await calls.wait_idle(bound_s):
            log.info("stopping: the calls in flight finished")
            return
        log.warning(
            "stopping: %d calls still in flight after %g s (shutdown_timeout_s): cut, stored "
            "incomplete: %s",
            len(calls.calls), bound_s, calls.describe(),
        )  # fmt: skip
        await calls.cut()

    app.on_shutdown.append(on_shutdown)
