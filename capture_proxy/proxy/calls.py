"""What the executors of captured calls share: dependencies, engine headers, client writes.

Owns the call's dependencies (``CaptureDeps``), the engine request's headers built from the
harness's (``upstream_headers``), the engine's ``/detokenize`` as the linker's decoder, and
the client side of a streamed answer (``sse_response``, ``ClientWriter``: remembers, never
raises, that the client left). No decision about a call lives here (``core.flow`` owns them).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from capture_proxy.core.capture import NoteMatcher
from capture_proxy.core.known_bodies import KnownBodies
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.known_tools import KnownTools
from capture_proxy.proxy.images import ImagePolicy
from capture_proxy.proxy.linker import Linker
from capture_proxy.proxy.recorder import Recorder
from capture_proxy.proxy.traffic_tap import TAP_KEY, ResponseTap
from capture_proxy.proxy.upstream import HOP_BY_HOP, forwardable_header_dict
from capture_proxy.proxy.weight_watch import WeightWatcher

log = logging.getLogger("capture_proxy")

#: Response header naming the captured call, so a harness or test can read it back over REST.
CALL_ID_HEADER = "X-Capture-Call-Id"
#: What became of the request's captured call (``recorder.stored_as``), set when its record
#: was written or refused: the access line says it (``proxy.app``), also for a client that left.
STORED_AS_KEY = web.RequestKey("stored_as", str)
DETOKENIZE_TIMEOUT_S = 10.0


def new_call_id() -> str:
    """``call-`` + 32 hex chars (uuid4): unique across replicas without coordination."""
    return call_id_of(os.urandom(16))


def call_id_of(random16: bytes) -> str:
    """The call id of 16 random bytes: ``call-`` + ``uuid.UUID(bytes=random16, version=4).hex``
    (what ``uuid.uuid4`` makes of ``os.urandom(16)``), without building the UUID object."""
    raw = bytearray(random16)
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # variant RFC 4122
    return "call-" + raw.hex()


@dataclass(frozen=True)
class CaptureDeps:
    session: aiohttp.ClientSession
    backend: str
    recorder: Recorder
    linker: Linker
    notes: NoteMatcher | None
    first_byte_timeout_s: float | None = None
    connect_retries: int = 0
    #: told the backend's URL when a connection to it could not be made (several backends:
    #: it is taken as unhealthy, so the rollout's next call goes to another engine)
    on_unreachable: Callable[[str], None] | None = None
    #: told the backend's URL when it answered a request's head (several backends: a live
    #: engine, whatever its late health probes say)
    on_answered: Callable[[str], None] | None = None
    #: the engine's weight version and pause (``proxy.weight_watch``), None: not watched
    weights: WeightWatcher | None = None
    #: longest wait for a paused engine to serve again after an abort (seconds)
    pause_wait_s: float = 900.0
    #: ``upstream_read_timeout_s``, applied by the executor (a paused engine's stall is not
    #: cut); ``request_timeout``: the engine requests' aiohttp timeout without it
    read_timeout_s: float | None = None
    request_timeout: aiohttp.ClientTimeout | None = None

    @property
    def head_timeout_s(self) -> float | None:
        """The longest wait for the engine's response head: the first-byte timeout, and the
        read timeout (no byte for that long) when it is shorter."""
        limits = [t for t in (self.first_byte_timeout_s, self.read_timeout_s) if t is not None]
        return min(limits) if limits else None

    #: what images a call may carry and each model's image processor; the session remote
    #: images are fetched with (``image_fetch_remote``)
    images: ImagePolicy = field(default_factory=lambda: ImagePolicy(None))
    image_session: aiohttp.ClientSession | None = None

    @property
    def known_messages(self) -> KnownMessages:
        """Facts of the messages of earlier requests (validation, digests, canonical texts):
        the process's, kept by the linker with its other memory of recent calls."""
        return self.linker.known_messages

    @property
    def known_bodies(self) -> KnownBodies:
        """The latest request bodies of the sessions served (``core.known_bodies``): the
        process's, beside ``known_messages``."""
        return self.linker.known_bodies

    @property
    def known_tools(self) -> KnownTools:
        """Facts of the tools of earlier requests (validation, canonical texts, request
        digests, the fronts' conversions): the process's, beside ``known_messages``."""
        return self.linker.known_tools


