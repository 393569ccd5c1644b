"""Client-facing errors and the one middleware that turns exceptions into responses.

Exception tree (each maps to one status and one OpenAI error ``type``)::

    ProxyError                       (500, "internal_error")
    +-- BadRequest(ValueError)        (400, "invalid_request_error"; ``param`` names the field)
    |   +-- PayloadTooLarge           (413)
    |   +-- UnsupportedMediaType      (415: a body not typed JSON, an encoding not decodable)
    |   +-- ExpectationFailed         (417: an ``Expect`` other than ``100-continue``)
    |   +-- MisdirectedRequest        (421: a ``Host`` this proxy does not answer)
    +-- Forbidden(PermissionError)    (403, "permission_error": a cross-site request)
    +-- RequestTimeout(TimeoutError)  (408, "invalid_request_error": the body stopped coming)
    +-- ClientGone(ConnectionResetError) (499, nginx's "client closed request": the client left
    |                                 while its body was read; the answer reaches no one)
    +-- NotFound(LookupError)         (404, "not_found_error")
    +-- MethodNotAllowed              (405, "invalid_request_error"; an ``Allow`` header)
    +-- Conflict                      (409, "conflict_error": the rollout's lifecycle state)
    +-- Unprocessable                 (422, "invalid_request_error": valid, but not doable)
    +-- Unauthorized                  (401, "authentication_error")
    +-- UpstreamUnavailable           (502, "upstream_error": engine unreachable or broken)
    +-- ServiceUnavailable            (503, "server_error": the store refused the call's
    |                                 record, or failed a read or a lifecycle step;
    |                                 ``Retry-After``)
    |   +-- ReadTimedOut(TimeoutError) (503, code ``read_timeout``: a read of the read API
    |   |                             did not start its answer within ``read_api_timeout_s``)
    |   +-- Stopping                  (503, code ``stopping``: the request came while the
    |                                 proxy stops; nothing was started for it, ``Connection:
    |                                 close``; ``stopping_response``)
    +-- UpstreamTimeout(TimeoutError) (504, "upstream_error")

Every error body has OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``,
unless the handler set ``request[ERROR_SHAPE_KEY]`` to its API's shaper (a front codec's
``error_body``: Anthropic Messages answers ``{"type": "error", "error": {"type", "message"}}``).
What aiohttp rejects before any handler runs gets OpenAI's shape too (see ``proxy.server``).
Every error response made here is logged, one line (4xx at INFO, 5xx at WARNING), since the
access log line of ``dispatch`` is not reached for a request rejected on the way in (a 401, a
413).
Once a response has started streaming, errors can no longer become a status; the stream
handlers deal with those themselves. The core's exceptions (a request that does not parse, a
prompt that does not render, an engine that fails) become client errors in one table,
``CORE_ERRORS``, through ``map_core_errors`` (httpx's ``map_exceptions`` is the model).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

from capture_proxy.core.flow.errors import (
    EngineAnswerUnusable,
    EngineTimedOut,
    EngineUnreachable,
    GenerationAborted,
    PrefillNotSupported,
    StoreUnavailable,
    UnknownPreviousResponse,
)
from capture_proxy.core.fronts import error_front, front_of_tail
from capture_proxy.core.fronts.base import InvalidFrontRequest
from capture_proxy.core.json_bodies import InvalidRequest
from capture_proxy.core.redact import redact_text
from capture_proxy.core.routing import api_path_of
from capture_proxy.core.sampling import SamplingError
from capture_proxy.families.base import RenderError, RendererUnavailable
from capture_proxy.store.base import StoreError

log = logging.getLogger("capture_proxy")


#: Seconds a harness is asked to wait before it retries a call the store refused (a disk
#: freed, a database failed over: seconds to minutes; the SDKs retry twice by default).
STORE_RETRY_AFTER_S = 5


class ProxyError(Exception):
    status = 500
    error_type = "internal_error"
    #: Close the connection after the answer (the request was not read to its end).
    close_connection = False
    #: A ``Retry-After`` header (seconds) on the answer, when a retry may succeed.
    retry_after_s: int | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        #: The stored call this error ended (a failed engine call): its id goes on the answer.
        self.call_id: str | None = None
        #: The body's bytes read (decoded) before this error cut its reading short (a body
        #: timeout, a client gone mid-body); None: the body was read whole, or not at all.
        self.received: int | None = None


class BadRequest(ProxyError, ValueError):
    status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    status = 413


class UnreadableBody(BadRequest):
    """The body broke while it was read (a ``Content-Encoding`` it does not decode as, a
    malformed chunk): nothing after it on the connection can be read as a request."""

    close_connection = True


class UnsupportedMediaType(BadRequest):
    status = 415


class ExpectationFailed(BadRequest):
    status = 417


class MisdirectedRequest(BadRequest):
    status = 421


class Forbidden(ProxyError, PermissionError):
    status = 403
    error_type = "permission_error"


class RequestTimeout(ProxyError, TimeoutError):
    status = 408
    error_type = "invalid_request_error"
    #: The body was not read to its end: the connection cannot carry another request.
    close_connection = True


class ClientGone(ProxyError, ConnectionResetError):
    status = 499
    error_type = "invalid_request_error"
    close_connection = True


class NotFound(ProxyError, LookupError):
    status = 404
    error_type = "not_found_error"


class MethodNotAllowed(ProxyError):
    status = 405
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, allowed: tuple[str, ...], code: str = "method_not_allowed"):
        super().__init__(message, code=code)
        self.allowed = allowed


class Conflict(ProxyError):
    status = 409
    error_type = "conflict_error"


class Unprocessable(ProxyError):
    status = 422
    error_type = "invalid_request_error"


class Unauthorized(ProxyError):
    status = 401
    error_type = "authentication_error"


class UpstreamUnavailable(ProxyError):
    status = 502
    error_type = "upstream_error"


class UpstreamTimeout(ProxyError, TimeoutError):
    status = 504
    error_type = "upstream_error"


class ServiceUnavailable(ProxyError):
    """The proxy cannot serve the call now, and a retry may succeed: ``Retry-After``
    (``retry_after_s``), which the OpenAI and Anthropic SDKs honour (their retries of a 503)."""

    status = 503
    error_type = "server_error"
    retry_after_s = STORE_RETRY_AFTER_S


class ReadTimedOut(ServiceUnavailable, TimeoutError):
    """A read of the read API had not started its answer within its deadline
    (``Settings.read_api_timeout_s``, ``rest.deadline``): the proxy is too busy to answer it now,
    a retry may succeed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="read_timeout")


