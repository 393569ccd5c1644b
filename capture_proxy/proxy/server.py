"""The HTTP server around the proxy app: runner, listening socket, protocol-level errors.

Owns what happens before a request reaches the app. aiohttp rejects a request it cannot parse
(a request line or header past ``max_line_size`` / ``max_field_size``, 8190 bytes; a malformed
header) in its protocol handler, before any middleware runs, with a plain-text 400 and an
ERROR traceback in the log. Here that answer has OpenAI's error shape like every other client
error, and it is logged as one INFO line (a client's mistake is not the proxy's error).

The stop (SIGINT, SIGTERM: aiohttp's ``GracefulExit``, then ``AppRunner.cleanup``), in order:
the listening socket is closed (new connections are refused; ``serve --workers``: each
worker's and the supervisor's copy); a request that comes on a connection still open (a
harness's kept-alive one) is answered 503 ``stopping`` with ``Retry-After`` and ``Connection:
close`` in its API's error shape (``errors.stopping_response``) and nothing is started for it;
a whole answer finished during the stop says ``Connection: close``; the app's ``on_shutdown``
lets the calls in flight finish, their records stored before their answers end, at most
``shutdown_timeout_s`` (``proxy.stopping``); then every connection is closed, the idle ones at
once (a FIN), the others once their request is done (aiohttp's ``shutdown_timeout``).
aiohttp alone closes the connections before ``on_shutdown``: an idle connection then ignored
what came on it and was closed after the calls in flight, so the harness got no answer.

``run`` is ``web.run_app`` for one bound socket, with this handler, and a callback once the
socket listens (the store is open by then), so start-up prints and writes its port only when
clients can connect. The only aiohttp internals touched: the runner's server and each
connection's handler get this module's subclasses (``__class__``), and the server's request
handler is wrapped (``JsonErrorServer.answering_the_stop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_log import AccessLogger
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_runner import GracefulExit
from aiohttp.web_server import Server

from capture_proxy.proxy.errors import error_body, stopping_response
from capture_proxy.proxy.policy import DECODED_ENCODINGS

log = logging.getLogger("capture_proxy")


def protocol_error_response(status: int, exc: BaseException | None) -> web.Response:
    """The JSON answer to a request aiohttp could not parse (``status`` from its parser), in
    OpenAI's shape whatever the path (aiohttp gives no path for a request it cannot read).
    ``param``: ``headers`` (or ``Content-Encoding``). The connection closes after it."""
    if status >= 500:
        body = error_body("internal proxy error", "internal_error")
    elif isinstance(exc, ContentEncodingError) and _names_decoded_encoding(exc):
        # A gzip or deflate body that does not decode where the parser checks it (a deflate
        # stream cut short is found at the body's end): the policy's 400, as when the failure
        # comes while the body is read.
        body = error_body(
            "the request body cannot be decoded as its Content-Encoding says",
            "invalid_request_error",
            param="Content-Encoding",
            code="body_not_decodable",
        )
    elif isinstance(exc, ContentEncodingError):
        # The parser refuses an encoding it has no decoder for (br, zstd) on the headers.
        body = error_body(
            "this Content-Encoding is not supported: send the body plain, or gzip or "
            "deflate encoded",
            "invalid_request_error",
            param="Content-Encoding",
            code="unsupported_content_encoding",
        )
        status = 415
    else:
        if isinstance(exc, LineTooLong):
            # aiohttp's message quotes the line (perhaps a credential): say only how long.
            limit = exc.message.split(" when reading", 1)[0].removeprefix("Got ")
            message = f"the request line or a header field is too long (got {limit})"
            code = "request_line_or_header_too_long"
        else:
            detail = exc.message if isinstance(exc, HttpProcessingError) else str(exc or "")
            message, code = f"malformed HTTP request: {detail or 'bad request'}", "bad_request"
        # The request line or a header is what could not be read (the path is not known
        # here, so the shape is OpenAI's on every path).
        body = error_body(message, "invalid_request_error", param="headers", code=code)
    resp = web.json_response(body, status=status)
    resp.force_close()
    return resp


def _names_decoded_encoding(exc: ContentEncodingError) -> bool:
    """Whether aiohttp's message names an encoding it decodes (``Can not decode
    content-encoding: gzip``, or ``deflate`` alone for a deflate stream cut short), not one
    it has no decoder for (``... brotli (br). Please install ...``)."""
    named = exc.message.rpartition(":")[2].strip().lower()
    return named in DECODED_ENCODINGS


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol handler, answering its own errors as JSON."""

    __slots__ = ()  # same layout as RequestHandler (set via __class__ by JsonErrorServer)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        response = protocol_error_response(status, exc)
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            log.info(
                "rejected a malformed request from %s -> %d (%s)",
                request.remote,
                response.status,
                type(exc).__name__ if exc is not None else "bad request",
            )
        if request.writer.output_size > 0:  # as aiohttp: a started response cannot change
            raise ConnectionError(
                "Response is sent already, cannot send another response with the error message"
            )
        return response


