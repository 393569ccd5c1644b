"""The proxy application: wiring of settings, store, upstream session and routes.

Owns the aiohttp ``Application``: resources live in ``cleanup_ctx`` (store open/close, one
upstream ClientSession), app state uses typed ``AppKey``s, one middleware shapes errors. The
catch-all route hands every non-``/captures`` request to ``dispatch``, which routes by path
(core ``routing``) to capture, correlation or pass-through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import aiohttp
from aiohttp import web

from capture_proxy import __version__, rest, rest_export, rest_lifecycle
from capture_proxy.config import Settings
from capture_proxy.core.engine_formats import get_dialect
from capture_proxy.core.fronts import (
    EndpointKind,
    endpoint_kind,
    error_front,
    front_for,
    parse_count_tokens,
)
from capture_proxy.core.parsers import get_parser
from capture_proxy.core.routing import InvalidRolloutId, Route, RouteKind, route
from capture_proxy.proxy.auth import auth_middleware
from capture_proxy.proxy.calls import CaptureDeps
from capture_proxy.proxy.capture import BackEnds, handle_captured_call, handle_count_tokens
from capture_proxy.proxy.engine_probe import EngineProbe
from capture_proxy.proxy.errors import (
    ERROR_SHAPE_KEY,
    BadRequest,
    Conflict,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    error_middleware,
)
from capture_proxy.proxy.exact import ExactTokens
from capture_proxy.proxy.linker import Linker
from capture_proxy.proxy.metrics import CONTENT_TYPE, METRICS_KEY, Metrics
from capture_proxy.proxy.passthrough import forward_uncaptured
from capture_proxy.proxy.recorder import Recorder
from capture_proxy.proxy.recording import TrafficRecorder, note_request, recording_middleware
from capture_proxy.proxy.upstream import make_client_session
from capture_proxy.renderers import load_family
from capture_proxy.rendering import ChatRenderer, EngineRenderer, LocalRenderer, RenderError
from capture_proxy.store.base import CaptureStore
from capture_proxy.viewer import ViewerConfig, add_viewer_routes
from harness_notes import NoteRegistry, default_registry

log = logging.getLogger("capture_proxy")

SETTINGS_KEY = web.AppKey("settings", Settings)
SESSION_KEY = web.AppKey("upstream_session", aiohttp.ClientSession)
LINKER_KEY = rest.LINKER_KEY
NOTES_KEY = web.AppKey("harness_notes", NoteRegistry)
EXACT_KEY = web.AppKey("exact_tokens", ExactTokens)
SWEEPER_KEY = web.AppKey("tombstone_sweeper", asyncio.Task)
ENGINE_PROBE_KEY = web.AppKey("engine_probe", EngineProbe)


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes "
            "(setting max_request_body_bytes)",
            code="request_too_large",
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLarge(
            f"request body exceeds the limit of {limit} bytes (setting max_request_body_bytes)",
            code="request_too_large",
        ) from exc


def _capture_deps(request: web.Request) -> CaptureDeps:
    settings = request.app[SETTINGS_KEY]
    return CaptureDeps(
        request.app[SESSION_KEY],
        settings.backend_base,
        request.app[rest.RECORDER_KEY],
        request.app[LINKER_KEY],
        request.app[NOTES_KEY],
        first_byte_timeout_s=settings.upstream_first_byte_timeout_s,
        connect_retries=settings.upstream_connect_retries,
    )


def _back_ends(request: web.Request) -> BackEnds:
    settings = request.app[SETTINGS_KEY]
    return BackEnds(
        exact=request.app.get(EXACT_KEY),
        exact_for_model=lambda model: settings.prompt_mode_for(model) == "exact_tokens",
        token_counter=EngineRenderer(request.app[SESSION_KEY], settings.backend_base),
        routed_experts_for=settings.routed_experts_for,
    )


async def _refuse_if_frozen(request: web.Request, target: Route) -> None:
    """``late_calls = refuse``: a call to a frozen rollout gets a 409 before it reaches the
    engine. (A call that passes here while the rollout is being frozen is stored as late.)"""
    assert target.rollout_id is not None
    info = await request.app[rest.STORE_KEY].get_rollout(target.rollout_id)
    if info is not None and info.snapshot is not None:
        raise Conflict(
            f"rollout {target.rollout_id} is frozen (snapshot {info.snapshot.snapshot_id}): "
            "calls to it are refused (setting late_calls = refuse)",
            param="rollout_id",
            code="rollout_frozen",
        )


async def _serve_capture_path(
    request: web.Request, target: Route, raw_body: bytes
) -> tuple[web.StreamResponse, str]:
    """A request under a capture path; returns the response and what was done with it
    (``captured`` | ``counted`` | ``refused`` | ``forwarded``) for the access log."""
    path = target.upstream_path
    kind = endpoint_kind(request.method, path)
    front = front_for(path)
    shaped_by = error_front(path)
    if shaped_by is not None:
        # Errors of this request, from here on, take its API's error shape.
        request[ERROR_SHAPE_KEY] = shaped_by.error_body
    if kind is EndpointKind.CAPTURED and front is not None:
        if request.method != "POST":
            raise MethodNotAllowed(
                f"{request.method} {path} is not allowed: model calls are POST",
                allowed=("POST",),
            )
        if request.app[SETTINGS_KEY].late_calls == "refuse":
            await _refuse_if_frozen(request, target)
        deps = _capture_deps(request)
        response = await handle_captured_call(
            request, target, raw_body, front, deps, _back_ends(request)
        )
        return response, "captured"
    if kind is EndpointKind.COUNT_TOKENS:
        return await handle_count_tokens(raw_body, parse_count_tokens, _back_ends(request)), (
            "counted"
        )
    if kind is EndpointKind.NOT_CAPTURABLE:
        raise BadRequest(
            f"POST {path} generates but cannot be captured under a capture path: use "
            "/v1/chat/completions, /v1/responses or /v1/messages (or the correlation path "
            "/ng-rollout/<id>/v1/... to forward it uncaptured)",
            param="path",
            code="endpoint_not_captured",
        )
    settings = request.app[SETTINGS_KEY]
    response = await forward_uncaptured(
        request,
        target,
        raw_body,
        request.app[SESSION_KEY],
        settings.backend_base,
        first_byte_timeout_s=settings.upstream_first_byte_timeout_s,
        connect_retries=settings.upstream_connect_retries,
    )
    return response, "forwarded"


async def dispatch(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    started = time.perf_counter()
    try:
        target = route(request.raw_path.split("?", 1)[0])
    except InvalidRolloutId as exc:
        raise BadRequest(str(exc), param="rollout_id", code="invalid_rollout_id") from exc
    raw_body = await _read_body(request, settings.max_request_body_bytes)
    note_request(request, raw_body, None)
    if target.kind is RouteKind.CAPTURE:
        response, done = await _serve_capture_path(request, target, raw_body)
        note_request(request, raw_body, done)
    else:
        response = await forward_uncaptured(
            request,
            target,
            raw_body,
            request.app[SESSION_KEY],
            settings.backend_base,
            first_byte_timeout_s=settings.upstream_first_byte_timeout_s,
            connect_retries=settings.upstream_connect_retries,
        )
        done = "forwarded" if target.kind is RouteKind.PASSTHROUGH else "correlated"
    log.info(
        "%s %s -> %d (%s, rollout %s, <%d bytes in>, %.1f ms)",
        request.method,
        request.path,
        response.status,
        done,
        target.rollout_id or "-",
        len(raw_body),
        (time.perf_counter() - started) * 1000,
    )
    return response


async def health(request: web.Request) -> web.Response:
    """Proxy and store health (503 when the store cannot answer), whether the engine answers
    (a cached probe: ``engine.ok`` is reported, it does not make the proxy unhealthy, since an
    engine loading its model is normal), and the capture counters. With a token set the
    store's filesystem path is left out (``/health`` is open to anyone)."""
    settings = request.app[SETTINGS_KEY]
    recorder = request.app[rest.RECORDER_KEY]
    try:
        store = await request.app[rest.STORE_KEY].health()
        ok = True
    except Exception as exc:
        store, ok = {"error": str(exc)}, False
    if settings.captures_token is not None or settings.proxy_token is not None:
        store = {k: v for k, v in store.items() if k != "path"}
        if not ok:
            store = {"error": "store unavailable (details in the proxy's log)"}
    engine = await request.app[ENGINE_PROBE_KEY].status(request.app[SESSION_KEY])
    return web.json_response(
        {
            "status": "ok" if ok else "degraded",
            "version": __version__,
            "store": store,
            "engine": engine,
            "capture": {
                "persisted": recorder.stats.persisted,
                "store_failures": recorder.stats.store_failures,
                "late_calls_refused": recorder.stats.late_calls_refused,
                "incomplete_calls": recorder.stats.incomplete,
                "failed_calls": recorder.stats.failed,
            },
        },
        status=200 if ok else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the app's metrics in the Prometheus text format (behind
    ``captures_token`` when it is set, like the read API)."""
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def unknown_captures_path(request: web.Request) -> web.Response:
    """Under ``/captures``, what no read-API route took: a 405 with ``Allow`` when a route
    exists for the path with other methods (``POST /captures/rollouts``), else a 404."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is request.match_info.route.resource or not resource.canonical.startswith(
            "/captures/"
        ):
            continue
        match, methods = await resource.resolve(request)
        if match is None:
            allowed |= methods
    if allowed:
        raise MethodNotAllowed(
            f"{request.method} is not allowed on {request.path} (allowed: "
            f"{', '.join(sorted(allowed))})",
            allowed=tuple(sorted(allowed)),
        )
    raise NotFound(f"no such read API path: {request.path}", code="not_found")


