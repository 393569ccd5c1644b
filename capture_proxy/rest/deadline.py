"""The read API's deadline: every read starts its answer within ``Settings.read_api_timeout_s``, or
is answered ``503`` (``read_timeout``, ``Retry-After``) instead of hanging.

Owns the middleware that bounds each ``GET``/``HEAD`` under ``/captures`` (the read API, the
exports, the images, the viewer) and the lifting of its deadline once the answer has started.
On a busy proxy a read waits for the store's reader thread, the REST thread and, after each
hop, for the event loop, which relays every stream first (``benchmarks/reads_under_load.py``);
none of these waits has a bound of its own.

What a read that runs out of time leaves behind: its coroutine is cancelled at the await it
was in. A store read the reader thread has not taken yet is dropped unrun
(``WorkerThread.run_unless_abandoned``), a REST-thread job not started is cancelled with its
future (``run_in_executor``); a job already running ends and its outcome is discarded. No
connection changes hands (each is its thread's) and a read transaction ends in the job that
began it, so the store is as before. A read that timed out thus queues no more work and holds
none that has not started.

Once the answer has started (``on_response_prepare``: its status and headers are being sent),
the deadline is lifted: a status can no longer change. A stream (the bulk export) is then
bounded by its page (``limit``, at most 1,000 rollouts), each rollout's work a job on the REST
thread, and by ``rest.sending``: each wait of a write for the client to take bytes, a whole
answer's too, lasts at most ``read_send_timeout_s``, or the answer is cut and its connection
closed (a client that stops reading, or reads a byte a minute, holds nothing for longer); a
client that has gone ends the stream at the next write. Must not: decide what a read answers
(the handlers do) or touch requests other than reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from capture_proxy.proxy.errors import ReadTimedOut

#: The request's deadline while it runs (``asyncio.Timeout``), lifted once its answer starts.
DEADLINE_KEY: web.RequestKey[asyncio.Timeout] = web.RequestKey("read_deadline")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_bounded_read(request: web.BaseRequest) -> bool:
    """A read of ``/captures`` (the read API, its exports and images, the viewer)."""
    path = request.path
    return request.method in ("GET", "HEAD") and (
        path == "/captures" or path.startswith("/captures/")
    )


def read_deadline_middleware(timeout_s: float) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware (inside the error middleware, which answers ``ReadTimedOut``) bounding
    each read (``is_bounded_read``) to ``timeout_s`` until its answer starts."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")

    @web.middleware
    async def read_deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_bounded_read(request):
            return await handler(request)
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                request[DEADLINE_KEY] = deadline  # while the handler runs (``lift_deadline``)
                try:
                    return await handler(request)
                finally:
                    del request[DEADLINE_KEY]
        except TimeoutError:
            if not deadline.expired():
                raise  # a timeout of the handler's own
            raise ReadTimedOut(
                f"{request.method} {request.path} did not start its answer within "
                f"{timeout_s:g} s (read_api_timeout_s): the proxy is busy; retry later"
            ) from None

    return read_deadline


async def lift_deadline(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the answer starts, its read's deadline is lifted (a response
    the handler returned is prepared after the deadline ended: nothing to lift)."""
    deadline = request.get(DEADLINE_KEY)
    if deadline is not None and not deadline.expired():
        deadline.reschedule(None)


def bound_reads(app: web.Application) -> None:
    """Lift each read's deadline as its answer starts (``lift_deadline``); the middleware
    (``read_deadline_middleware``) is the app's, given when it is built."""
    app.on_response_prepare.append(lift_deadline)
