"""Each engine's weight version and pause, as the proxy observes them off the calls' path.

Owns ``WeightWatcher`` (one per engine base URL) and ``WeightWatchers`` (the app's set of them,
started and stopped with the app):

- the version: a background task reads ``GET /weight_info`` (vLLM 0.32, ``VLLM_SERVER_DEV_MODE=1``:
  ``{"weight_version": str}``), or where that is 404 SGLang's ``GET /get_model_info`` (its
  ``weight_version``), every ``weight_version_poll_s``; a call reads the cached
  ``version`` and ``epoch`` (bumped on each change), never the engine, so observing costs no
  engine round trip per call. An engine without the endpoint (404) is asked again every
  ``NO_ENDPOINT_RETRY_S``.
- the pause: after an engine aborted a call (``finish_reason: "abort"``), ``wait_serving``
  waits until ``GET /is_paused`` says ``false``, with one poll loop per engine however many
  calls wait (``PAUSE_POLL_S``), bounded by the caller. An engine without ``/is_paused``
  (404: vLLM without dev mode, SGLang) cannot say: the caller then goes on only if the
  version changed (``core.flow.resume``).
- ``still_paused``: whether a read that timed out may go on waiting (``keep`` and ``wait``
  pauses hold requests in the engine's queue; no proxy timeout may cut them for it).

Must not: decide what a call does about an abort (``core.flow``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp
from aiohttp import web

from capture_proxy.proxy.upstream import CLIENT_ERRORS

log = logging.getLogger("capture_proxy")

#: where an engine says its weight version (``weight_version`` in the answer), in the order
#: asked: vLLM 0.32 (dev mode), SGLang
VERSION_PATHS = ("/weight_info", "/get_model_info")
#: seconds between ``/is_paused`` readings while calls wait for an engine to serve again
PAUSE_POLL_S = 0.25
#: seconds before an engine that answered 404 to ``/weight_info`` is asked again
NO_ENDPOINT_RETRY_S = 30.0
#: longest wait for one ``/weight_info`` or ``/is_paused`` answer
READ_TIMEOUT_S = 5.0
#: longest wait at start-up for the engines' first version reading
FIRST_READ_S = 2.0


class WeightWatcher:
    """One engine's weight version (``version``: as last read, None: unknown; ``epoch``: bumped
    on every change) and pause."""

    def __init__(self, session: aiohttp.ClientSession, backend: str, poll_s: float | None) -> None:
        self.session = session
        self.backend = backend
        self.poll_s = poll_s
        self.version: str | None = None
        self.epoch = 0
        self.has_endpoint: bool | None = None
        self._version_path: str | None = None  # the VERSION_PATHS entry the engine answers
        self._serving: asyncio.Task[bool | None] | None = None

    async def _get(self, path: str) -> dict[str, Any] | None:
        """The engine's JSON answer to ``GET path``; None on a 404. Raises CLIENT_ERRORS,
        ValueError."""
        timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
        async with self.session.get(self.backend + path, timeout=timeout) as resp:
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise ValueError(f"GET {path}: HTTP {resp.status}")
            data = await resp.json(content_type=None)
        if not isinstance(data, dict):
            raise ValueError(f"GET {path}: not a JSON object")
        return data

    async def read_version(self) -> str | None:
        """Read the version now (``VERSION_PATHS``: the first the engine answers, remembered);
        the version (the last known one when it cannot be read)."""
        try:
            data = None
            for path in VERSION_PATHS if self._version_path is None else (self._version_path,):
                data = await self._get(path)
                if data is not None:
                    self._version_path = path
                    break
        except (*CLIENT_ERRORS, ValueError):
            return self.version
        self.has_endpoint = data is not None
        version = data.get("weight_version") if data is not None else None
        if isinstance(version, str) and version != self.version:
            if self.version is not None:
                log.info("engine %s: weight version %s -> %s", self.backend, self.version, version)
            self.version = version
            self.epoch += 1
        return self.version

    async def run(self, first_read: bool = True) -> None:
        """Read the version every ``poll_s`` until cancelled."""
        assert self.poll_s is not None
        if not first_read:
            await asyncio.sleep(self._pause())
        while True:
            await self.read_version()
            await asyncio.sleep(self._pause())

    def _pause(self) -> float:
        assert self.poll_s is not None
        return NO_ENDPOINT_RETRY_S if self.has_endpoint is False else self.poll_s

    async def is_paused(self) -> bool | None:
        """``GET /is_paused``; None when the engine cannot say (404). Raises CLIENT_ERRORS,
        ValueError."""
        data = await self._get("/is_paused")
        if data is None:
            return None
        paused = data.get("is_paused")
        if not isinstance(paused, bool):
            raise ValueError("GET /is_paused: no boolean 'is_paused'")
        return paused

    async def still_paused(self) -> bool:
        """True when the engine says it is paused (a stalled read may go on waiting)."""
        try:
            return await self.is_paused() is True
        except (*CLIENT_ERRORS, ValueError):
            return False

    async def _until_serving(self) -> bool | None:
        """Poll ``/is_paused`` until false: whether it was seen paused (None: it cannot say).
        An engine that cannot be reached is asked again (it may be restarting)."""
        seen_paused = False
        while True:
            try:
                paused = await self.is_paused()
            except (*CLIENT_ERRORS, ValueError):
                paused = True
            if paused is None:
                return True if seen_paused else None
            if not paused:
                return seen_paused
            seen_paused = True
            await asyncio.sleep(PAUSE_POLL_S)

    async def wait_serving(self) -> bool | None:
        """Wait until the engine serves (one poll loop shared by every waiting call); whether
        it was seen paused. The caller bounds the wait (cancelling it leaves the loop to the
        others)."""
        if self._serving is None or self._serving.done():
            self._serving = asyncio.ensure_future(self._until_serving())
        return await asyncio.shield(self._serving)

    async def close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._serving


class WeightWatchers:
    """The app's watchers, one per engine base URL, their poll tasks started by ``start``."""

    def __init__(
        self, session: aiohttp.ClientSession, backends: list[str], poll_s: float | None
    ) -> None:
        self.by_backend = {b: WeightWatcher(session, b, poll_s) for b in backends}
        self._tasks: list[asyncio.Task[None]] = []

    def for_backend(self, backend: str) -> WeightWatcher | None:
        return self.by_backend.get(backend)

    async def start(self) -> None:
        """Read every engine's version once (bounded: ``FIRST_READ_S``), so the first calls
        have one, then keep reading in the background."""
        polled = [w for w in self.by_backend.values() if w.poll_s is not None]
        if polled:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_READ_S):
                    await asyncio.gather(*(w.read_version() for w in polled))
        for watcher in polled:
            self._tasks.append(asyncio.ensure_future(watcher.run(first_read=False)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for watcher in self.by_backend.values():
            await watcher.close()


#: the app's watchers (set with the upstream session, closed with it)
WEIGHT_WATCHERS_KEY = web.AppKey("weight_watchers", WeightWatchers)
