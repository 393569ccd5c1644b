"""The upstream (engine) side: one client session, header hygiene, error translation.

Owns the aiohttp ClientSession with every default that bites a proxy set explicitly
(connection limit, keep-alive below the engine's, no total timeout, no auto-decompression for
pass-through bytes) and the translation of aiohttp client exceptions into ``ProxyError``s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import aiohttp
from multidict import CIMultiDict

from capture_proxy.config import Settings
from capture_proxy.core.redact import redact_text
from capture_proxy.proxy.engines import routing_key_middleware
from capture_proxy.proxy.errors import ProxyError, UpstreamTimeout, UpstreamUnavailable

# RFC 9110 7.6.1 hop-by-hop headers, plus those aiohttp must recompute for the new message.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def make_client_session(settings: Settings) -> aiohttp.ClientSession:
    """The proxy's single upstream session (create inside a running loop)."""
    connector = aiohttp.TCPConnector(
        limit=settings.upstream_connection_limit,
        limit_per_host=0,
        keepalive_timeout=settings.upstream_keepalive_timeout_s,
        ttl_dns_cache=300,
    )
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=None,
        sock_connect=settings.upstream_connect_timeout_s,
        sock_read=settings.upstream_read_timeout_s,
    )
    auth = settings.backend_auth_header
    # The routing key (one header) on every engine request made while serving a rollout.
    middlewares = (
        (routing_key_middleware(settings.routing_key_header),)
        if settings.routing_key != "none"
        else ()
    )
    return aiohttp.ClientSession(
        middlewares=middlewares,
        # The engine's credential on every request the proxy makes itself (/tokenize,
        # /v1/models, tokens-in); forwarded requests carry it from the auth middleware.
        headers={"Authorization": auth} if auth is not None else None,
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        raise_for_status=False,
        # The proxy forwards the harness's headers; no cookie jar may leak between rollouts.
        cookie_jar=aiohttp.DummyCookieJar(),
    )


@functools.cache
def _captured_call_timeout(
    connect_s: float, read_s: float | None
) -> aiohttp.ClientTimeout | None:
    if read_s is None:
        return None
    return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_s, sock_read=None)


def captured_call_timeout(settings: Settings) -> aiohttp.ClientTimeout | None:
    """The timeout of a captured call's engine requests when ``upstream_read_timeout_s`` is set:
    the session's without the read timeout, which the call's executor applies itself (it
    does not cut a stream the engine holds while paused); None: the session's."""
    return _captured_call_timeout(
        settings.upstream_connect_timeout_s, settings.upstream_read_timeout_s
    )


def forwardable_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], *, drop: Iterable[str] = ()
) -> CIMultiDict[str]:
    """Copy headers without hop-by-hop ones (and those named by the Connection header)."""
    items = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    extra_drop = {d.lower() for d in drop}
    for name, value in items:
        if name.lower() == "connection":
            extra_drop.update(v.strip().lower() for v in value.split(","))
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in items:
        lowered = name.lower()
        if lowered in HOP_BY_HOP or lowered in extra_drop:
            continue
        out.add(name, value)
    return out


def forwardable_header_dict(headers: Mapping[str, str], drop: frozenset[str]) -> dict[str, str]:
    """``dict(forwardable_headers(headers, drop=drop))`` in one pass over the headers (runs on
    every captured call): ``drop`` holds lower-case names and includes ``HOP_BY_HOP``. As the
    dict of the multidict (multidict 7): one header per case-insensitive name, in first-seen
    order, its first spelling with its first value."""
    lowered = [(name.lower(), name, value) for name, value in headers.items()]
    for low, _, value in lowered:
        if low == "connection":
            drop = drop | {v.strip().lower() for v in value.split(",")}
    seen: set[str] = set()
    out: dict[str, str] = {}
    for low, name, value in lowered:
        if low not in drop and low not in seen:
            seen.add(low)
            out[name] = value
    return out


def translate_client_error(
    exc: BaseException, backend: str, *, fixed_s: float | None = None
) -> ProxyError:
    """Map an aiohttp client failure to the error the harness receives. ``backend`` is the
    credential-free base (``Settings.backend_base``); the exception's text is masked too. A
    timeout names what timed out and its setting (``timeout_text``; ``fixed_s``: the request's
    own bound, when it is no setting)."""
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamTimeout(
            f"engine at {backend} timed out: {timeout_text(exc, fixed_s)}", code="engine_timeout"
        )
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamUnavailable(
            redact_text(f"engine at {backend} is unreachable: {exc.os_error.strerror or exc}"),
            code="engine_unreachable",
        )
    return UpstreamUnavailable(
        redact_text(f"engine at {backend} failed: {type(exc).__name__}: {exc}"),
        code="engine_error",
    )


CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def timeout_text(exc: BaseException, fixed_s: float | None = None) -> str:
    """What timed out, naming the setting that bounds it: the text of a ``TimeoutError`` the
    proxy raised with it (``upstream_first_byte_timeout_s``, ``upstream_read_timeout_s``),
    aiohttp's connect and socket-read timeouts by their settings, else ``fixed_s``, a bound
    that is no setting, or the exception's own text."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "no connection in time (setting upstream_connect_timeout_s)"
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return "no bytes in time (setting upstream_read_timeout_s)"
    if str(exc):
        return str(exc)
    if fixed_s is not None:
        return f"no answer within {fixed_s:g} s (a fixed bound, no setting)"
    return type(exc).__name__


def first_byte_timeout(timeout_s: float) -> TimeoutError:
    """The error of an engine that sent no response head within ``timeout_s``."""
    return TimeoutError(
        f"no response head within {timeout_s:g} s (setting upstream_first_byte_timeout_s)"
    )


#: Failures before anything was sent: a retry cannot duplicate work on the engine.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
CONNECT_BACKOFF_S = 0.2


#: Bodies above this are written in pieces (aiohttp's ``TOO_LARGE_BYTES_BODY``, 1 MiB: it warns
#: that writing more at once may hold the event loop; a request with images often is larger).
LARGE_BODY_BYTES = 1 << 20


def _streamed_body(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with a ``data`` body above ``LARGE_BODY_BYTES`` as a fresh ``io.BytesIO``
    (aiohttp writes it 64 KiB at a time, yielding between pieces; fresh per attempt, since a
    payload is closed once sent)."""
    data = kwargs.get("data")
    if isinstance(data, bytes | bytearray) and len(data) > LARGE_BODY_BYTES:
        return {**kwargs, "data": io.BytesIO(data)}
    return kwargs


async def send_upstream(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    first_byte_timeout_s: float | None,
    connect_retries: int = 0,
    still_waiting: Callable[[], Awaitable[bool]] | None = None,
    **kwargs: Any,
) -> aiohttp.ClientResponse:
    """Send a request and wait for the response headers, at most ``first_byte_timeout_s``
    (None: no limit), and longer for as long as ``still_waiting()`` says so when asked at each
    timeout (the engine holds the request while paused for a weight update). A connection
    that cannot be made is retried ``connect_retries`` times with exponential backoff (under
    load an engine's listen queue overflows; the verifiers report of 1,024 rollouts failing
    on a 5 s connect timeout). The caller owns the response (``async with``). Raises
    CLIENT_ERRORS."""

    async def attempt() -> aiohttp.ClientResponse:
        for retry in range(connect_retries + 1):
            try:
                return await session.request(method, url, **_streamed_body(kwargs))
            except CONNECT_ERRORS:
                if retry == connect_retries:
                    raise
                await asyncio.sleep(CONNECT_BACKOFF_S * 2**retry)
        raise AssertionError("unreachable")

    if first_byte_timeout_s is None:
        return await attempt()
    if still_waiting is None:
        try:
            async with asyncio.timeout(first_byte_timeout_s):
                return await attempt()
        except aiohttp.ServerTimeoutError:
            raise
        except TimeoutError as exc:
            raise first_byte_timeout(first_byte_timeout_s) from exc
    return await _patiently(attempt(), first_byte_timeout_s, still_waiting)


async def _patiently(
    sent: Awaitable[aiohttp.ClientResponse],
    timeout_s: float,
    still_waiting: Callable[[], Awaitable[bool]],
) -> aiohttp.ClientResponse:
    """``sent``'s response within ``timeout_s``, renewed while ``still_waiting()``. Raises
    TimeoutError and what ``sent`` raises."""
    task = asyncio.ensure_future(sent)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if done:
                return task.result()
            if not await still_waiting():
                raise first_byte_timeout(timeout_s)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, *CLIENT_ERRORS):
                late = await task
                late.close()
