"""The request policy: what a request must be before any handler looks at it.

Owns the checks that keep a proxy on a shared machine (or under an operator's browser) safe,
in this order, each answered in the request's API error shape (``errors.error_middleware``)
and nothing forwarded or stored:

- the request target is origin-form (``/path?query``): an absolute-form target
  (``POST http://host/...``) or one carrying a ``#`` fragment is a 400
  (``invalid_request_target``), since the proxy would route one path and the engine another;
- the ``Host`` is one this proxy answers (``Settings.allowed_hosts``; by default loopback
  names, the listen host and IP address literals): else 421 (``host_not_allowed``), so a
  DNS-rebinding page cannot reach the proxy under its own name;
- a request with an ``Origin`` comes from this proxy's own origin (the viewer's pages): else
  403 (``cross_origin_request``), so no other page can freeze, delete or inject through the
  browser, even with a body-less ``fetch``;
- a body sent to a model API (``/ng-rollout/...``) or the read API (``/captures/...``, not the
  viewer's login form) is typed JSON (``application/json``, ``application/*+json``): else
  415 (``unsupported_media_type``): HTML forms and ``text/plain`` bodies are what browsers
  send cross-site without asking;
- a ``Content-Encoding`` body is one aiohttp decodes (``gzip``, ``deflate``, raw deflate): it is
  decoded, and the header dropped before anyone forwards it; an undecodable body is a 400
  (``body_not_decodable``, one INFO line, and the connection closed: the rest of it cannot be
  parsed); another encoding a 415 (``unsupported_content_encoding``);
- the body arrives within ``client_body_timeout_s``: else 408 (``request_timeout``) and the
  connection is closed; a client that leaves mid-body is one log line (499,
  ``client_gone``). (A request head that never ends is aiohttp's ``keepalive_timeout``,
  ``Settings.server_kwargs``.)

Runs inside the auth middleware (aiohttp refuses to clone a request whose body was read).
Must not: parse a body's JSON, know an API's fields, or touch the store.
"""

from __future__ import annotations

import asyncio
import ipaddress
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from capture_proxy.config import Settings
from capture_proxy.proxy.errors import (
    BadRequest,
    ClientGone,
    ExpectationFailed,
    Forbidden,
    Handler,
    MisdirectedRequest,
    PayloadTooLarge,
    ProxyError,
    RequestTimeout,
    UnreadableBody,
    UnsupportedMediaType,
    log_rejected,
)

#: Encodings aiohttp's request parser decodes (``http_parser``; ``br`` and ``zstd`` only with
#: optional libraries, which the proxy does not install).
DECODED_ENCODINGS = frozenset({"gzip", "deflate"})
#: Paths whose bodies must be JSON: the model APIs and the read API.
JSON_BODY_PREFIXES = ("/ng-rollout/", "/captures/", "/captures")
#: The viewer's login form posts a form (same origin, checked by ``Origin``).
FORM_PATHS = ("/captures/ui/login",)
LOOPBACK_NAMES = frozenset({"localhost"})


def host_name(host_header: str) -> str:
    """The name or address of a ``Host`` value without its port, lower case, without a
    trailing dot: ``[::1]:80`` -> ``::1``, ``Example.COM.:8080`` -> ``example.com``."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which ``Host`` names this proxy answers (see ``Settings.allowed_hosts``)."""

    def __init__(self, listen_host: str, allowed_hosts: list[str] | None) -> None:
        extra = [host_name(h) for h in allowed_hosts or []]
        self.any = "*" in (allowed_hosts or [])
        self.names = LOOPBACK_NAMES | {host_name(listen_host)} | set(extra)

    def allows(self, host_header: str) -> bool:
        if self.any:
            return True
        name = host_name(host_header)
        # A DNS-rebinding page always reaches the proxy under a name: an address is safe.
        return name in self.names or _is_ip_literal(name)


def _check_target(request: web.Request) -> None:
    raw = request.raw_path
    if not raw.startswith("/") or "#" in raw:
        raise BadRequest(
            "the request target must be a path (origin-form, '/...'), without a '#' fragment "
            "or a scheme and host",
            param="path",
            code="invalid_request_target",
        )


def _check_host(request: web.Request, hosts: HostPolicy) -> None:
    host = request.headers.get("Host")
    if host is not None and not hosts.allows(host):
        raise MisdirectedRequest(
            f"this proxy does not answer for Host {host_name(host)!r}: add it to the "
            "allowed_hosts setting (--allowed-host) to reach the proxy under that name",
            param="Host",
            code="host_not_allowed",
        )


def _check_origin(request: web.Request) -> None:
    origin = request.headers.get("Origin")
    if origin is None:
        return
    parts = urlsplit(origin)
    own = request.headers.get("Host", "").lower()
    if origin == "null" or not parts.netloc or parts.netloc.lower() != own:
        raise Forbidden(
            "cross-origin request refused: the Origin header names another site than this "
            "proxy (only its own pages, or clients that send no Origin, may call it)",
            param="Origin",
            code="cross_origin_request",
        )


def _wants_json(request: web.Request) -> bool:
    path = request.path
    return (
        request.method in ("POST", "PUT", "PATCH")
        and request.body_exists
        and (path == "/captures" or path.startswith(JSON_BODY_PREFIXES))
        and path not in FORM_PATHS
    )


def _is_json_type(content_type: str) -> bool:
    kind, _, sub = content_type.partition("/")
    return kind == "application" and (sub == "json" or sub.endswith("+json"))


