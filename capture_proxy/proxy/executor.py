"""The executor of a call's flow: performs its commands with aiohttp, feeds the replies back.

Owns the I/O of one captured call and nothing else: the engine request (``send_upstream``,
its first-byte timeout and connect retries) and its body, whole or piece by piece as it
arrives (streaming stays streaming: each engine read becomes one client write, never the
whole body), the client's response (``ClientWriter``: a client that left is remembered, never
raised), the linker's resolve / verify / remember and the recorder's persist. Every decision
is the flow's (``core.flow``). ``CallExecutor`` is backend-template mode's executor; exact-token
mode's (``proxy.exact.ExactExecutor``) adds rendering and the engine's facts. ``proxy.drive``
is the one loop that runs a flow on an executor (and what a cancellation does to it).

A harness that leaves: aiohttp tells a handler nothing when its client's connection is lost
(short of cancelling it, which ``serve`` does not: the record must be written), and only a
write finds out. So a write with nothing to write looks at the connection (``ClientWriter``),
and while the call waits on the engine a timer looks every ``CLIENT_CHECK_S``: a client found
gone closes the engine's response (the engine aborts the generation; a read waiting on it ends
and is answered ``ClientLeft``), so a whole answer, a stream the front holds (a tool call sent
whole at its end) or an engine silent between tokens is not generated to its end for nobody.
The linker asks a call in flight the same (``ends_incomplete``) when an identical request
comes: a re-send of a call whose harness left is its retry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

import aiohttp
from aiohttp import web

from capture_proxy.core.flow import commands as cmd
from capture_proxy.core.flow import events as ev
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.records import CallStatus
from capture_proxy.proxy.calls import (
    CALL_ID_HEADER,
    STORED_AS_KEY,
    CaptureDeps,
    ClientWriter,
    decoder,
    dumps_text,
    sse_response,
    upstream_headers,
)
from capture_proxy.proxy.errors import UpstreamTimeout
from capture_proxy.proxy.recorder import StoreWrite, stored_as
from capture_proxy.proxy.upstream import (
    CLIENT_ERRORS,
    CONNECT_ERRORS,
    send_upstream,
    translate_client_error,
)

log = logging.getLogger("capture_proxy")

#: How long the end of an engine's body may take after its ``[DONE]`` (seconds).
BODY_END_TIMEOUT_S = 5.0
#: While a call waits for a paused engine, an SSE comment this often keeps the harness's
#: stream alive (harnesses and their SDKs ignore comments).
KEEPALIVE_S = 15.0
PAUSE_COMMENT = b": the engine is paused for a weight update; the answer continues after it\n\n"
#: While a call waits on the engine, how often it looks whether its harness is still
#: connected (seconds): the longest an engine generates for a harness that left when
#: nothing is written to it meanwhile (a whole answer; a stream between engine events).
CLIENT_CHECK_S = 0.5

_CLIENT_WRITES = (cmd.StartClientStream, cmd.WriteClient, cmd.EndClient)


class CallExecutor:
    """Performs the commands of one call (backend-template mode; the base of the others).
    ``response``: the client's response, once a command made it."""

    def __init__(
        self, request: web.Request, deps: CaptureDeps, call_id: str, rollout_id: str
    ) -> None:
        self.request = request
        self.deps = deps
        self.call_id = call_id
        self.rollout_id = rollout_id
        self.response: web.StreamResponse | None = None
        self.upstream: aiohttp.ClientResponse | None = None
        self._writer: ClientWriter | None = None
        self._pieces: AsyncIterator[bytes] | None = None
        #: the next engine read, while a read timeout waits on a paused engine
        self._next_piece: asyncio.Future[bytes] | None = None
        #: the engine's weight-version epoch as this call last saw it
        self._epoch = -1
        #: the digests of the record verification saw, for storing (``Persist``: the store's
        #: put takes its token digests) and indexing it (``Remember``)
        self._digests: RecordDigests | None = None
        #: the harness left, as a look at its connection found (``_look``); the timer's next
        self.left = False
        self._check: asyncio.TimerHandle | None = None
        #: the engine request while its head is awaited (the timer cancels it)
        self._sending: asyncio.Future[aiohttp.ClientResponse] | None = None
        #: the status of the call's record, once the flow made it (``Verify``)
        self._made: CallStatus | None = None
        #: what the recorder did with the call's record (None: no record was persisted)
        self._written: StoreWrite | None = None

    #: The method that performs each command (set below the class; a subclass extends it).
    HANDLERS: ClassVar[dict[type[cmd.Command], Callable[[Any, Any], Awaitable[Any]]]]

    def execute(self, command: cmd.Command) -> Awaitable[Any]:
        """Perform ``command``; its reply (``core.flow.events``)."""
        return self.HANDLERS[type(command)](self, command)

    def client_left(self, command: cmd.Command) -> Any:
        """The reply to ``command`` when the handler was cancelled while it ran."""
        if self._writer is not None:
            self._writer.gone = True
        return ev.CLIENT_GONE if isinstance(command, _CLIENT_WRITES) else ev.ClientLeft()

    async def close(self) -> None:
        """Give the engine's response back (closes its request when not read to the end)."""
        if self._check is not None:
            self._check.cancel()
            self._check = None
        if self._next_piece is not None:
            self._next_piece.cancel()
            self._next_piece = None
        if self.upstream is not None:
            await self.upstream.__aexit__(None, None, None)

    def _watch_client(self) -> None:
        """Look at the harness's connection every ``CLIENT_CHECK_S`` from now until ``close``
        (once per call: the engine request is about to go out)."""
        if self._check is None and not self.left:
            self._check = asyncio.get_running_loop().call_later(CLIENT_CHECK_S, self._check_client)

    def _check_client(self) -> None:
        """The timer: a look at the connection, and the next one unless the harness left."""
        self._check = None
        if not self._look():
            self._watch_client()

    def _look(self) -> bool:
        """Whether the harness left. A harness whose connection is lost (or closing) has
        left: remembered, and the engine's request is cut (its head awaited) or its response
        closed, so the engine aborts the generation and the wait on it ends (answered
        ``ClientLeft``)."""
        if self.left:
            return True
        transport = self.request.transport
        if transport is not None and not transport.is_closing():
            return False
        self.left = True
        if self._writer is not None:
            self._writer.gone = True
        if self._sending is not None:
            self._sending.cancel()
        if self.upstream is not None:
            self.upstream.close()
        return True

    @property
    def unanswered_unstored(self) -> bool:
        """Whether the call ended with no record stored and no answer given as a success: the
        store refused its record (``store_failure = refuse``), or it ended before a record was
        persisted (an error on its way). Not a call whose record was stored (whatever
        happened after) or answered without its record (``store_failure = answer``)."""
        return self._written is None or self._written is StoreWrite.REFUSED

    def ends_incomplete(self) -> bool:
        """Whether this call is known to end failed or incomplete (``Linker.resolve``: an
        identical request is then its retry): its record was made so, or its harness left
        before the record was made (looked at now). A harness found gone before the record is
        made reaches the flow as ``ClientLeft`` or a gone ``ClientState`` before the flow can
        make one, and the flow records such a call incomplete; for a whole answer read but
        not yet verified, the harness never got it either, so the identical request is its
        retry though that call may still be stored complete."""
        if self._made is not None:
            return self._made is not CallStatus.COMPLETE
        gone = self._writer is not None and self._writer.gone
        return self._look() or gone

    def _version(self) -> str | None:
        """The engine's weight version as last read (its epoch remembered)."""
        watcher = self.deps.weights
        if watcher is None:
            return None
        self._epoch = watcher.epoch
        return watcher.version

    def _changed_version(self) -> str | None:
        """The engine's version when it changed since this call last looked, else None."""
        watcher = self.deps.weights
        if watcher is None or watcher.epoch == self._epoch:
            return None
        return self._version()

    async def _resolve(self, c: cmd.Resolve) -> ev.Resolved | ev.StepFailed:
        try:
            resolution = await self.deps.linker.resolve(
                c.rollout_id,
                c.linking_messages,
                c.body,
                call_id=c.call_id,
                created_at=c.created_at,
                linking_facts=c.linking_facts,
                tools_facts=c.tools_facts,
                session=c.session,
                retry_requested=c.retry_requested,
                ends_incomplete=self.ends_incomplete,
                request_digest=c.request_digest,
                history_keys=c.history_keys,
            )
        except Exception as exc:
            log.error("rollout %s: parent resolution failed: %s", c.rollout_id, exc)
            return ev.StepFailed(type(exc).__name__, str(exc))
        return ev.Resolved(resolution)

    async def _look_up(self, c: cmd.LookUpCall) -> ev.CallFound:
        record = await self.deps.linker.get_call(c.call_id)
        facts = self.deps.linker.message_facts(c.call_id) if record is not None else None
        return ev.CallFound(record, facts)

    def engine_headers(self, harness_headers: bool) -> dict[str, str]:
        """The engine request's headers: the harness's (backend-template mode), else ours and
        the harness's ``Authorization`` only."""
        request, call_id = self.request, self.call_id
        if harness_headers:
            return upstream_headers(request, call_id, self.rollout_id)
        headers = {
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
            "X-Request-Id": call_id,
            "X-NG-Rollout-Id": self.rollout_id,
        }
        if request.headers.get("Authorization"):
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def _send(
        self, c: cmd.SendToEngine
    ) -> ev.EngineResponded | ev.EngineFailed | ev.ClientLeft:
        deps = self.deps
        t0 = time.perf_counter()
        watcher = deps.weights
        version = self._version()  # as the request goes out (a whole answer's head comes late)
        if self.upstream is not None:  # a continuation after an abort: the last one is done
            await self.close()
            self.upstream, self._pieces = None, None
        if self.left:  # (a continuation for a harness that left: not sent)
            return ev.ClientLeft()
        self._watch_client()
        # A task of its own, so the timer can cut the wait for the engine's head (a whole
        # answer's comes with its body) without cancelling the handler.
        sending = self._sending = asyncio.ensure_future(
            send_upstream(
                deps.session,
                "POST",
                deps.backend + c.path,
                first_byte_timeout_s=deps.head_timeout_s,
                connect_retries=deps.connect_retries,
                still_waiting=watcher.still_paused if watcher is not None else None,
                data=c.body,
                headers=self.engine_headers(c.harness_headers),
                auto_decompress=True,
                **({"timeout": deps.request_timeout} if deps.request_timeout else {}),
            )
        )
        try:
            upstream = await sending
        except CLIENT_ERRORS as exc:
            if deps.on_unreachable is not None and isinstance(exc, CONNECT_ERRORS):
                deps.on_unreachable(deps.backend)
            return _failed(exc, deps.backend)
        except asyncio.CancelledError:
            if not self.left or _cancelling():
                raise  # the handler itself is cancelled
            return ev.ClientLeft()  # the timer cut the request: the harness left
        finally:
            self._sending = None
        self.upstream = upstream
        deps.recorder.metrics.observe_upstream(first_byte_s=time.perf_counter() - t0)
        if deps.on_answered is not None and upstream.status < 500:
            deps.on_answered(deps.backend)
        if self.left:  # it left while the engine's head was awaited (``close`` closes it)
            return ev.ClientLeft()
        content_type = upstream.headers.get("Content-Type", "")
        return ev.EngineResponded(
            upstream.status,
            content_type.startswith("text/event-stream"),
            upstream.reason,
            version,
        )

    async def _read_body(
        self, c: cmd.ReadEngineBody
    ) -> ev.EngineBody | ev.EngineFailed | ev.ClientLeft:
        assert self.upstream is not None
        try:
            data = await self._patient_read(self.upstream.read())
        except CLIENT_ERRORS as exc:
            if self.left:  # the timer closed the response: the harness left
                return ev.ClientLeft()
            log.warning("call %s: reading the engine's body failed: %s", self.call_id, exc)
            return _failed(exc, self.deps.backend)
        if self.left:  # (the body came as the harness was found gone: nobody gets it)
            return ev.ClientLeft()
        return ev.EngineBody(data, self._version())

    async def _read_piece(self, c: cmd.ReadEngine) -> Any:
        assert self.upstream is not None
        if self._pieces is None:
            self._pieces = aiter(self.upstream.content.iter_any())
        try:
            if self.deps.read_timeout_s is None:
                data = await anext(self._pieces)
            else:
                data = await self._patient_read(anext(self._pieces))
        except StopAsyncIteration:
            if self.left:  # (the end came as the harness was found gone: nobody gets it)
                return ev.ClientLeft()
            return ev.EngineEnd(self._version())
        except CLIENT_ERRORS as exc:
            if self.left:  # the timer closed the response: the harness left
                return ev.ClientLeft()
            return ev.EngineBroke(type(exc).__name__, str(exc))
        return ev.EnginePiece(data, self._changed_version())

    async def _patient_read(self, read: Awaitable[bytes]) -> bytes:
        """``read`` within the read timeout (``upstream_read_timeout_s``), renewed while the
        engine says it is paused (a keep or wait pause holds the request). Raises
        CLIENT_ERRORS, StopAsyncIteration."""
        timeout_s, watcher = self.deps.read_timeout_s, self.deps.weights
        if timeout_s is None:
            return await read
        task = self._next_piece = asyncio.ensure_future(read)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=timeout_s)
                if done:
                    return task.result()
                if watcher is None or not await watcher.still_paused():
                    raise TimeoutError(
                        f"no bytes within {timeout_s:g} s (setting upstream_read_timeout_s)"
                    )
        finally:
            if not task.done():
                task.cancel()
            self._next_piece = None

    async def _await_serving(self, c: cmd.AwaitEngineServing) -> Any:
        """Wait (``engine_pause_wait_s``) for the engine to serve again after an abort; an
        open stream gets an SSE comment every ``KEEPALIVE_S`` meanwhile, and the wait ends
        (``ClientLeft``) at the first of them that finds the harness gone."""
        watcher, t0 = self.deps.weights, time.perf_counter()
        if watcher is None:
            return ev.EngineServing(None, 0.0, None)
        waiting = asyncio.ensure_future(watcher.wait_serving())
        try:
            async with asyncio.timeout(self.deps.pause_wait_s):
                while True:
                    done, _ = await asyncio.wait({waiting}, timeout=KEEPALIVE_S)
                    if done:
                        break
                    if self._writer is not None:
                        await self._writer.write(PAUSE_COMMENT)
                    if self.left or (self._writer is not None and self._writer.gone):
                        return ev.ClientLeft()  # nobody waits for the answer any more
        except TimeoutError:
            return ev.EngineFailed(
                f"the engine at {self.deps.backend} did not serve again within "
                f"{self.deps.pause_wait_s:g} s (setting engine_pause_wait_s)",
                "engine_paused",
                timeout=True,
            )
        finally:
            waiting.cancel()
        paused = waiting.result()
        version = await watcher.read_version()
        return ev.EngineServing(paused, (time.perf_counter() - t0) * 1000.0, version)

    async def _drain(self, c: cmd.DrainEngine) -> None:
        """Read the end of the engine's body after its ``[DONE]`` (the chunked terminator,
        usually there already), so the connection goes back to the pool; a body that does not
        end within ``BODY_END_TIMEOUT_S`` is closed instead."""
        assert self.upstream is not None
        try:
            async with asyncio.timeout(BODY_END_TIMEOUT_S):
                await self.upstream.content.read()
        except CLIENT_ERRORS:
            self.upstream.close()

    async def _start_stream(self, c: cmd.StartClientStream) -> ev.ClientState:
        self._writer = ClientWriter(sse_response(c.status, self.call_id))
        self.response = self._writer.response
        await self._writer.prepare(self.request)
        return ev.CLIENT_GONE if self._writer.gone else ev.CLIENT_THERE

    async def _write(self, c: cmd.WriteClient) -> ev.ClientState:
        assert self._writer is not None
        await self._writer.write(c.data)
        return ev.CLIENT_GONE if self._writer.gone else ev.CLIENT_THERE

    async def _end(self, c: cmd.EndClient) -> ev.ClientState:
        assert self._writer is not None
        await self._writer.end(c.data)
        return ev.CLIENT_GONE if self._writer.gone else ev.CLIENT_THERE

    async def _respond_json(self, c: cmd.RespondJson) -> None:
        self.response = web.json_response(
            c.body, status=c.status, headers={CALL_ID_HEADER: self.call_id}, dumps=dumps_text
        )

    async def _verify(self, c: cmd.Verify) -> ev.Verified | ev.StepFailed:
        self._made = c.record.status  # (verification does not change it)
        self._digests = RecordDigests(c.record, c.prefill)
        try:
            record = await self.deps.linker.verify(
                c.record,
                c.resolution,
                c.linking_messages,
                harness_note=c.harness_note,
                retry_count=c.retry_count,
                decode=decoder(self.deps, c.record.model),
                digests=self._digests,
                prefill=c.prefill,
            )
        except Exception as exc:
            log.error("call %s: link verification failed: %s", c.record.call_id, exc)
            return ev.StepFailed(type(exc).__name__, str(exc))
        return ev.Verified(record)

    async def _persist(self, c: cmd.Persist) -> ev.Persisted:
        written, error = await self.deps.recorder.persist_call(c.record, c.request, self._digests)
        self._written = written
        self.request[STORED_AS_KEY] = stored_as(c.record.status, written)
        return ev.Persisted(written is StoreWrite.STORED, written is StoreWrite.REFUSED, error)

    async def _remember(self, c: cmd.Remember) -> None:
        try:
            await self.deps.linker.remember(c.record, c.message_facts, self._digests, c.session)
        except Exception as exc:
            log.error("call %s: indexing failed: %s", c.record.call_id, exc)


CallExecutor.HANDLERS = {
    cmd.Resolve: CallExecutor._resolve,
    cmd.LookUpCall: CallExecutor._look_up,
    cmd.SendToEngine: CallExecutor._send,
    cmd.ReadEngineBody: CallExecutor._read_body,
    cmd.ReadEngine: CallExecutor._read_piece,
    cmd.DrainEngine: CallExecutor._drain,
    cmd.AwaitEngineServing: CallExecutor._await_serving,
    cmd.StartClientStream: CallExecutor._start_stream,
    cmd.WriteClient: CallExecutor._write,
    cmd.EndClient: CallExecutor._end,
    cmd.RespondJson: CallExecutor._respond_json,
    cmd.Verify: CallExecutor._verify,
    cmd.Persist: CallExecutor._persist,
    cmd.Remember: CallExecutor._remember,
}


def _cancelling() -> bool:
    """Whether the current task is being cancelled (not only a task it awaits)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _failed(exc: BaseException, backend: str) -> ev.EngineFailed:
    err = translate_client_error(exc, backend)
    timeout = isinstance(err, UpstreamTimeout)
    return ev.EngineFailed(err.message, err.code, timeout, type(exc).__name__, str(exc))
