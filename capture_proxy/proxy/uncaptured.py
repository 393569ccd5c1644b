"""Generation calls the proxy does not capture, and capture paths it cannot serve.

Owns what the proxy says about a model call that reaches it outside a capture path (a
harness pointed at ``http://proxy/v1`` instead of its capture path: a whole run could go
uncaptured without an error), plain (``/v1/...``) or on the correlation path
(``/ng-rollout/<id>/v1/...``, also a base URL without its rollout id,
``/ng-rollout/training-token-capture/v1/...``): one WARNING per engine path and form, a count
per engine path (``capture_proxy_uncaptured_generation_calls_total``), and, with
``uncaptured_generation = refuse``, a 400 in the API's shape naming the capture path's form.
Also the 404 of a
correlation path whose first segment is a misspelt capture segment
(``/ng-rollout/r/training-tokens-capture/v1/chat/completions``). Must not: forward anything.
"""

from __future__ import annotations

import logging

from aiohttp import web

from capture_proxy.core.fronts import front_of_tail, generation_path
from capture_proxy.core.routing import CAPTURE_PATH_FORM, CAPTURE_SEGMENT, ROLLOUT_PREFIX, Route
from capture_proxy.proxy.errors import ERROR_SHAPE_KEY, BadRequest, Forbidden, NotFound
from capture_proxy.proxy.metrics import Metrics

log = logging.getLogger("capture_proxy")

#: First segments of the engine paths a correlation path forwards (``/ng-rollout/<id>/v1/...``
#: and the engines' aliases without ``/v1``); any other before an API's tail is a misspelling.
_ENGINE_SEGMENTS = frozenset({"v1", "chat", "responses", "messages", "completions", "inference"})


class UncapturedGeneration:
    """The warn-once memory and the policy (``refuse``) of one app."""

    def __init__(self, metrics: Metrics | None, *, refuse: bool) -> None:
        self._metrics = metrics
        self._refuse = refuse
        #: the calls already warned about (``_named``: a bounded set, ``generation_path``'s
        #: values in three forms, never a caller's rollout id)
        self._warned: set[str] = set()

    def check(self, request: web.Request, target: Route) -> None:
        """For a pass-through or correlation ``target``: count and warn about a generation
        call, and raise BadRequest (400 ``capture_path_required``) when such calls are
        refused. A correlation path (``/ng-rollout/<id>/v1/...``) forwards uncaptured as a
        plain path does, so its generation calls count alike."""
        path = generation_path(request.method, target.upstream_path)
        if path is None:
            return
        if self._metrics is not None:
            self._metrics.inc_uncaptured_generation(path)
        named = _named(target, path)
        if named not in self._warned:
            self._warned.add(named)
            log.warning(
                "POST %s is a generation call outside a capture path: %s (use %s; warned once "
                "per path, counted in capture_proxy_uncaptured_generation_calls_total)",
                named,
                "refused (setting uncaptured_generation = refuse)"
                if self._refuse
                else "forwarded uncaptured, no tokens are recorded",
                CAPTURE_PATH_FORM,
            )
        if self._refuse:
            _shape_by_tail(request, target.upstream_path)
            sent = (
                target.upstream_path
                if target.rollout_id is None
                else f"{ROLLOUT_PREFIX}{target.rollout_id}{target.upstream_path}"
            )
            raise BadRequest(
                f"POST {sent} is outside a capture path{_why(target)} and this proxy "
                f"refuses uncaptured generation calls: send it to {CAPTURE_PATH_FORM} (e.g. "
                f"base_url http://HOST:PORT/ng-rollout/<rollout_id>/{CAPTURE_SEGMENT}/v1)",
                param="path",
                code="capture_path_required",
            )


#: What a correlation path whose rollout id is the capture segment says: a base URL that
#: lacks the rollout id (``http://proxy/ng-rollout/training-token-capture/v1``).
_NO_ROLLOUT_ID = f"the path has no rollout id before {CAPTURE_SEGMENT}"


def _named(target: Route, path: str) -> str:
    """The call as the warning names it: its engine ``path`` (``generation_path``) behind
    its prefix, no rollout id of a caller's in it."""
    if target.rollout_id is None:
        return path
    if target.rollout_id == CAPTURE_SEGMENT:
        return f"{ROLLOUT_PREFIX}{CAPTURE_SEGMENT}{path} ({_NO_ROLLOUT_ID})"
    return f"{ROLLOUT_PREFIX}<rollout_id>{path} (the correlation path)"


def _why(target: Route) -> str:
    if target.rollout_id is None:
        return ""
    if target.rollout_id == CAPTURE_SEGMENT:
        return f" ({_NO_ROLLOUT_ID}: {CAPTURE_SEGMENT!r} is taken as the rollout id)"
    return " (the correlation path /ng-rollout/<rollout_id>/... captures nothing)"


def refuse_misspelt_capture_path(request: web.Request, target: Route) -> None:
    """For a correlation ``target``: raise NotFound (404 ``capture_path_not_found``, in the
    API's shape) when its path is an API endpoint behind an unknown first segment."""
    first = target.upstream_path.lstrip("/").partition("/")[0]
    if first in _ENGINE_SEGMENTS or front_of_tail(target.upstream_path) is None:
        return
    _shape_by_tail(request, target.upstream_path)
    raise NotFound(
        f"/ng-rollout/{target.rollout_id}/{first}/... is not a proxy path: {first!r} is not "
        f"{CAPTURE_SEGMENT!r}; the capture path's form is {CAPTURE_PATH_FORM} (the "
        "correlation path, uncaptured: /ng-rollout/<rollout_id>/v1/...)",
        param="path",
        code="capture_path_not_found",
    )


async def read_only_rollout_path(request: web.Request) -> web.StreamResponse:
    """Any ``/ng-rollout/...`` request to a read-only server (``serve --read-only``): a 403
    ``read_only`` in the API's shape saying so (no engine, nothing is captured), never a bare
    404. A 403, not a 503: no retry of the harness's can succeed on this server."""
    _shape_by_tail(request, request.path)
    raise Forbidden(
        f"{request.method} {request.path}: this server is read-only (serve --read-only): it "
        "serves the read API and the viewer over a store and captures nothing. Send model "
        "calls to a capturing server: capture-proxy serve --backend ENGINE_URL --store DIR "
        f"(paths {CAPTURE_PATH_FORM})",
        param="path",
        code="read_only",
    )


def _shape_by_tail(request: web.Request, path: str) -> None:
    front = front_of_tail(path)
    if front is not None:
        request[ERROR_SHAPE_KEY] = front.error_body


UNCAPTURED_KEY = web.AppKey("uncaptured_generation", UncapturedGeneration)