def make_exact_tokens(
    settings: Settings, session: aiohttp.ClientSession, renderer: ChatRenderer | None = None
) -> ExactTokens:
    """Exact-token machinery from settings: a local tokenizer when ``tokenizer`` is set, else
    the engine's ``/tokenize``; each model of ``model_families`` gets its family's renderer,
    parser and closers. Raises RenderError when a tokenizer cannot be loaded."""
    end_of_turn_ids = None
    if renderer is None and settings.tokenizer is not None:
        local = LocalRenderer.from_directory(settings.tokenizer)
        token_id = local.token_id(settings.end_of_turn_token)
        if token_id is None:
            raise RenderError(f"end_of_turn_token {settings.end_of_turn_token!r} is not one token")
        end_of_turn_ids = frozenset({token_id})
        renderer = local
    dialect = get_dialect(settings.tokens_in_dialect, experts_shape=settings.routed_experts_shape)
    # One family object per family named, shared by its models (a tokenizer loads once).
    families: dict[str, ExactTokens] = {}
    tokenizer_dirs: dict[str, Path] = {str(k): v for k, v in settings.family_tokenizers.items()}
    for family in sorted(set(settings.model_families.values())):
        families[family] = ExactTokens.of_family(
            load_family(family, tokenizer_dir=tokenizer_dirs.get(family)),
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
        store = app[rest.STORE_KEY]

        async def loop() -> None:
            while True:
                await sweep_tombstones(store, retention_s)
                await asyncio.sleep(sweep_interval_s(retention_s))

        task = asyncio.create_task(loop(), name="capture-tombstone-sweeper")
        app[SWEEPER_KEY] = task
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return sweeper


def build_proxy_app(
    settings: Settings,
    store: CaptureStore,
    notes: NoteRegistry | None = None,
    renderer: ChatRenderer | None = None,
) -> web.Application:
    """The proxy app. ``store`` is opened and closed with the app; ``notes``: the harness-note
    registry (default: every registered harness); ``renderer``: exact-token renderer override
    (default: from settings)."""
    middlewares = [error_middleware, auth_middleware(settings)]
    if settings.record_dir is not None:
        # Outermost: what the harness sent and got, errors included (see ``recording``).
        middlewares.insert(0, recording_middleware(TrafficRecorder(settings.record_dir)))
    app = web.Application(
        middlewares=middlewares,
        client_max_size=settings.max_request_body_bytes,
    )
    app[SETTINGS_KEY] = settings
    app[rest.STORE_KEY] = store
    app[METRICS_KEY] = Metrics()
    app[rest.RECORDER_KEY] = Recorder(
        store, metrics=app[METRICS_KEY], prompt_mode_for=settings.prompt_mode_for
    )
    app[ENGINE_PROBE_KEY] = EngineProbe(
        settings.backend_base,
        interval_s=settings.engine_health_interval_s,
        timeout_s=settings.engine_health_timeout_s,
        headers=(
            {"Authorization": f"Bearer {settings.backend_api_key.get_secret_value()}"}
            if settings.backend_api_key is not None
            else None
        ),
    )
    app[LINKER_KEY] = Linker(
        store,
        refuse_note_parents=settings.parent_resolution == "source_history",
        max_rollouts=settings.link_index_max_rollouts,
        refresh_on_miss=store.shared,
    )
    app[NOTES_KEY] = notes if notes is not None else default_registry()

    async def resources(app: web.Application) -> AsyncIterator[None]:
        await store.open()
        try:
            app[SESSION_KEY] = make_client_session(settings)
            try:
                if settings.uses_exact_tokens:
                    app[EXACT_KEY] = make_exact_tokens(settings, app[SESSION_KEY], renderer)
                yield
            finally:
                await app[SESSION_KEY].close()
        finally:
            # Also when start-up fails half-way: the store's threads must not keep the
            # process alive.
            await store.close()

    app.cleanup_ctx.append(resources)
    app.cleanup_ctx.append(tombstone_sweeper(settings.tombstone_retention_s))
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    rest.add_routes(app)
    rest_lifecycle.add_routes(app)
    rest_export.add_routes(app)
    add_viewer_routes(
        app,
        ViewerConfig(
            captures_token=settings.captures_token,
            backend=settings.backend_base,
            tokenizer=settings.tokenizer,
        ),
    )
    app.router.add_route("*", "/captures", unknown_captures_path)
    app.router.add_route("*", "/captures/{tail:.*}", unknown_captures_path)
    app.router.add_route("*", "/{tail:.*}", dispatch)
    return app


def build_read_only_app(
    settings: Settings, store: CaptureStore, *, backend: str | None = None
) -> web.Application:
    """The read API (without ``DELETE``) and the viewer over ``store``, with no engine and no
    proxied paths (``serve --read-only``): browse a store after the run. ``backend``: an
    engine for ``/detokenize``, if one is up; ``settings.backend`` is not used."""
    app = web.Application(middlewares=[error_middleware, auth_middleware(settings)])
    app[SETTINGS_KEY] = settings
    app[rest.STORE_KEY] = store
    app[rest.RECORDER_KEY] = Recorder(store)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        await store.open()
        try:
            yield
        finally:
            await store.close()

    app.cleanup_ctx.append(resources)
    app.router.add_get("/health", health)
    rest.add_routes(app, read_only=True)
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
    app.router.add_route("*", "/captures/{tail:.*}", unknown_captures_path)
    return app
