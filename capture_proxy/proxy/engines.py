"""Many engines: the routing key on every engine request, and the choice of engine per rollout.

Owns, around the pure choice (``core.engine_pool``):
- ``EngineRoutes``: the pool of ``--backend`` URLs, its clock (whole seconds of
  ``time.monotonic``, one clock for every process of the machine), its health probes (a
  background task ``GET <backend>/health`` every ``backend_health_interval_s``, each within
  ``backend_health_timeout_s``: a non-2xx answer or a refused connection marks the engine
  unhealthy at once, no answer only the ``SLOW_PROBES``-th in a row without a call answered
  in between, as a loaded engine, or a proxy whose own loop lags, answers late), the requests
  in flight per backend, and the Prometheus gauges
  ``capture_proxy_backend_in_flight{backend}`` and ``capture_proxy_backend_healthy{backend}``
  (read at scrape time, nothing on the hot path; in a worker of several, copied into the
  workers' shared metric files every second: ``publish_metrics``);
- ``ROUTE``: the engine route of the request being served (routing key, chosen backend), a
  context variable set once per request by ``dispatch``, so every engine request made on its
  behalf (the call, tokens-in, ``/tokenize``, ``/detokenize``, ``/v1/models``, whatever module
  makes it) carries the key and goes to the same engine;
- ``routing_key_middleware``: the upstream session's client middleware that adds the routing
  key header (one dict entry) to each request made under a route;
- the pins shared by the workers of ``serve --workers``: one file in the supervisor's private
  runtime directory (``create_pin_board``), mapped by each worker (``map_pin_board``).
Must not: decide a call's capture (``core.flow``), or probe the engine on a call's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import time
from collections.abc import Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import ClientHandlerType, ClientRequest, ClientResponse, web
from prometheus_client import Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from capture_proxy.core.engine_pool import (
    Backend,
    BackendPool,
    PinBoard,
    pin_board_words,
    routing_key,
)
from capture_proxy.proxy.periodic import every

log = logging.getLogger("capture_proxy")

#: Probes in a row that get no answer within ``backend_health_timeout_s`` before an engine is
#: taken as unhealthy (a hung engine: about ``SLOW_PROBES`` x (interval + timeout)). One late
#: answer is no verdict: under load (hundreds of streams on the engine, or the proxy's own
#: loop behind) probes of live engines time out now and then, and each flap would move the
#: rollouts of that engine off their prefix cache.
SLOW_PROBES = 3


@dataclass(frozen=True)
class Probe:
    """One probe's verdict: ``healthy``; ``reachable`` False when no connection could be made;
    ``slow`` when no answer came in time; ``error`` why not healthy (None when healthy)."""

    healthy: bool
    reachable: bool = True
    slow: bool = False
    error: str | None = None


@dataclass(frozen=True)
class Route:
    """The engine route of one proxied request: ``key`` the routing key (None: none sent),
    ``backend`` the chosen engine's base URL."""

    key: str | None
    backend: str


#: The route of the request being served (None outside a request: probes, start-up).
ROUTE: ContextVar[Route | None] = ContextVar("capture_proxy_engine_route", default=None)


def current_backend(default: str) -> str:
    """The backend chosen for the request being served, else ``default``."""
    route = ROUTE.get()
    return route.backend if route is not None else default