def _check_content_type(request: web.Request) -> None:
    if not _wants_json(request):
        return
    given = request.headers.get("Content-Type")
    if given is None or not _is_json_type(request.content_type):
        raise UnsupportedMediaType(
            f"request bodies here must be JSON (Content-Type: application/json), got "
            f"{given or 'no Content-Type'}",
            param="Content-Type",
            code="unsupported_media_type",
        )


def _check_length(request: web.Request) -> None:
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes "
            "(setting max_request_body_bytes)",
            code="request_too_large",
        )


def _check_expect(request: web.Request) -> None:
    expect = request.headers.get("Expect")
    if expect is not None and expect.lower() != "100-continue":
        raise ExpectationFailed(
            f"Expect: {expect[:64]!r} is not supported (only 100-continue)",
            param="Expect",
            code="expectation_failed",
        )


def _decoded_request(request: web.Request) -> web.Request:
    """The request, without a ``Content-Encoding`` that aiohttp decodes as it reads (the
    bytes handlers see, record and forward are the decoded ones). Raises
    UnsupportedMediaType for an encoding it does not decode."""
    encoding = request.headers.get("Content-Encoding")
    if encoding is None or encoding.strip().lower() in ("", "identity"):
        return request
    if encoding.strip().lower() not in DECODED_ENCODINGS:
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding[:64]!r} is not supported: send the body plain, or "
            "gzip or deflate encoded",
            param="Content-Encoding",
            code="unsupported_content_encoding",
        )
    headers = CIMultiDict(request.headers)
    headers.popall("Content-Encoding")
    headers.popall("Content-Length", None)
    return request.clone(headers=headers)


def _cut_short(err: ProxyError, request: web.Request) -> ProxyError:
    """``err``, knowing the body's bytes that arrived before its reading stopped (its log
    line says them, not the declared length)."""
    err.received = request.content.total_bytes
    return err


async def _read_body(request: web.Request, timeout_s: float) -> None:
    """Read the body into the request (aiohttp keeps it: handlers' ``read()`` returns it)."""
    limit = request.client_max_size
    try:
        if request.content.is_eof():
            # The whole body has arrived (a small one comes with the request head): ``read``
            # takes it without waiting, so there is nothing to time out (a timer per request
            # is not free).
            await request.read()
        else:
            async with asyncio.timeout(timeout_s):
                await request.read()
    except TimeoutError as exc:
        raise _cut_short(
            RequestTimeout(
                f"the request body did not arrive within {timeout_s:g} s (setting "
                "client_body_timeout_s)",
                param="body",
                code="request_timeout",
            ),
            request,
        ) from exc
    except asyncio.CancelledError:
        # The client left and the server cancels its handler (handler_cancellation): the same
        # one line as a reset, then the cancellation goes on.
        log_rejected(request, ClientGone.status, "client_gone", request.content.total_bytes)
        raise
    except ConnectionResetError as exc:
        # The client left mid-body: one log line (the error middleware's), no traceback.
        raise _cut_short(
            ClientGone(
                "the client closed the connection while sending its body",
                param="body",
                code="client_gone",
            ),
            request,
        ) from exc
    except web.HTTPRequestEntityTooLarge as exc:
        raise _cut_short(
            PayloadTooLarge(
                f"request body exceeds the limit of {limit} bytes (setting max_request_body_bytes)",
                code="request_too_large",
            ),
            request,
        ) from exc
    except (ContentEncodingError, RequestPayloadError) as exc:
        # aiohttp's parser decodes as it reads; a failure reaches the reader wrapped, and
        # stays on the body's stream. After the answer, aiohttp's server reads what is left
        # of an unfinished body (its lingering close) and met that error again: an "Unhandled
        # exception" traceback at ERROR for a client's bad body. The body is over (nothing
        # more is parsed from this connection): end its stream, and the connection closes.
        request.content.feed_eof()
        cause = exc if isinstance(exc, ContentEncodingError) else exc.__cause__
        if isinstance(cause, ContentEncodingError):
            raise UnreadableBody(
                "the request body cannot be decoded as its Content-Encoding says",
                param="Content-Encoding",
                code="body_not_decodable",
            ) from exc
        raise UnreadableBody(
            f"the request body could not be read: {exc}", param="body", code="invalid_body"
        ) from exc


def policy_middleware(settings: Settings) -> Middleware:
    """The request policy (see the module docstring) for one app."""
    hosts = HostPolicy(settings.host, settings.allowed_hosts)

    @web.middleware
    async def policy(request: web.Request, handler: Handler) -> web.StreamResponse:
        _check_target(request)
        _check_host(request, hosts)
        _check_origin(request)
        _check_expect(request)
        _check_length(request)
        _check_content_type(request)
        if request.body_exists:
            request = _decoded_request(request)
            await _read_body(request, settings.client_body_timeout_s)
        return await handler(request)

    return policy


async def expect_continue(request: web.Request) -> None:
    """Every route's ``Expect`` handler: ``100-continue`` as aiohttp answers it; anything
    else passes to the policy middleware, which answers a 417 in the API's error shape
    (aiohttp's own handler answers plain text before any middleware runs)."""
    expect = request.headers.get("Expect", "")
    if expect.lower() == "100-continue" and request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0


def use_expect_continue(app: web.Application) -> None:
    """Give every route of ``app`` ``expect_continue`` (call after the last route is added).
    aiohttp takes the handler per route (``add_route(expect_handler=)``); set here once."""
    for route in app.router.routes():
        route._expect_handler = expect_continue  # type: ignore[attr-defined]
