"""The composition root: builds the whole application from settings.

Owns the wiring: which middlewares run (errors, auth, the request policy, traffic
recording), which resources
live in ``cleanup_ctx`` (the store opened and closed with the app, one upstream
``ClientSession``, the exact-token machinery, the tombstone sweeper), the app's state
(``proxy.keys``), and which routes serve what: ``/health`` and ``/metrics`` (``proxy.status``),
the read API (``rest.reads``, ``rest.lifecycle``, ``rest.downloads``), the viewer, and last the
proxy's catch-all ``dispatch`` (``proxy.app``). Everything above it (``cli``,
tests, benchmarks) builds an app here; nothing below it imports it. Must not: handle a
request itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from capture_proxy.config import Settings
from capture_proxy.core.engine_formats import get_dialect
from capture_proxy.core.linking.claims import ChildClaims
from capture_proxy.core.linking.late_retry import AttemptsInFlight
from capture_proxy.families import get_parser, load_family
from capture_proxy.families.base import ChatRenderer, RenderError
from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.families.vision import VisionProcessorConfig
from capture_proxy.proxy.app import CALL_DEPS_KEY, dispatch
from capture_proxy.proxy.auth import auth_middleware
from capture_proxy.proxy.cache_bounds import CacheBounds
from capture_proxy.proxy.engine_probe import EngineProbe
from capture_proxy.proxy.engine_render import EngineRenderer
from capture_proxy.proxy.engines import ROUTES_KEY, EngineRoutes, map_pin_board
from capture_proxy.proxy.errors import error_middleware
from capture_proxy.proxy.exact import ExactTokens
from capture_proxy.proxy.images import (
    IMAGE_SESSION_KEY,
    IMAGES_KEY,
    ImagePolicy,
    load_processor,
    make_fetch_session,
)
from capture_proxy.proxy.keys import (
    ENGINE_PROBE_KEY,
    EXACT_KEY,
    LINKER_KEY,
    NOTES_KEY,
    RECORDER_KEY,
    SESSION_KEY,
    SETTINGS_KEY,
    STORE_KEY,
    WORKER_KEY,
    WorkerRole,
)
from capture_proxy.proxy.linker import IndexFeed, Linker
from capture_proxy.proxy.loop_lag import in_flight_middleware, lag_monitor
from capture_proxy.proxy.metrics import METRICS_KEY, Metrics
from capture_proxy.proxy.periodic import every
from capture_proxy.proxy.policy import policy_middleware, use_expect_continue
from capture_proxy.proxy.recorder import Recorder
from capture_proxy.proxy.status import STORE_HEALTH_KEY, StoreHealthReads, health, metrics
from capture_proxy.proxy.stopping import CALLS_IN_FLIGHT_KEY, CallsInFlight, graceful_stop
from capture_proxy.proxy.traffic_tap import RECORDING_KEY, TrafficRecorder, recording_middleware
from capture_proxy.proxy.uncaptured import (
    UNCAPTURED_KEY,
    UncapturedGeneration,
    read_only_rollout_path,
)
from capture_proxy.proxy.upstream import make_client_session
from capture_proxy.proxy.weight_watch import WEIGHT_WATCHERS_KEY, WeightWatchers
from capture_proxy.rest import downloads, images, lifecycle, reads
from capture_proxy.rest.deadline import read_deadline_middleware
from capture_proxy.rest.reads import unknown_captures_path
from capture_proxy.rest.sending import read_send_middleware
from capture_proxy.store.base import CaptureStore
from capture_proxy.viewer import ViewerConfig, add_viewer_routes
from harness_notes import NoteRegistry, default_registry

log = logging.getLogger("capture_proxy")

SWEEPER_KEY = web.AppKey("tombstone_sweeper", asyncio.Task)
#: A catch-all route's tail: any characters. aiohttp matches routes on the decoded path, and
#: ``.*`` stops at a newline (``%0A``): such a path matched no route and was a bare 404, not
#: the handler's own answer (a 400 ``invalid_rollout_id`` for a rollout id holding one).
ANY_TAIL = r"{tail:[\s\S]*}"


async def _warn_if_engine_down(app: web.Application, settings: Settings) -> None:
    """One probe of the engine at start-up (the cached probe ``/health`` reads): a WARNING
    naming the engine (``backend_label``: no password) when it does not answer, so that the
    "serving on" line is not the only word on an engine that is down or still loading. With
    several backends the pool's first probe round (at once) logs each one that is down."""
    if app[ROUTES_KEY].many:
        return
    engine = await app[ENGINE_PROBE_KEY].status(app[SESSION_KEY])
    if not engine.get("ok"):
        log.warning(
            "the engine at %s does not answer (%s): calls fail until it does; /health says "
            "engine_unreachable until then",
            settings.backend_label,
            engine.get("error") or f"HTTP {engine.get('status')}",
        )