class Stopping(ServiceUnavailable):
    """The proxy is stopping (SIGTERM or SIGINT: ``proxy.server``): a request that came on a
    connection still open (a kept-alive one) is answered at once and nothing is started for it
    (not forwarded, not recorded); a retry reaches another replica, or this one once it is
    back. The connection closes after the answer."""

    close_connection = True

    def __init__(self) -> None:
        super().__init__(
            "the proxy is stopping: nothing was started for this request; send it again "
            "(another replica, or this proxy once it is back, will answer it)",
            code="stopping",
        )


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


#: The error shaper of a request's API: ``(status, message, *, error_type, param, code)``
#: -> body (a front codec's ``error_body``); absent: OpenAI's shape.
ErrorShape = Callable[..., dict[str, Any]]
ERROR_SHAPE_KEY: web.RequestKey[ErrorShape] = web.RequestKey("error_shape")


def _shape_of_path(request: web.Request) -> ErrorShape | None:
    """The error shape a request's path asks for before any handler ran (a 401 from the auth
    middleware, a 413): an Anthropic client on ``.../v1/messages`` reads Anthropic's shape."""
    # rel_url: the path also of an absolute-form target, without a fragment
    path = api_path_of(request.rel_url.raw_path)
    front = error_front(path) if path is not None else None
    return front.error_body if front is not None else None


def error_response(exc: ProxyError, request: web.Request | None = None) -> web.Response:
    """The client's answer to ``exc``: its API's shape, the message with every URL password
    masked (``core.redact``), an ``Allow`` header for a 405, and ``X-Capture-Call-Id`` when
    the failed call was stored (``exc.call_id``)."""
    shape = None
    if request is not None:
        shape = request.get(ERROR_SHAPE_KEY) or _shape_of_path(request)
    message = redact_text(exc.message)
    if shape is not None:
        body = shape(exc.status, message, error_type=exc.error_type, param=exc.param, code=exc.code)
    else:
        body = error_body(message, exc.error_type, param=exc.param, code=exc.code)
    headers: dict[str, str] = {}
    if isinstance(exc, MethodNotAllowed):
        headers["Allow"] = ", ".join(exc.allowed)
    if exc.call_id is not None:
        headers["X-Capture-Call-Id"] = exc.call_id
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    response = web.json_response(body, status=exc.status, headers=headers or None)
    if exc.close_connection:
        response.force_close()
    return response


def log_rejected(
    request: web.Request,
    status: int,
    what: str | None,
    received: int | None = None,
    *,
    level: int | None = None,
) -> None:
    """One line per error response: method, path, status, what, the body's size (never the
    body, the query or a credential): ``<N bytes in>``, its declared size, or for a body
    whose reading was cut short, ``<K of N bytes in>``: ``received`` (K) of the declared N.
    ``level``: by default WARNING for a 5xx, else INFO."""
    size = request.content_length
    if level is None:
        level = logging.WARNING if status >= 500 else logging.INFO
    declared = size if size is not None else "?"
    if received is None:
        log.log(level, "%s %s -> %d (%s, <%s bytes in>)", request.method, request.path,
                status, what, declared)  # fmt: skip
    else:
        log.log(level, "%s %s -> %d (%s, <%d of %s bytes in>)", request.method, request.path,
                status, what, received, declared)  # fmt: skip