def decoder(deps: CaptureDeps, model: str | None) -> Any:
    """Detokenise through the engine's ``/detokenize`` (vLLM: ``{tokens}`` -> ``{prompt}``)."""

    async def decode(token_ids: list[int]) -> str | None:
        body: dict[str, Any] = {"tokens": token_ids}
        if model:
            body["model"] = model
        timeout = aiohttp.ClientTimeout(total=DETOKENIZE_TIMEOUT_S)
        async with deps.session.post(
            deps.backend + "/detokenize", json=body, timeout=timeout, auto_decompress=True
        ) as resp:
            if resp.status != 200:
                return None
            data = await resp.json()
        prompt = data.get("prompt") if isinstance(data, dict) else None
        return prompt if isinstance(prompt, str) else None

    return decode


#: Not forwarded to the engine: hop-by-hop headers, encodings (the proxy sends its own JSON
#: body and asks for it plain) and the other APIs' auth and version headers.
_UPSTREAM_DROP = HOP_BY_HOP | frozenset(
    ("accept-encoding", "content-type", "x-api-key", "anthropic-version", "anthropic-beta")
)


def upstream_headers(request: web.Request, call_id: str, rollout_id: str) -> dict[str, str]:
    """Headers for the engine: the harness's (less hop-by-hop, encodings and, for the other
    APIs, their own auth and version headers), our JSON body, the call id as vLLM's request id
    (engine logs match our call ids) and the rollout id."""
    headers = forwardable_header_dict(request.headers, _UPSTREAM_DROP)
    headers["Content-Type"] = "application/json"
    headers["Accept-Encoding"] = "identity"
    headers["X-Request-Id"] = call_id
    headers["X-NG-Rollout-Id"] = rollout_id
    return headers


def sse_response(status: int, call_id: str) -> web.StreamResponse:
    response = web.StreamResponse(status=status)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    response.headers[CALL_ID_HEADER] = call_id
    return response


#: The status of a call whose harness left before its answer began (nginx's "client closed
#: request"): the response goes to nobody, the access line shows it.
CLIENT_CLOSED_REQUEST = 499


def left_response(call_id: str) -> web.Response:
    """The response of a call whose harness left before its answer began (the flow recorded
    the call): nobody receives it."""
    return web.Response(status=CLIENT_CLOSED_REQUEST, headers={CALL_ID_HEADER: call_id})


#: Errors of a write to a client that has left.
CLIENT_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError)


class ClientWriter:
    """Writes to a streamed response; remembers (never raises) that the client left, also
    when there is nothing to write (``write(b"")``: its connection is looked at)."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.gone = False
        self.tap: ResponseTap | None = None
        #: the connection's protocol (its ``transport`` is None once the connection is lost)
        self._protocol: RequestHandler | None = None

    async def prepare(self, request: web.Request) -> None:
        self.tap = request.get(TAP_KEY)  # set when the traffic is being recorded
        self._protocol = request.protocol
        try:
            await self.response.prepare(request)
        except CLIENT_GONE:
            self.gone = True

    async def write(self, data: bytes) -> None:
        if self.gone:
            return
        if not data:
            # An engine event the front holds (a Messages tool_use block, a Responses call's
            # arguments) writes nothing, and only a write finds a client that left: look at
            # the connection instead (aiohttp drops its transport when it is lost). One
            # attribute read per engine event, the hot path's whole cost.
            protocol = self._protocol
            if protocol is not None and protocol.transport is None:
                self.gone = True
            return
        if self.tap is not None:
            self.tap.add(data)
        try:
            await self.response.write(data)
        except CLIENT_GONE:
            self.gone = True

    async def end(self, final: bytes = b"") -> None:
        if self.gone:
            return
        if self.tap is not None and final:
            self.tap.add(final)
        try:
            await self.response.write_eof(final)
        except CLIENT_GONE:
            self.gone = True


#: ``json.dumps(obj, ensure_ascii=False)`` is this encoder's ``encode`` (a new one per call
#: otherwise); it holds no state between calls.
_TEXT_ENCODER = json.JSONEncoder(ensure_ascii=False)


def dumps_text(obj: Any) -> str:
    """``json.dumps(obj, ensure_ascii=False)``: the stdlib's separators and float texts, which
    a harness may have seen from the proxy before (orjson writes compact JSON)."""
    return _TEXT_ENCODER.encode(obj)
