"""The proxy's status endpoints: ``GET /health`` and ``GET /metrics``.

Owns what they answer; they read the app's state (``proxy.keys``) and never change it. The
composition root (``capture_proxy.app``) decides which app serves them: the read-only app
serves ``/health`` alone.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from capture_proxy import __version__
from capture_proxy.proxy.engines import ROUTES_KEY
from capture_proxy.proxy.keys import (
    ENGINE_PROBE_KEY,
    RECORDER_KEY,
    SESSION_KEY,
    SETTINGS_KEY,
    STORE_KEY,
    WORKER_KEY,
)
from capture_proxy.proxy.metrics import CONTENT_TYPE, METRICS_KEY

#: Longest wait of ``/health`` for the store's answer (seconds). The store's reads share a
#: queue with the read API's (exports of large rollouts among them), and a liveness probe must
#: not wait behind them: past this wait ``/health`` answers without the store's figures.
HEALTH_STORE_WAIT_S = 1.0
#: A store that has not answered ``/health``'s read for this long (seconds) is taken as not
#: answering (``degraded``): queued reads end within it, a hung store does not.
STORE_SILENT_S = 30.0


@dataclass
class StoreHealthReads:
    """``/health``'s reads of the store: one at a time (concurrent probes share the pending
    one) and when the store last answered one (``time.monotonic``; the start counts)."""

    answered_at: float = field(default_factory=time.monotonic)
    pending: asyncio.Future[dict[str, Any]] | None = None

    async def read(self, app: web.Application) -> dict[str, Any] | None:
        """The store's ``health()`` within ``HEALTH_STORE_WAIT_S``, else None (it goes on and
        a later probe takes its answer). Raises what the store raises, or StoreSilent once it
        has not answered for ``STORE_SILENT_S``."""
        if self.pending is None or self.pending.done():
            self.pending = asyncio.ensure_future(app[STORE_KEY].health())
        try:
            async with asyncio.timeout(HEALTH_STORE_WAIT_S):
                answer = await asyncio.shield(self.pending)
        except TimeoutError:
            silent_s = time.monotonic() - self.answered_at
            if silent_s > STORE_SILENT_S:
                raise StoreSilent(f"the store has not answered for {silent_s:.0f} s") from None
            return None
        self.answered_at = time.monotonic()
        return answer


class StoreSilent(Exception):
    """The store has not answered ``/health``'s read for ``STORE_SILENT_S``."""


STORE_HEALTH_KEY = web.AppKey("store_health_reads", StoreHealthReads)


def health_status(*, store_ok: bool, engine: dict[str, Any] | None) -> tuple[str, int]:
    """``/health``'s ``status`` and HTTP status, worst first: ``degraded`` (503) when the store
    cannot answer; ``engine_unreachable`` (503) when no engine can take calls (``engine.ok``
    false: the engine's probe failed, down, still loading its model or answering non-2xx;
    with several backends, every one of them is unhealthy); else ``ok`` (200). One dead
    engine of several is no failure: the others serve its rollouts (``engine.engines`` names
    it). ``engine`` None (the read-only app has no engine) is no failure."""
    if not store_ok:
        return "degraded", 503
    if engine is not None and not engine.get("ok"):
        return "engine_unreachable", 503
    return "ok", 200


async def health(request: web.Request) -> web.Response:
    """Proxy and store health, whether the engine answers (a cached probe; with several
    backends the pool's probes of each, ``EngineRoutes.health``; ``null`` in the read-only
    app, which has no engine), and the capture counters; ``status`` and the HTTP
    status from ``health_status`` (503 ``degraded`` when the store cannot answer or while its
    writes fail: ``store.write_error`` is the first failed write's error, cleared by the next
    write that succeeds; and while calls answered but not stored are not yet marked on their
    rollouts: ``store.unmarked_losses``). With a token set the store's filesystem path, and
    with several backends each engine's URL and error, are left out (``/health`` is open to
    anyone). In a worker of several (``serve --workers``),
    ``worker`` names it (``index``, ``count``, ``pid``) and ``capture`` counts its own calls;
    the store's figures, and ``/metrics``, are the whole proxy's. The store's answer is
    waited for at most ``HEALTH_STORE_WAIT_S``: a store whose reads are queued (``read_wait``)
    is no failure until it has not answered for ``STORE_SILENT_S`` (``degraded``); its writes
    tell meanwhile (``write_error``)."""
    settings = request.app[SETTINGS_KEY]
    recorder = request.app[RECORDER_KEY]
    ok = True
    store: dict[str, Any]
    try:
        answer = await request.app[STORE_HEALTH_KEY].read(request.app)
    except Exception as exc:
        store, ok = {"error": str(exc)}, False
    else:
        wait = f"no answer within {HEALTH_STORE_WAIT_S:g} s (its reads are queued)"
        store = answer if answer is not None else {"read_wait": wait}
    if settings.captures_token is not None or settings.proxy_token is not None:
        store = {k: v for k, v in store.items() if k != "path"}
        if not ok:
            store = {"error": "store unavailable (details in the proxy's log)"}
    if recorder.write_error is not None:  # the store answers reads but refuses writes
        store, ok = {**store, "write_error": recorder.write_error}, False
    if recorder.losses.pending:  # store_failure = answer: losses known only in memory
        losses = recorder.losses.health()
        if settings.captures_token is not None or settings.proxy_token is not None:
            losses.pop("rollout_ids")  # the read API (behind its token) names them
        store, ok = {**store, "unmarked_losses": losses}, False
    probe = request.app.get(ENGINE_PROBE_KEY)  # none in the read-only app: no engine
    routes = request.app.get(ROUTES_KEY)
    engine: dict[str, Any] | None
    if routes is not None and routes.many:  # the pool's probes, every engine's state
        engine = routes.health()
        if settings.captures_token is not None or settings.proxy_token is not None:
            # where the engines are and how they fail: behind the token (/metrics, the log)
            hidden = ("url", "error")
            engine["engines"] = [
                {k: v for k, v in e.items() if k not in hidden} for e in engine["engines"]
            ]
    else:
        engine = None if probe is None else await probe.status(request.app[SESSION_KEY])
    status, http_status = health_status(store_ok=ok, engine=engine)
    body: dict[str, Any] = {
        "status": status,
        "version": __version__,
        "store": store,
        "engine": engine,
        "capture": {
            "persisted": recorder.stats.persisted,
            "store_failures": recorder.stats.store_failures,
            "answered_unstored": recorder.stats.answered_unstored,
            "late_calls_refused": recorder.stats.late_calls_refused,
            "incomplete_calls": recorder.stats.incomplete,
            "failed_calls": recorder.stats.failed,
        },
    }
    worker = request.app.get(WORKER_KEY)
    if worker is not None:  # ``capture`` counts this worker's calls; the rest is whole
        body["worker"] = {"index": worker.index, "count": worker.count, "pid": os.getpid()}
    return web.json_response(body, status=http_status)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the app's metrics in the Prometheus text format (behind
    ``captures_token`` when it is set, like the read API)."""
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