def stopping_response(request: web.Request) -> web.Response:
    """The answer to a request that came while the proxy stops (``Stopping``): 503 with
    ``Retry-After`` and ``Connection: close``, in the shape of the API whose endpoint the path
    names (a capture path, a correlation path or a forwarded one alike: an Anthropic client on
    ``/v1/messages`` reads Anthropic's ``overloaded_error``), else OpenAI's. Logged at INFO:
    answering so is the stop working as meant, not a failure."""
    exc = Stopping()
    front = front_of_tail(request.rel_url.path)
    if front is not None:
        request[ERROR_SHAPE_KEY] = front.error_body
    log_rejected(request, exc.status, exc.code, level=logging.INFO)
    return error_response(exc, request)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The single place where exceptions become client responses."""
    try:
        return await handler(request)
    except ProxyError as exc:
        # A 4xx message may quote the body; its code says what without it.
        what = exc.message if exc.status >= 500 else exc.code or exc.error_type
        log_rejected(request, exc.status, what, exc.received)
        return error_response(exc, request)
    except StoreError as exc:
        if type(exc) is not StoreError:  # its subclasses are answers the handlers give
            raise
        # The store failed (a full disk, a database that refuses writes or is gone): a retry
        # may succeed, not a bug of the proxy's.
        unavailable = ServiceUnavailable(
            f"the capture store failed: {exc}", code="store_unavailable"
        )
        log_rejected(request, unavailable.status, unavailable.message)
        return error_response(unavailable, request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        log_rejected(request, exc.status, exc.reason)
        allow = exc.headers.get("Allow")
        return web.json_response(
            error_body(
                exc.reason, "invalid_request_error" if exc.status < 500 else "internal_error"
            ),
            status=exc.status,
            headers={"Allow": allow} if allow is not None else None,
        )
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.json_response(error_body("internal proxy error", "internal_error"), status=500)


#: Take the core exception's own attribute (``code`` / ``param``) in ``CORE_ERRORS``.
OWN = object()

#: The core's exceptions -> the client's error: (core class, client class, code, param), the
#: first matching row wins (a subclass before its base). ``OWN``: the exception's attribute.
#: The one place a core error becomes a status, an error type, a code and a param.
CORE_ERRORS: tuple[tuple[type[Exception], type[ProxyError], Any, Any], ...] = (
    (InvalidRequest, BadRequest, "invalid_request", OWN),
    (InvalidFrontRequest, BadRequest, "invalid_request", OWN),
    (SamplingError, BadRequest, "invalid_request", OWN),
    (PrefillNotSupported, BadRequest, OWN, "messages"),
    (UnknownPreviousResponse, BadRequest, OWN, "previous_response_id"),
    (RendererUnavailable, UpstreamUnavailable, "engine_unreachable", None),
    (RenderError, BadRequest, "render_failed", "messages"),
    (EngineTimedOut, UpstreamTimeout, OWN, None),
    (EngineUnreachable, UpstreamUnavailable, OWN, None),
    (EngineAnswerUnusable, UpstreamUnavailable, OWN, None),
    (GenerationAborted, ServiceUnavailable, OWN, None),
    (StoreUnavailable, ServiceUnavailable, OWN, None),
)
_CORE_TYPES = tuple(row[0] for row in CORE_ERRORS)


def client_error(exc: Exception) -> ProxyError:
    """The client's error for a core exception (a row of ``CORE_ERRORS``); the stored call it
    ended (``call_id``) goes with it. Raises LookupError for an exception of no row."""
    for core_type, client_type, code, param in CORE_ERRORS:
        if isinstance(exc, core_type):
            err = client_type(
                getattr(exc, "message", None) or str(exc),
                code=getattr(exc, "code", None) if code is OWN else code,
                param=getattr(exc, "param", None) if param is OWN else param,
            )
            err.call_id = getattr(exc, "call_id", None)
            return err
    raise LookupError(f"no client error for {type(exc).__name__}")


@contextmanager
def map_core_errors() -> Iterator[None]:
    """Raise the client's error (``CORE_ERRORS``) for a core exception raised inside
    (httpx's ``map_exceptions``); a ``ProxyError`` and anything else go through."""
    try:
        yield
    except ProxyError:
        raise
    except _CORE_TYPES as exc:
        raise client_error(exc) from exc