def make_exact_tokens(
    settings: Settings, session: aiohttp.ClientSession, renderer: ChatRenderer | None = None
) -> ExactTokens:
    """Exact-token machinery from settings: a local tokenizer when ``tokenizer`` is set, else
    the engine's ``/tokenize``; each model of ``model_families`` gets its family's renderer,
    parser and closers. Raises RenderError when a tokenizer cannot be loaded."""
    end_of_turn_ids = None
    if renderer is None and settings.tokenizer is not None:
        # Loading a tokenizer and its chat template takes seconds: say so, then how long.
        log.info(
            "loading the tokenizer and chat template from %s (setting tokenizer)",
            settings.tokenizer,
        )
        started = time.perf_counter()
        local = LocalRenderer.from_directory(settings.tokenizer)
        log.info(
            "loaded the tokenizer from %s in %.1f s",
            settings.tokenizer,
            time.perf_counter() - started,
        )
        token_id = local.token_id(settings.end_of_turn_token)
        if token_id is None:
            raise RenderError(f"end_of_turn_token {settings.end_of_turn_token!r} is not one token")
        end_of_turn_ids = frozenset({token_id})
        renderer = local
    dialect = get_dialect(
        settings.tokens_in_dialect,
        experts_shape=settings.routed_experts_shape,
        echo_prompt=settings.tokens_in_echo_prompt,
    )
    # One family object per family named, shared by its models (a tokenizer loads once).
    families: dict[str, ExactTokens] = {}
    tokenizer_dirs: dict[str, Path] = {str(k): v for k, v in settings.family_tokenizers.items()}
    for family in sorted(set(settings.model_families.values())):
        log.info("loading model family %s (setting model_families)", family)
        started = time.perf_counter()
        loaded = load_family(
            family,
            tokenizer_dir=tokenizer_dirs.get(family),
            system_start_date=settings.system_start_date,
            vision=family_vision(settings, family),
        )
        log.info("loaded model family %s in %.1f s", family, time.perf_counter() - started)
        families[family] = ExactTokens.of_family(
            loaded,
            dialect,
            max_model_len=settings.max_model_len,
            full_render=settings.exact_prompt_full_render,
        )
    return ExactTokens(
        renderer or EngineRenderer(session, settings.backend_base),
        get_parser(settings.output_parser),
        dialect,
        max_model_len=settings.max_model_len,
        end_of_turn_ids=end_of_turn_ids,
        end_of_turn_token=settings.end_of_turn_token,
        full_render=settings.exact_prompt_full_render,
        by_model={model: families[f] for model, f in settings.model_families.items()},
    )


def family_vision(settings: Settings, family: str) -> VisionProcessorConfig | None:
    """The image processor of the models of ``family`` (``image_processors``; None: none
    named, the family's default). Raises RenderError when its models name different ones."""
    named = {
        load_processor(settings.image_processors[model])
        for model, f in settings.model_families.items()
        if f == family and model in settings.image_processors
    }
    if len(named) > 1:
        raise RenderError(
            f"the models of family {family} name different image_processors: one family "
            "renders with one"
        )
    return next(iter(named), None)


#: Longest pause between two tombstone sweeps (seconds).
MAX_SWEEP_INTERVAL_S = 3600.0


def sweep_interval_s(retention_s: float) -> float:
    """A tenth of the retention, at most an hour: a tombstone lives at most 1.1 retentions."""
    return min(retention_s / 10, MAX_SWEEP_INTERVAL_S)


async def sweep_tombstones(store: CaptureStore, retention_s: float) -> int:
    """One sweep: remove tombstones older than ``retention_s``. Never raises (logged)."""
    try:
        swept = await store.sweep_tombstones(retention_s)
    except Exception as exc:
        log.error("sweeping tombstones failed: %s", exc)
        return 0
    if swept:
        log.info("swept %d tombstone(s) older than %.0f s", swept, retention_s)
    return swept


def tombstone_sweeper(
    retention_s: float,
) -> Callable[[web.Application], AbstractAsyncContextManager[None]]:
    """A cleanup context running ``sweep_tombstones`` every ``sweep_interval_s(retention_s)``
    while the app runs (the task is cancelled and awaited on shutdown)."""

    @contextlib.asynccontextmanager
    async def sweeper(app: web.Application) -> AsyncIterator[None]:
        store = app[STORE_KEY]
        async with every(
            sweep_interval_s(retention_s),
            lambda: sweep_tombstones(store, retention_s),
            name="capture-tombstone-sweeper",
        ) as task:
            app[SWEEPER_KEY] = task
            yield

    return sweeper


