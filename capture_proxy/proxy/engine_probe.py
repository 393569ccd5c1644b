"""Whether the engine answers, for ``/health``: a cached probe of the engine's ``/health``.

Owns the rule that ``/health`` never hammers nor waits on the engine: at most one probe per
``interval_s`` (concurrent health requests share the probe in progress and its answer), each
bounded by ``timeout_s``. It must not decide the proxy's own health: an engine that is still
loading its model is reported, not a reason for a container to be restarted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp


class EngineProbe:
    """``GET <backend>/health`` at most once per ``interval_s``, within ``timeout_s``.

    ``status(session)`` answers ``{"ok", "status", "error", "latency_ms", "checked_at"}``:
    ``ok`` is True when the engine answered 2xx; ``status`` its HTTP status (None when it did
    not answer); ``checked_at`` Unix seconds of the probe the answer comes from."""

    def __init__(
        self,
        backend_base: str,
        *,
        interval_s: float,
        timeout_s: float,
        headers: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = f"{backend_base}/health"
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.headers = headers or {}
        self.clock = clock
        self.probes = 0  # how many probes were sent (tests, and a check on the cache)
        self._answer: dict[str, Any] | None = None
        self._answered_at = 0.0
        self._lock = asyncio.Lock()

    def _fresh(self) -> bool:
        return self._answer is not None and self.clock() - self._answered_at < self.interval_s

    async def status(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        if self._fresh():
            assert self._answer is not None
            return self._answer
        async with self._lock:  # one probe at a time; the others take its answer
            if not self._fresh():
                self._answer = await self._probe(session)
                self._answered_at = self.clock()
            assert self._answer is not None
            return self._answer

    async def _probe(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        self.probes += 1
        started = time.perf_counter()
        status: int | None = None
        error: str | None = None
        try:
            async with session.get(
                self.url,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as resp:
                status = resp.status
                await resp.read()
        except TimeoutError:
            error = f"no answer within {self.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            error = f"{type(exc).__name__}: {exc}"
        return {
            "ok": status is not None and 200 <= status < 300,
            "status": status,
            "error": error,
            "latency_ms": round((time.perf_counter() - started) * 1000, 1),
            "checked_at": time.time(),
        }
