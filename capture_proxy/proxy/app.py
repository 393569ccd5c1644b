"""The proxy's request dispatch: every request the app's other routes did not take.

``dispatch`` reads the body (bounded by ``max_request_body_bytes``), routes by path (core
``routing``) to capture, correlation or pass-through, and writes the one access-log line of
the request. What the capture needs comes from the app's state (``proxy.keys``), set by the
composition root (``capture_proxy.app``), which builds the app and registers this route last.
Must not: build the app or know the read API, the viewer or the store's kind.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from capture_proxy.core.fronts import (
    EndpointKind,
    endpoint_kind,
    error_front,
    front_for,
    parse_count_tokens,
)
from capture_proxy.core.routing import InvalidRolloutId, Route, RouteKind, route
from capture_proxy.proxy.call_handler import BackEnds, handle_captured_call, handle_count_tokens
from capture_proxy.proxy.calls import STORED_AS_KEY, CaptureDeps
from capture_proxy.proxy.engine_render import EngineRenderer
from capture_proxy.proxy.engines import ROUTES_KEY
from capture_proxy.proxy.errors import (
    ERROR_SHAPE_KEY,
    BadRequest,
    Conflict,
    MethodNotAllowed,
    PayloadTooLarge,
)
from capture_proxy.proxy.images import IMAGE_SESSION_KEY, IMAGES_KEY
from capture_proxy.proxy.keys import (
    EXACT_KEY,
    LINKER_KEY,
    NOTES_KEY,
    RECORDER_KEY,
    SESSION_KEY,
    SETTINGS_KEY,
    STORE_KEY,
)
from capture_proxy.proxy.passthrough import forward_uncaptured
from capture_proxy.proxy.recorder import NOT_STORED
from capture_proxy.proxy.traffic_tap import note_request
from capture_proxy.proxy.uncaptured import UNCAPTURED_KEY, refuse_misspelt_capture_path
from capture_proxy.proxy.upstream import captured_call_timeout
from capture_proxy.proxy.weight_watch import WEIGHT_WATCHERS_KEY

log = logging.getLogger("capture_proxy")


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


#: A request under a capture path that reached the captured-call handler (the recorder's
#: classification).
CAPTURED = "captured"

#: per engine URL, what its captured calls need (``_call_deps``): made on the first call, once
#: the app's resources are open; none of it changes while the app runs
CALL_DEPS_KEY = web.AppKey("call_deps", dict[str, tuple[CaptureDeps, BackEnds]])


def _call_deps(request: web.Request, backend: str) -> tuple[CaptureDeps, BackEnds]:
    made = request.app[CALL_DEPS_KEY]
    deps = made.get(backend)
    if deps is None:
        deps = made[backend] = (_capture_deps(request, backend), _back_ends(request, backend))
    return deps


def _capture_deps(request: web.Request, backend: str) -> CaptureDeps:
    settings = request.app[SETTINGS_KEY]
    routes = request.app[ROUTES_KEY]
    watchers = request.app.get(WEIGHT_WATCHERS_KEY)
    return CaptureDeps(
        request.app[SESSION_KEY],
        backend,
        request.app[RECORDER_KEY],
        request.app[LINKER_KEY],
        request.app[NOTES_KEY],
        first_byte_timeout_s=settings.upstream_first_byte_timeout_s,
        connect_retries=settings.upstream_connect_retries,
        on_unreachable=routes.mark_failed if routes.many else None,
        on_answered=routes.mark_answered if routes.many else None,
        weights=watchers.for_backend(backend) if watchers is not None else None,
        pause_wait_s=settings.engine_pause_wait_s,
        read_timeout_s=settings.upstream_read_timeout_s,
        request_timeout=captured_call_timeout(settings),
        images=request.app[IMAGES_KEY],
        image_session=request.app.get(IMAGE_SESSION_KEY),
    )


def _back_ends(request: web.Request, backend: str) -> BackEnds:
    settings = request.app[SETTINGS_KEY]
    return BackEnds(
        exact=request.app.get(EXACT_KEY),
        exact_for_model=lambda model: settings.prompt_mode_for(model) == "exact_tokens",
        token_counter=EngineRenderer(request.app[SESSION_KEY], backend),
        routed_experts_for=settings.routed_experts_for,
    )


async def _refuse_if_frozen(request: web.Request, target: Route) -> None:
    """``late_calls = refuse``: a call to a frozen rollout gets a 409 before it reaches the
    engine. (A call that passes here while the rollout is being frozen is stored as late.)"""
    assert target.rollout_id is not None
    info = await request.app[STORE_KEY].get_rollout(target.rollout_id)
    if info is not None and info.snapshot is not None:
        raise Conflict(
            f"rollout {target.rollout_id} is frozen (snapshot {info.snapshot.snapshot_id}): "
            "calls to it are refused (setting late_calls = refuse)",
            param="rollout_id",
            code="rollout_frozen",
        )


async def _serve_capture_path(
    request: web.Request, target: Route, raw_body: bytes, backend: str
) -> tuple[web.StreamResponse, str]:
    """A request under a capture path; returns the response and what was done with it
    (``CAPTURED`` | ``counted`` | ``forwarded``) for the recorder (the access line says what
    became of a captured call: ``_done``)."""
    path = target.upstream_path
    kind = endpoint_kind(request.method, path)
    front = front_for(path)
    shaped_by = error_front(path)
    if shaped_by is not None:
        # Errors of this request, from here on, take its API's error shape.
        request[ERROR_SHAPE_KEY] = shaped_by.error_body
    if kind in (EndpointKind.CAPTURED, EndpointKind.COUNT_TOKENS) and request.method != "POST":
        raise MethodNotAllowed(
            f"{request.method} {path} is not allowed: "
            + ("model calls" if kind is EndpointKind.CAPTURED else "token counts")
            + " are POST",
            allowed=("POST",),
        )
    if kind is EndpointKind.CAPTURED and front is not None:
        if request.app[SETTINGS_KEY].late_calls == "refuse":
            await _refuse_if_frozen(request, target)
        deps, back_ends = _call_deps(request, backend)
        response = await handle_captured_call(request, target, raw_body, front, deps, back_ends)
        return response, CAPTURED
    if kind is EndpointKind.COUNT_TOKENS:
        limits = request.app[IMAGES_KEY].limits
        return await handle_count_tokens(
            raw_body, lambda body: parse_count_tokens(body, limits), _back_ends(request, backend)
        ), ("counted")
    if kind is EndpointKind.NOT_NORMAL:
        raise BadRequest(
            f"POST {path}: a path under a capture path must be in normal form (no "
            "percent-encoding, no empty, '.' or '..' segments): the engine could read it as "
            "a generation endpoint the proxy would not capture",
            param="path",
            code="path_not_normal",
        )
    if kind is EndpointKind.NOT_CAPTURABLE:
        raise BadRequest(
            f"POST {path} generates but cannot be captured under a capture path: use "
            "/v1/chat/completions, /v1/responses or /v1/messages (or the correlation path "
            "/ng-rollout/<id>/v1/... to forward it uncaptured, warned and counted, unless "
            "uncaptured_generation = refuse)",
            param="path",
            code="endpoint_not_captured",
        )
    settings = request.app[SETTINGS_KEY]
    response = await forward_uncaptured(
        request,
        target,
        raw_body,
        request.app[SESSION_KEY],
        backend,
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
    done = CAPTURED if target.kind is RouteKind.CAPTURE else "forwarded"
    # The engine of this request (the rollout's, with several backends) and its routing key
    # on every engine request made for it (``proxy.engines``).
    engine = request.app[ROUTES_KEY].enter(target.rollout_id)
    backend = engine.backend
    try:
        if target.kind is RouteKind.CAPTURE:
            response, done = await _serve_capture_path(request, target, raw_body, backend)
            note_request(request, raw_body, done)
        else:
            if target.kind is RouteKind.CORRELATE:
                refuse_misspelt_capture_path(request, target)
            request.app[UNCAPTURED_KEY].check(request, target)
            response = await forward_uncaptured(
                request,
                target,
                raw_body,
                request.app[SESSION_KEY],
                backend,
                first_byte_timeout_s=settings.upstream_first_byte_timeout_s,
                connect_retries=settings.upstream_connect_retries,
            )
            done = "forwarded" if target.kind is RouteKind.PASSTHROUGH else "correlated"
    except asyncio.CancelledError:
        # The client left and aiohttp cancelled the handler (the call was stored by then):
        # one line, no traceback; a client leaving is no error of the proxy's.
        _log_request(request, "client gone", _done(request, done), target, raw_body, started)
        raise
    finally:
        engine.close()
    done = _done(request, done)
    if _client_left(request):
        done += ", client gone"
    _log_request(request, response.status, done, target, raw_body, started)
    return response


def _done(request: web.Request, done: str) -> str:
    """What the access line says was done: for a captured call, what became of it (its
    stored status, or ``not stored``: ``recorder.stored_as``), not that it was captured."""
    if done == CAPTURED:
        return request.get(STORED_AS_KEY, NOT_STORED)
    return done


def _log_request(
    request: web.Request,
    status: int | str,
    done: str,
    target: Route,
    raw_body: bytes,
    started: float,
) -> None:
    """The one access line of a request (sizes, never bodies or credentials): status, what
    was done (a captured call's ``complete`` | ``incomplete`` | ``failed`` | ``not stored``;
    ``counted``, ``forwarded``, ``correlated``), the rollout, the body's bytes as read."""
    log.info(
        "%s %s -> %s (%s, rollout %s, <%d bytes in>, %.1f ms)",
        request.method,
        request.path,
        status,
        done,
        target.rollout_id or "-",
        len(raw_body),
        (time.perf_counter() - started) * 1000,
    )


def _client_left(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
