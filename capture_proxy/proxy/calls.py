"""One captured call in flight: what both back ends share.

Owns the call's dependencies (``CaptureDeps``), its request-time state (``InFlightCall``) and
the steps every back end ends with: verify the link, persist, make the call findable
(``finish_call``), record a call the harness left (``record_abandoned``) or the engine failed
(``record_failed``), and answer an engine error in the front's error shape. It knows no wire
API: the front codec on the call does the encoding.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from capture_proxy.core.assembly import CallContext, abandoned_record, failed_record
from capture_proxy.core.capture import NoteMatcher, PreparedRequest
from capture_proxy.core.codec import RequestEncoding
from capture_proxy.core.fronts.base import Answer, FrontCodec, FrontRequest, TokenIds
from capture_proxy.core.known_messages import KnownMessages, message_digests
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.records import CallRecord
from capture_proxy.core.redact import redact_text
from capture_proxy.proxy.linker import Linker
from capture_proxy.proxy.recorder import Recorder
from capture_proxy.proxy.recording import TAP_KEY, ResponseTap
from capture_proxy.proxy.upstream import CLIENT_ERRORS, forwardable_headers

log = logging.getLogger("capture_proxy")

#: Response header naming the captured call, so a harness or test can read it back over REST.
CALL_ID_HEADER = "X-Capture-Call-Id"
#: The engine path of backend-template mode, whatever API the call came in on.
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
DETOKENIZE_TIMEOUT_S = 10.0


def new_call_id() -> str:
    """``call-`` + 32 hex chars (uuid4): unique across replicas without coordination."""
    return f"call-{uuid.uuid4().hex}"


def dumps_body(body: dict[str, Any]) -> bytes:
    """orjson (fast); the stdlib for what orjson refuses (integers past 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False).encode()


def elapsed_ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


@dataclass(frozen=True)
class CaptureDeps:
    session: aiohttp.ClientSession
    backend: str
    recorder: Recorder
    linker: Linker
    notes: NoteMatcher | None
    first_byte_timeout_s: float | None = None
    connect_retries: int = 0

    @property
    def known_messages(self) -> KnownMessages:
        """Facts of the messages of earlier requests (validation, digests, canonical texts):
        the process's, kept by the linker with its other memory of recent calls."""
        return self.linker.known_messages


@dataclass(frozen=True)
class InFlightCall:
    """One captured call in flight: its front (codec and parsed request), context, prepared
    canonical request, request-time verdict and retry header."""

    front: FrontCodec
    front_request: FrontRequest
    ctx: CallContext
    prepared: PreparedRequest
    resolution: Resolution
    retry_count: str | None
    #: the model an answer names when the request names none (exact-token mode: the
    #: engine's served model, since OpenAI's schema requires a string)
    served_model: str | None = None

    @property
    def answer_model(self) -> str | None:
        """The model the proxy's answer names: the request's, else ``served_model``."""
        model = self.prepared.body.get("model")
        return model if model is not None else self.served_model

    def answer_head(self, prompt_token_ids: TokenIds | None = None) -> Answer:
        """The answer's identity before anything is generated (for a stream's first events)."""
        return Answer(
            call_id=self.ctx.call_id,
            created_at=self.ctx.created_at,
            model=self.answer_model,
            message={"role": "assistant", "content": None},
            finish_reason=None,
            prompt_token_ids=prompt_token_ids,
        )

    def error_body(
        self, status: int, message: str, error_type: str, code: str | None = None
    ) -> dict[str, Any]:
        return self.front.error_body(status, message, error_type=error_type, param=None, code=code)


def _decoder(deps: CaptureDeps, model: str | None) -> Any:
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


async def finish_call(
    deps: CaptureDeps,
    call: InFlightCall,
    record: CallRecord,
    request: RequestEncoding | None = None,
) -> None:
    """Verify the link, persist (``request``: the record's ``RequestEncoding``, if computed
    ahead), make the call findable. Never raises."""
    try:
        record = await deps.linker.verify(
            record,
            call.resolution,
            call.prepared.linking_messages,
            harness_note=call.prepared.harness_note,
            retry_count=call.retry_count,
            decode=_decoder(deps, record.model),
        )
    except Exception as exc:
        log.error("call %s: link verification failed: %s", record.call_id, exc)
        record = record.replace(
            parent_call_id=None,
            linking={"verdict": Verdict.UNRESOLVED.value, "reason": f"verification failed: {exc}"},
        )
    if request is None:
        request = encode_request(call)
    if await deps.recorder.persist(record, request):
        try:
            # (facts that do not fit the record's messages are not kept: RecentCalls.put)
            await deps.linker.remember(record, call.prepared.message_facts)
        except Exception as exc:
            log.error("call %s: indexing failed: %s", record.call_id, exc)


