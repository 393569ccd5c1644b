"""Sending the read API's answers: a started answer whose client stops taking its bytes is cut.

Owns the bound on each write of a read's answer (``Settings.read_send_timeout_s``, nginx's
``send_timeout``) and the middleware that applies it to every read under ``/captures``
(``deadline.is_bounded_read``). ``rest.deadline`` bounds a read until its answer starts; after
that, aiohttp's writes wait for the socket to drain with no bound of their own, so a client
that stops reading (or reads a byte a minute) would hold the connection, the handler and the
bytes handed to the socket for ever.

What is bounded is each wait for the client, not the whole answer: a trainer may take a large
export over a long time. Bytes go to the socket in slices of ``SLICE_BYTES``; a write waits
while asyncio holds more than its high-water mark (64 KiB) for the socket, until it holds less
than the low-water mark (16 KiB), so a client that takes 128 KiB within each
``read_send_timeout_s`` is never cut.

- A stream (the bulk export) writes through ``send`` and ends with ``end``.
- A whole answer a handler returns (``web.Response``: JSON, npz, tree, ATIF, images, viewer
  pages) to a ``GET`` is sent here the same way, as a ``StreamResponse`` with its status,
  headers, cookies and ``Content-Length``: aiohttp would write it in one piece and wait for
  the socket without a bound, after the handler has returned.
- Left to aiohttp: the viewer's static files (``web.FileResponse``, a few KiB, handed to the
  socket at once) and ``HEAD`` answers (headers only).

When a wait runs out, the answer is cut: the connection is aborted (what the socket had not
taken is dropped; the client sees the answer end early: the export without Arrow's
end-of-stream marker, which every reader reports as an error, a whole answer short of its
``Content-Length``), one WARNING line names the read (method and path, never the query, as the
access line) and ``capture_proxy_read_answers_cut_total`` counts it (in the proxy's app; the
read-only app has no metrics); the handler ends there and nothing else is touched. A client
that leaves mid-answer ends it the same way, with one INFO line and no traceback.
Must not: bound anything but reads under ``/captures``: the captured calls
(``/ng-rollout/...``) have their own rules.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from capture_proxy.proxy.metrics import METRICS_KEY
from capture_proxy.rest.deadline import is_bounded_read

log = logging.getLogger("capture_proxy")

#: The read's send timeout (seconds), set by the middleware for ``send`` and ``end``.
SEND_TIMEOUT_KEY: web.RequestKey[float] = web.RequestKey("read_send_timeout_s")

#: Bytes handed to a write at a time: the unit of progress a client must make in time.
SLICE_BYTES = 64 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AnswerCut(Exception):
    """A read's started answer ended early: its client did not take its bytes in time (the
    connection aborted here) or left; the middleware hands ``response`` back to aiohttp, which
    finds the connection closed and writes nothing more."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("answer cut: its client did not take its bytes in time, or left")
        self.response = response


async def send(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    """Write ``data`` to the started ``response``, each slice's wait for the client bounded by
    the read's send timeout; raises ``AnswerCut`` when one runs out or the client has left."""
    view = memoryview(data)
    for start in range(0, len(view), SLICE_BYTES):
        piece = view[start : start + SLICE_BYTES]
        await _bounded(request, response, functools.partial(response.write, piece))


async def end(request: web.Request, response: web.StreamResponse) -> None:
    """End the started ``response`` (``write_eof``, which waits for the socket too), bounded
    like ``send``."""
    await _bounded(request, response, response.write_eof)


async def _bounded(
    request: web.Request, response: web.StreamResponse, write: Callable[[], Awaitable[None]]
) -> None:
    timeout_s = request[SEND_TIMEOUT_KEY]
    try:
        async with asyncio.timeout(timeout_s):
            await write()
    except TimeoutError:
        _cut(request, timeout_s)
        raise AnswerCut(response) from None
    except ConnectionError:
        # A client leaving is no error of the proxy's: one line, no traceback (aiohttp's own
        # way with a whole answer it sends).
        log.info("%s %s: the client left before the answer ended", request.method, request.path)
        raise AnswerCut(response) from None


def _cut(request: web.Request, timeout_s: float) -> None:
    """Abort the read's connection (``close`` would wait for the client to take what is
    queued), log it and count it."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    log.warning(
        "%s %s: answer cut, the client did not take its bytes within %g s "
        "(read_send_timeout_s); connection closed",
        request.method,
        request.path,
        timeout_s,
    )
    metrics = request.app.get(METRICS_KEY)
    if metrics is not None:
        metrics.read_answers_cut.inc()


def read_send_middleware(timeout_s: float) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware (inside the read deadline's) bounding each wait of a read's answer
    (``is_bounded_read``) for its client to ``timeout_s``: a stream's through ``send`` and
    ``end``, a whole answer's as it sends it (``_send_whole``)."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")

    @web.middleware
    async def read_send(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_bounded_read(request):
            return await handler(request)
        request[SEND_TIMEOUT_KEY] = timeout_s
        try:
            response = await handler(request)
            if request.method == "GET" and _is_whole(response):
                assert isinstance(response, web.Response)
                return await _send_whole(request, response)
            return response
        except AnswerCut as cut:
            return cut.response

    return read_send


def _is_whole(response: web.StreamResponse) -> bool:
    """A whole answer not yet started whose bytes are at hand (not a file, not compressed)."""
    return (
        isinstance(response, web.Response)
        and not response.prepared
        and not response.compression
        and isinstance(response.body, bytes)
    )


async def _send_whole(request: web.Request, whole: web.Response) -> web.StreamResponse:
    """Send ``whole`` as a stream of its bytes (``send``), with its status, headers, cookies
    and ``Content-Length``."""
    body = whole.body
    assert isinstance(body, bytes)
    response = web.StreamResponse(status=whole.status, reason=whole.reason, headers=whole.headers)
    response.content_length = len(body)
    for name, morsel in whole.cookies.items():
        response.cookies[name] = morsel
    if whole.keep_alive is False:
        response.force_close()
    await response.prepare(request)
    await send(request, response, body)
    await end(request, response)
    return response