def _middlewares(settings: Settings, traffic: TrafficRecorder | None) -> list[Any]:
    """The proxy app's middlewares, outermost first: the count of requests in flight, the
    traffic recording when on (what the harness sent and got, errors included), errors, the
    read API's deadline and send timeout, auth, the request policy."""
    recording = [recording_middleware(traffic)] if traffic is not None else []
    return [
        in_flight_middleware,
        *recording,
        error_middleware,
        read_deadline_middleware(settings.read_api_timeout_s),
        read_send_middleware(settings.read_send_timeout_s),
        auth_middleware(settings),
        policy_middleware(settings),
    ]


def _linker(
    settings: Settings,
    store: CaptureStore,
    index_feed: IndexFeed | None,
    child_claims: ChildClaims | None,
    attempts: AttemptsInFlight | None,
    metrics: Metrics,
    worker: WorkerRole | None = None,
) -> Linker:
    # A worker's caches: its share of its supervisor's count (``cache_memory_mb`` as the
    # supervisor decided it); a process alone, all of the memory's share.
    cache_mb = settings.cache_mb_for(worker.count if worker is not None else 1)
    return Linker(
        store,
        on_index_load=metrics.link_index_loads.inc,
        refuse_note_parents=settings.parent_resolution == "source_history",
        max_rollouts=settings.link_index_max_rollouts,
        bounds=CacheBounds.of(cache_mb, settings.link_index_max_calls),
        refresh_on_miss=store.shared,
        feed=index_feed,
        claims=child_claims,
        attempts=attempts,
    )


def build_proxy_app(
    settings: Settings,
    store: CaptureStore,
    notes: NoteRegistry | None = None,
    renderer: ChatRenderer | None = None,
    worker: WorkerRole | None = None,
    index_feed: IndexFeed | None = None,
    child_claims: ChildClaims | None = None,
    attempts: AttemptsInFlight | None = None,
) -> web.Application:
    """The proxy app. ``store`` is opened and closed with the app; ``notes``: the harness-note
    registry (default: every registered harness); ``renderer``: exact-token renderer override
    (default: from settings); ``worker``: this app is one worker of several (``serve
    --workers``): its metrics are summed with theirs, and only worker 0 sweeps tombstones;
    ``index_feed``: keeps its link indexes current with the other workers' writes;
    ``child_claims``: the other workers' calls in flight, by the candidate each took;
    ``attempts``: every worker's calls in flight, by request and harness session."""
    traffic = TrafficRecorder(settings.record_dir) if settings.record_dir is not None else None
    app = web.Application(
        middlewares=_middlewares(settings, traffic),
        client_max_size=settings.max_request_body_bytes,
    )
    if traffic is not None:
        app[RECORDING_KEY] = traffic
    app[SETTINGS_KEY] = settings
    app[STORE_KEY] = store
    app[METRICS_KEY] = counters = Metrics(worker.metrics_dir if worker is not None else None)
    if worker is not None:
        app[WORKER_KEY] = worker
    app[UNCAPTURED_KEY] = UncapturedGeneration(
        app[METRICS_KEY], refuse=settings.uncaptured_generation == "refuse"
    )
    app[RECORDER_KEY] = Recorder(
        store,
        metrics=app[METRICS_KEY],
        prompt_mode_for=settings.prompt_mode_for,
        store_failure=settings.store_failure,
    )
    app[ENGINE_PROBE_KEY] = EngineProbe(
        settings.backend_base,
        interval_s=settings.engine_health_interval_s,
        timeout_s=settings.engine_health_timeout_s,
        headers=(
            {"Authorization": settings.backend_auth_header}
            if settings.backend_auth_header is not None
            else None
        ),
    )
    app[LINKER_KEY] = _linker(settings, store, index_feed, child_claims, attempts, counters, worker)
    app[NOTES_KEY] = notes if notes is not None else default_registry()
    app[IMAGES_KEY] = ImagePolicy.from_settings(settings)
    app[ROUTES_KEY] = _engine_routes(settings, worker)
    app[CALL_DEPS_KEY] = {}
    app[CALLS_IN_FLIGHT_KEY] = CallsInFlight()
    graceful_stop(app, settings.shutdown_timeout_s)
    app.cleanup_ctx.append(_resources(settings, store, renderer, worker))
    if worker is None or worker.index == 0:
        app.cleanup_ctx.append(tombstone_sweeper(settings.tombstone_retention_s))
    app.cleanup_ctx.append(lag_monitor())
    app[STORE_HEALTH_KEY] = StoreHealthReads()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    reads.add_routes(app)
    images.add_routes(app)
    lifecycle.add_routes(app)
    downloads.add_routes(app)
    add_viewer_routes(
        app,
        ViewerConfig(
            captures_token=settings.captures_token,
            backend=settings.backend_base,
            tokenizer=settings.tokenizer,
        ),
    )
    app.router.add_route("*", "/captures", unknown_captures_path)
    app.router.add_route("*", "/captures/" + ANY_TAIL, unknown_captures_path)
    app.router.add_route("*", "/" + ANY_TAIL, dispatch)
    use_expect_continue(app)
    return app