def routing_key_middleware(header: str) -> Any:
    """A client middleware adding ``header: <routing key>`` to every upstream request made
    under a ``ROUTE`` with a key (unless the request names the header itself)."""

    async def add_key(request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        route = ROUTE.get()
        if route is not None and route.key is not None and header not in request.headers:
            request.headers[header] = route.key
        return await handler(request)

    return add_key


@dataclass
class Lease:
    """One request's hold on its engine (``EngineRoutes.enter``); ``close`` exactly once."""

    pool: BackendPool
    backend_state: Backend
    route: Route
    token: Token[Route | None]
    #: the key the pool chose by (the routing key, or the rollout id when none is sent)
    pool_key: str | None = None

    @property
    def backend(self) -> str:
        return self.route.backend

    def close(self) -> None:
        ROUTE.reset(self.token)
        self.pool.release(self.backend_state, self.pool_key, _now())


class EngineRoutes:
    """The engines of one proxy app (``--backend`` repeated): choice per rollout, health,
    in-flight counts. ``urls``: base URLs without credentials or trailing slash."""

    def __init__(
        self,
        urls: list[str],
        *,
        key_kind: str,
        balance_factor: float,
        health_interval_s: float,
        health_timeout_s: float,
        health_headers: dict[str, str] | None = None,
        pin_idle_s: int = 600,
        pins: PinBoard | None = None,
    ) -> None:
        self.pool = BackendPool(
            urls, balance_factor=balance_factor, pin_idle_s=pin_idle_s, pins=pins
        )
        self.key_kind = key_kind
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.health_headers = health_headers or {}
        #: how many probe rounds completed (tests wait on a round by it)
        self.probe_rounds = 0
        #: why each backend was last found unhealthy (None: it was not), for ``/health``
        self.last_error: dict[str, str | None] = {url: None for url in urls}
        #: per backend, its probes in a row that got no answer in time (``SLOW_PROBES``)
        self.slow_probes: dict[str, int] = {url: 0 for url in urls}
        #: the backends that answered a call's request since the last probe round
        self.answered: set[str] = set()
        self._round_done = asyncio.Event()

    @property
    def many(self) -> bool:
        return len(self.pool.backends) > 1

    def enter(self, rollout_id: str | None) -> Lease:
        """Choose the engine of one request (of ``rollout_id``; None: outside any rollout, no
        key) and set ``ROUTE`` until the lease's ``close``; its backend counts it in flight."""
        key = routing_key(rollout_id, self.key_kind) if rollout_id is not None else None
        pool_key = key if key is not None else rollout_id
        backend = self.pool.acquire(pool_key, _now())
        route = Route(key, backend.url)
        return Lease(self.pool, backend, route, ROUTE.set(route), pool_key)

    # --- health --------------------------------------------------------------------------

    async def probe(self, session: aiohttp.ClientSession, backend: Backend) -> Probe:
        """One ``GET <backend>/health`` within ``health_timeout_s``: 2xx is healthy; else why
        not (``no answer within 1 s``, ``HTTP 503``, the connection error)."""
        try:
            async with session.get(
                backend.url + "/health",
                headers=self.health_headers,
                timeout=aiohttp.ClientTimeout(total=self.health_timeout_s),
            ) as resp:
                await resp.read()
                if not 200 <= resp.status < 300:
                    return Probe(False, error=f"HTTP {resp.status}")
        except TimeoutError:
            return Probe(False, slow=True, error=f"no answer within {self.health_timeout_s:g} s")
        except aiohttp.ClientConnectionError as exc:  # refused, reset, disconnected
            return Probe(False, reachable=False, error=f"{type(exc).__name__}: {exc}")
        except aiohttp.ClientError as exc:
            return Probe(False, error=f"{type(exc).__name__}: {exc}")
        return Probe(True)

    async def probe_all(self, session: aiohttp.ClientSession) -> None:
        """One round: every backend probed at once; a change of health is logged. A probe
        without an answer in time counts only as the ``SLOW_PROBES``-th in a row, and not at
        all for an engine that answered a call's request meanwhile (``mark_answered``): busy,
        not hung."""
        backends = self.pool.backends
        verdicts = await asyncio.gather(*(self.probe(session, b) for b in backends))
        answered, self.answered = self.answered, set()
        self.pool.renew(_now())  # the pins of long calls stay live
        for backend, probe in zip(backends, verdicts, strict=True):
            url = backend.url
            late = probe.slow and url not in answered
            self.slow_probes[url] = self.slow_probes[url] + 1 if late else 0
            if (
                probe.slow
                and backend.up
                and (url in answered or self.slow_probes[url] < SLOW_PROBES)
            ):
                continue  # late, not (yet) a verdict: it keeps its state
            self.last_error[url] = probe.error
            first = backend.healthy is None
            if self.pool.mark(url, probe.healthy, reachable=probe.reachable):
                level = logging.INFO if first and probe.healthy else logging.WARNING
                state = "healthy" if probe.healthy else f"UNHEALTHY ({probe.error})"
                log.log(level, "engine %s is %s", url, state)
        self.probe_rounds += 1
        self._round_done.set()
        self._round_done = asyncio.Event()

    async def next_round(self, timeout_s: float) -> None:
        """Wait for the next probe round to complete (at most ``timeout_s``; TimeoutError)."""
        async with asyncio.timeout(timeout_s):
            await self._round_done.wait()

    def mark_answered(self, url: str) -> None:
        """An engine request to ``url`` got its answer's head: the engine is alive, and a late
        probe of it (``probe_all``) is no evidence against it. One set insertion per call."""
        self.answered.add(url)

    def mark_failed(self, url: str) -> None:
        """An engine request to ``url`` could not connect: take it as unhealthy until the
        next probe says otherwise (a dead engine's rollouts move at their next call)."""
        if self.many:
            self.last_error[url] = "connection failed"
            if self.pool.mark(url, False, reachable=False):
                log.warning("engine %s is UNHEALTHY (connection failed)", url)

    def health(self) -> dict[str, Any]:
        """``/health``'s ``engine`` with several backends: ``ok`` while at least one engine
        can take calls (healthy, or not probed yet), how many can (``up``) of ``count``, and
        each engine's state (``engines``: ``url`` without credential, ``healthy``: True,
        False or None before its first probe, ``error``: why it is not, ``in_flight``: its
        requests in flight, every worker's)."""
        loads = self.pool.pins.loads()
        engines = [
            {
                "url": b.url,
                "healthy": b.healthy,
                "error": None if b.up else self.last_error.get(b.url),
                "in_flight": load,
            }
            for b, load in zip(self.pool.backends, loads, strict=True)
        ]
        up = sum(1 for b in self.pool.backends if b.up)
        return {"ok": up > 0, "up": up, "count": len(engines), "engines": engines}

    def health_task(
        self, session: aiohttp.ClientSession
    ) -> contextlib.AbstractAsyncContextManager[object]:
        """The probe loop while the app runs (only with more than one backend)."""

        if not self.many:
            return contextlib.nullcontext()
        return every(
            self.health_interval_s, lambda: self.probe_all(session), name="capture-engine-health"
        )

    # --- metrics -------------------------------------------------------------------------

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(_PoolCollector(self.pool))

    def metrics(
        self, registry: CollectorRegistry, *, shared: bool
    ) -> contextlib.AbstractAsyncContextManager[object]:
        """The pool's gauges while the app runs: read at scrape time (one process), or
        ``shared`` (a worker of several) published to the workers' files every second."""
        if shared:
            return self.publish_metrics(registry)
        self.register_metrics(registry)
        return contextlib.nullcontext()

    def publish_metrics(
        self, registry: CollectorRegistry, every_s: float = 1.0
    ) -> contextlib.AbstractAsyncContextManager[object]:
        """In a worker of several (``serve --workers``): the pool's gauges as
        prometheus_client metrics, which its multiprocess files sum over the workers
        (``in_flight``, ``chosen``, ``key_moves``; ``healthy``: the least any worker sees),
        set from the pool every ``every_s`` while the context runs."""
        p = "capture_proxy_backend_"
        label = ["backend"]
        gauges = {
            "in_flight": Gauge(p + "in_flight", _HELP["in_flight"], label, registry=registry,
                               multiprocess_mode="livesum"),
            "healthy": Gauge(p + "healthy", _HELP["healthy"], label, registry=registry,
                             multiprocess_mode="livemin"),
            "chosen": Gauge(p + "chosen", _HELP["chosen"], label, registry=registry,
                            multiprocess_mode="sum"),
        }  # fmt: skip
        moves = Gauge(p + "key_moves", _HELP["key_moves"], registry=registry,
                      multiprocess_mode="sum")  # fmt: skip

        def publish() -> None:
            for b in self.pool.backends:
                gauges["in_flight"].labels(b.url).set(b.in_flight)
                gauges["healthy"].labels(b.url).set(0 if b.healthy is False else 1)
                gauges["chosen"].labels(b.url).set(b.chosen)
            moves.set(self.pool.moves)

        async def step() -> None:
            publish()

        return every(every_s, step, name="capture-engine-metrics")


_HELP = {
    "in_flight": "Proxied requests in flight per engine backend",
    "healthy": "1: the backend's last health probe answered 2xx (or none yet); 0: it did not",
    "chosen": "Requests routed to each engine backend since start",
    "key_moves": "Times a rollout's request went to another engine than its previous one",
}


def _now() -> int:
    """The pins' clock: whole seconds of ``CLOCK_MONOTONIC``, which every process of the
    machine shares (the workers compare each other's pins' last use)."""
    return int(time.monotonic())


def create_pin_board(path: Path, engines: int, workers: int) -> None:
    """The supervisor's part: the pins file of ``engines`` backends and ``workers`` workers,
    no pin and every count 0 (``core.engine_pool.PinBoard``)."""
    with open(path, "wb") as f:
        f.truncate(4 * pin_board_words(engines, workers))


def map_pin_board(path: Path, *, engines: int, workers: int, index: int) -> PinBoard:
    """Worker ``index``'s view of the pins file (``create_pin_board``), mapped shared for the
    life of the process, its descriptor kept open for the placement lock (``flock``). Raises
    OSError when the file is missing, ValueError when its size does not fit ``engines`` and
    ``workers``."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != 4 * pin_board_words(engines, workers):
            raise ValueError(f"{path} is not a pin board of {engines} engines, {workers} workers")
        mapped = mmap.mmap(fd, 4 * pin_board_words(engines, workers))
    except BaseException:
        os.close(fd)
        raise

    @contextlib.contextmanager
    def locked() -> Iterator[None]:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for one placement: microseconds
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    return PinBoard(memoryview(mapped).cast("I"), engines=engines, workers=workers, index=index,
                    lock=locked)  # fmt: skip


class _PoolCollector(Collector):
    """Per-backend gauges read from the pool at scrape time."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "capture_proxy_backend_in_flight", _HELP["in_flight"], labels=["backend"]
        )
        healthy = GaugeMetricFamily(
            "capture_proxy_backend_healthy", _HELP["healthy"], labels=["backend"]
        )
        chosen = GaugeMetricFamily(
            "capture_proxy_backend_chosen", _HELP["chosen"], labels=["backend"]
        )
        for b in self.pool.backends:
            in_flight.add_metric([b.url], b.in_flight)
            healthy.add_metric([b.url], 0 if b.healthy is False else 1)
            chosen.add_metric([b.url], b.chosen)
        moved = GaugeMetricFamily("capture_proxy_backend_key_moves", _HELP["key_moves"])
        moved.add_metric([], self.pool.moves)
        yield from (in_flight, healthy, chosen, moved)


ROUTES_KEY = web.AppKey("engine_routes", EngineRoutes)