RequestAnswer = Callable[[BaseRequest], Awaitable[web.StreamResponse]]


class JsonErrorServer(Server):
    """aiohttp's low-level server, making ``JsonErrorRequestHandler`` connections, and
    answering the requests that come while the proxy stops (see the module's docstring)."""

    #: The stop has begun (``ProxyRunner.cleanup``, ``pre_shutdown``): requests are answered
    #: ``stopping_response``.
    stopping = False
    #: Requests answered so during the stop.
    answered_stopping = 0

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = JsonErrorRequestHandler
        return handler

    def answering_the_stop(self, answer: RequestAnswer) -> RequestAnswer:
        """``answer`` (the app's), or once the stop has begun, the 503 ``stopping`` answer;
        a whole answer of a request begun before the stop and finished after it closes its
        connection (``Connection: close``: its harness opens a new one, which is refused,
        rather than send on one about to close)."""

        async def answer_or_refuse(request: BaseRequest) -> web.StreamResponse:
            if self.stopping:
                self.answered_stopping += 1
                assert isinstance(request, web.Request)  # the app runner's request factory
                return stopping_response(request)
            response = await answer(request)
            if self.stopping and not response.prepared:
                response.force_close()
            return response

        return answer_or_refuse

    def pre_shutdown(self) -> None:
        # aiohttp closes every connection here, before the app's on_shutdown (the wait for
        # the calls in flight): an idle one would ignore a request sent on it until its close.
        # Here they stay open, answering the stop; ``shutdown`` closes them.
        self.stopping = True

    async def shutdown(self, timeout: float | None = None) -> None:
        # The calls in flight are done (on_shutdown): close the idle connections now, the
        # busy ones (a download, a forwarded path) once their request ends, or at ``timeout``.
        if self.answered_stopping:
            log.info(
                "stopping: %d requests that came during the stop were answered 503 (stopping)",
                self.answered_stopping,
            )
        super().pre_shutdown()
        await super().shutdown(timeout)


class ProxyRunner(web.AppRunner):
    """``AppRunner`` whose server answers protocol errors as JSON, and the requests that come
    during the stop with a 503 (``JsonErrorServer``)."""

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer
        assert isinstance(server, JsonErrorServer)
        server.request_handler = server.answering_the_stop(server.request_handler)
        return server

    async def cleanup(self) -> None:
        # The stop begins before the listening socket closes: a request read after this
        # point is answered 503, whichever iteration of the loop reads it.
        if isinstance(self.server, JsonErrorServer):
            self.server.stopping = True
        await super().cleanup()


async def _serve(
    app: web.Application,
    sock: socket.socket,
    *,
    backlog: int,
    on_listening: Callable[[], None],
    runner_kwargs: dict[str, Any],
) -> None:
    runner = ProxyRunner(app, handle_signals=True, **runner_kwargs)
    await runner.setup()  # cleanup contexts: the store opens here (StoreError)
    try:
        await web.SockSite(runner, sock, backlog=backlog).start()
        on_listening()
        while True:
            await asyncio.sleep(3600)
    finally:
        await runner.cleanup()


def run(
    app: web.Application,
    sock: socket.socket,
    *,
    backlog: int,
    on_listening: Callable[[], None],
    loop: asyncio.AbstractEventLoop,
    access_log: logging.Logger | None = None,
    server_kwargs: dict[str, Any] | None = None,
) -> None:
    """Serve ``app`` on the bound ``sock`` until SIGINT or SIGTERM, as ``web.run_app`` does;
    ``on_listening()`` runs once the app has started and the socket listens;
    ``server_kwargs``: aiohttp's connection knobs (``Settings.server_kwargs``). Errors during
    start-up (a store that cannot open) are raised."""
    main = loop.create_task(
        _serve(
            app,
            sock,
            backlog=backlog,
            on_listening=on_listening,
            runner_kwargs={
                "access_log": access_log,
                "access_log_class": AccessLogger,
                **(server_kwargs or {}),
            },
        )
    )
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    except (GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                while not main.done():
                    # A repeated SIGTERM or SIGINT does not cut the calls in flight short
                    # (a worker gets two SIGTERMs when its supervisor dies: the kernel's,
                    # and its own on the lost link; aiohttp's runner turns both signals
                    # into GracefulExit): the stop is bounded by shutdown_timeout_s, and
                    # SIGKILL ends it at once.
                    with contextlib.suppress(asyncio.CancelledError, GracefulExit):
                        loop.run_until_complete(main)
        finally:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