def _engine_routes(settings: Settings, worker: WorkerRole | None = None) -> EngineRoutes:
    """The engines a rollout's calls go to (``--backend`` repeated), with the pins the workers
    share (``worker.pins_path``); their metrics come with the app's resources
    (``EngineRoutes.metrics``)."""
    urls = settings.backend_bases
    pins = None
    if worker is not None and worker.pins_path is not None and len(urls) > 1:
        pins = map_pin_board(Path(worker.pins_path), engines=len(urls), workers=worker.count,
                             index=worker.index)  # fmt: skip
    routes = EngineRoutes(
        urls,
        key_kind=settings.routing_key,
        balance_factor=settings.backend_balance_factor,
        pin_idle_s=settings.backend_pin_idle_s,
        pins=pins,
        health_interval_s=settings.backend_health_interval_s,
        health_timeout_s=settings.backend_health_timeout_s,
        health_headers=(
            {"Authorization": settings.backend_auth_header}
            if settings.backend_auth_header is not None
            else None
        ),
    )
    return routes


def _resources(
    settings: Settings,
    store: CaptureStore,
    renderer: ChatRenderer | None,
    worker: WorkerRole | None = None,
) -> Callable[[web.Application], AsyncIterator[None]]:
    """The proxy app's resources, opened in order and closed in reverse: the store, the
    upstream session, the engines' weight-version readers (``proxy.weight_watch``), the
    exact-token machinery, the engines' health probes and the marker of
    calls answered but not stored (``proxy.losses``: its last attempt runs before the store
    closes)."""

    async def resources(app: web.Application) -> AsyncIterator[None]:
        await store.open()
        try:
            app[SESSION_KEY] = make_client_session(settings)
            watchers = WeightWatchers(
                app[SESSION_KEY], settings.backend_bases, settings.weight_version_poll_s
            )
            app[WEIGHT_WATCHERS_KEY] = watchers
            try:
                if settings.uses_exact_tokens:
                    app[EXACT_KEY] = make_exact_tokens(settings, app[SESSION_KEY], renderer)
                if settings.image_fetch_remote:
                    app[IMAGE_SESSION_KEY] = make_fetch_session()
                await _warn_if_engine_down(app, settings)
                await watchers.start()
                recorder = app[RECORDER_KEY]
                async with (
                    app[ROUTES_KEY].health_task(app[SESSION_KEY]),
                    recorder.losses.marker(),
                    app[ROUTES_KEY].metrics(app[METRICS_KEY].registry, shared=worker is not None),
                ):
                    try:
                        yield
                    finally:
                        await recorder.close()
            finally:
                await watchers.stop()
                await app[SESSION_KEY].close()
                if IMAGE_SESSION_KEY in app:
                    await app[IMAGE_SESSION_KEY].close()
        finally:
            # Also when start-up fails half-way: the store's threads must not keep the
            # process alive.
            await store.close()

    return resources


def build_read_only_app(
    settings: Settings, store: CaptureStore, *, backend: str | None = None
) -> web.Application:
    """The read API (without ``DELETE``) and the viewer over ``store``, with no engine and no
    proxied paths (``serve --read-only``): browse a store after the run. ``backend``: an
    engine for ``/detokenize``, if one is up; ``settings.backend`` is not used."""
    app = web.Application(
        middlewares=[
            error_middleware,
            read_deadline_middleware(settings.read_api_timeout_s),
            read_send_middleware(settings.read_send_timeout_s),
            auth_middleware(settings),
            policy_middleware(settings),
        ]
    )
    app[SETTINGS_KEY] = settings
    app[STORE_KEY] = store
    app[RECORDER_KEY] = Recorder(store)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        await store.open()
        try:
            yield
        finally:
            await store.close()

    app.cleanup_ctx.append(resources)
    app[STORE_HEALTH_KEY] = StoreHealthReads()
    app.router.add_get("/health", health)
    reads.add_routes(app, read_only=True)
    images.add_routes(app)
    add_viewer_routes(
        app,
        ViewerConfig(
            captures_token=settings.captures_token,
            backend=backend,
            tokenizer=settings.tokenizer,
            read_only=True,
        ),
    )
    app.router.add_route("*", "/captures", unknown_captures_path)
    app.router.add_route("*", "/captures/" + ANY_TAIL, unknown_captures_path)
    app.router.add_route("*", "/ng-rollout/" + ANY_TAIL, read_only_rollout_path)
    use_expect_continue(app)
    return app