def encode_request(call: InFlightCall) -> RequestEncoding | None:
    """The ``RequestEncoding`` of the call's request, from the messages' known facts (their
    canonical texts and digests); None when it has no canonical text (the store's write then
    names the problem)."""
    body = call.ctx.request_body
    messages = body.get("messages") or []
    facts = call.prepared.message_facts
    try:
        digests = None
        if facts is not None and body is call.prepared.body and len(facts) == len(messages):
            digests = message_digests(facts)
        return RequestEncoding.of(messages, body.get("tools"), digests)
    except ValueError:
        return None


def upstream_headers(request: web.Request, call_id: str, rollout_id: str) -> dict[str, str]:
    """Headers for the engine: the harness's (less hop-by-hop, encodings and, for the other
    APIs, their own auth and version headers), our JSON body, the call id as vLLM's request id
    (engine logs match our call ids) and the rollout id."""
    drop = ("accept-encoding", "content-type", "x-api-key", "anthropic-version", "anthropic-beta")
    headers = dict(forwardable_headers(request.headers, drop=drop))
    headers["Content-Type"] = "application/json"
    headers["Accept-Encoding"] = "identity"
    headers["X-Request-Id"] = call_id
    headers["X-NG-Rollout-Id"] = rollout_id
    return headers


async def record_failed(
    deps: CaptureDeps,
    call: InFlightCall,
    t0: float,
    reason: str,
    http_status: int | None,
    prompt_token_ids: Any = None,
) -> None:
    """Record a call the engine did not answer (``prompt_token_ids``: the prompt, when the
    proxy built it)."""
    record = failed_record(
        call.ctx, reason=redact_text(reason), latency_ms=elapsed_ms(t0), http_status=http_status
    )
    if prompt_token_ids is not None:
        record.prompt_token_ids = prompt_token_ids
    await finish_call(deps, call, record)


async def record_abandoned(
    deps: CaptureDeps, call: InFlightCall, t0: float, prompt_token_ids: Any = None
) -> None:
    """Record a call whose handler is cancelled before the engine answered (the harness left
    and the server cancels the handlers of closed connections); shielded, so the cancellation
    cannot cut the write. ``prompt_token_ids``: the prompt, when the proxy built it."""
    record = abandoned_record(
        call.ctx,
        reason="client disconnected before the engine answered",
        latency_ms=elapsed_ms(t0),
    )
    if prompt_token_ids is not None:
        record.prompt_token_ids = prompt_token_ids
    await asyncio.shield(finish_call(deps, call, record))


def _engine_error_message(payload: Any, raw: bytes, reason: str | None) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        message = payload["error"].get("message")
        if isinstance(message, str):
            return message
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return str(payload["message"])
    return raw.decode("utf-8", "replace")[:2000] or reason or "engine error"


async def relay_engine_error(
    upstream: aiohttp.ClientResponse,
    call: InFlightCall,
    deps: CaptureDeps,
    t0: float,
    prompt_token_ids: Any = None,
) -> web.Response:
    """Answer an engine 4xx/5xx in the front's error shape (a chat-completions call gets the
    engine's OpenAI-shaped body as sent); record the call as failed."""
    try:
        raw = await upstream.read()
    except CLIENT_ERRORS as exc:
        raw = b""
        log.warning("call %s: reading the engine's error body failed: %s", call.ctx.call_id, exc)
    try:
        payload: Any = json.loads(raw)
    except ValueError:
        payload = None
    status = upstream.status
    shaped = isinstance(payload, dict) and isinstance(payload.get("error"), dict)
    if not (shaped and call.front.api == "chat_completions"):
        message = _engine_error_message(payload, raw, upstream.reason)
        error_type = "invalid_request_error" if status < 500 else "upstream_error"
        payload = call.error_body(status, f"engine returned {status}: {message}", error_type)
    await record_failed(deps, call, t0, f"engine returned HTTP {status}", status, prompt_token_ids)
    return web.json_response(payload, status=status, headers={CALL_ID_HEADER: call.ctx.call_id})


def sse_response(status: int, call_id: str) -> web.StreamResponse:
    response = web.StreamResponse(status=status)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    response.headers[CALL_ID_HEADER] = call_id
    return response


#: Errors of a write to a client that has left.
CLIENT_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError)


class ClientWriter:
    """Writes to a streamed response; remembers (never raises) that the client left."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.gone = False
        self.tap: ResponseTap | None = None

    async def prepare(self, request: web.Request) -> None:
        self.tap = request.get(TAP_KEY)  # set when the traffic is being recorded
        try:
            await self.response.prepare(request)
        except CLIENT_GONE:
            self.gone = True

    async def write(self, data: bytes) -> None:
        if self.gone or not data:
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


JsonDumps = Callable[[Any], str]


def dumps_text(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)
