"""Backend-template mode: the engine renders the chat template of the canonical conversation.

Owns the engine-rendered back end: send the canonical chat request (with the token-data extras
of ``core.capture``) to the engine's ``/v1/chat/completions``, relay the answer as it arrives
while assembling the record on the side, persist, finish. A chat-completions call gets the
engine's own answer, stripped of what the proxy added ("capture is additive"); a call of another
API gets the canonical answer encoded by its front codec, streamed event by event.

Ordering guarantee: the record is persisted before the response finishes (for a stream, before
its last event and the end of the body), so a harness that saw the end of its answer can rely
on the call being readable over REST.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from capture_proxy.core.assembly import ChatCaptureAssembler, mark_incomplete, stream_end_reasons
from capture_proxy.core.capture import HarnessAsked, strip_chat_chunk, strip_chat_response
from capture_proxy.core.codec import RequestEncoding
from capture_proxy.core.fronts.base import Answer, Api, StreamEncoder, answer_as_deltas
from capture_proxy.core.fronts.chat import DONE_EVENT, openai_error_body
from capture_proxy.core.json_bodies import loads_like_stdlib
from capture_proxy.core.records import CallRecord
from capture_proxy.core.sse import (
    DONE_SENTINEL,
    SSEStreamDecoder,
    encode_json_event,
    parse_json_event,
)
from capture_proxy.proxy.calls import (
    CALL_ID_HEADER,
    CHAT_COMPLETIONS_PATH,
    CaptureDeps,
    ClientWriter,
    InFlightCall,
    dumps_body,
    dumps_text,
    elapsed_ms,
    encode_request,
    finish_call,
    record_abandoned,
    record_failed,
    relay_engine_error,
    sse_response,
    upstream_headers,
)
from capture_proxy.proxy.errors import UpstreamUnavailable
from capture_proxy.proxy.upstream import CLIENT_ERRORS, send_upstream, translate_client_error

#: How long the end of an engine's body may take after its ``[DONE]`` (seconds).
BODY_END_TIMEOUT_S = 5.0

#: Keys of an engine delta that carry the answer (``reasoning``: vLLM's newer name).
_DELTA_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")


def answer_of(call: InFlightCall, record: CallRecord) -> Answer:
    """The canonical answer from an assembled record."""
    message = record.response_message or {"role": "assistant", "content": None}
    if "reasoning" in message and "reasoning_content" not in message:
        message = {**message, "reasoning_content": message["reasoning"]}
    return Answer(
        call_id=record.call_id,
        created_at=record.created_at,
        model=call.prepared.body.get("model"),
        message=message,
        finish_reason=record.finish_reason,
        usage=_chat_usage(record),
    )


def _chat_usage(record: CallRecord) -> dict[str, Any] | None:
    usage = record.usage
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        return usage
    if record.num_prompt_tokens or record.num_generation_tokens:
        return {
            "prompt_tokens": record.num_prompt_tokens,
            "completion_tokens": record.num_generation_tokens,
            "total_tokens": record.num_prompt_tokens + record.num_generation_tokens,
        }
    return usage


def _canonical_delta(chunk: Mapping[str, Any]) -> dict[str, Any] | None:
    """The answer-carrying part of a chat chunk's ``choices[0].delta`` (None when it has
    none: a role-only or token-only chunk)."""
    choices = chunk.get("choices")
    if not choices or not isinstance(choices[0], dict):
        return None
    delta = choices[0].get("delta")
    if not isinstance(delta, dict):
        return None
    out: dict[str, Any] = {}
    for key in _DELTA_KEYS:
        value = delta.get(key)
        if value:
            out["reasoning_content" if key == "reasoning" else key] = value
    return out or None


async def handle_template(
    request: web.Request,
    call: InFlightCall,
    deps: CaptureDeps,
    upstream_body: dict[str, Any],
    asked: HarnessAsked,
) -> web.StreamResponse:
    """Serve one captured call through the engine's chat endpoint. Raises ProxyError."""
    ctx = call.ctx
    headers = upstream_headers(request, ctx.call_id, ctx.rollout_id)
    t0 = time.perf_counter()
    try:
        upstream = await send_upstream(
            deps.session,
            "POST",
            deps.backend + CHAT_COMPLETIONS_PATH,
            first_byte_timeout_s=deps.first_byte_timeout_s,
            connect_retries=deps.connect_retries,
            data=dumps_body(upstream_body),
            headers=headers,
            auto_decompress=True,
        )
    except CLIENT_ERRORS as exc:
        err = translate_client_error(exc, deps.backend)
        await record_failed(deps, call, t0, err.message, None)
        err.call_id = call.ctx.call_id
        raise err from exc
    except asyncio.CancelledError:
        await record_abandoned(deps, call, t0)
        raise

    deps.recorder.metrics.observe_upstream(first_byte_s=time.perf_counter() - t0)
    async with upstream:
        if upstream.status >= 400:
            return await relay_engine_error(upstream, call, deps, t0)
        content_type = upstream.headers.get("Content-Type", "")
        if ctx.stream and content_type.startswith("text/event-stream"):
            return await _relay_stream(request, upstream, call, asked, deps, t0)
        return await _relay_json(request, upstream, call, asked, deps, t0)


async def _relay_json(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    call: InFlightCall,
    asked: HarnessAsked,
    deps: CaptureDeps,
    t0: float,
) -> web.StreamResponse:
    ctx = call.ctx
    try:
        raw = await upstream.read()
    except CLIENT_ERRORS as exc:
        err = translate_client_error(exc, deps.backend)
        await record_failed(deps, call, t0, err.message, upstream.status)
        err.call_id = call.ctx.call_id
        raise err from exc
    latency_ms = elapsed_ms(t0)
    try:
        payload = loads_like_stdlib(raw)
        if not isinstance(payload, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        reason = f"engine sent a body that is not a JSON object ({len(raw)} bytes): {exc}"
        await record_failed(deps, call, t0, reason, upstream.status)
        raise UpstreamUnavailable(reason, code="engine_bad_response") from exc
    assembler = ChatCaptureAssembler(ctx)
    assembler.add_response(payload)
    record = assembler.finish(latency_ms=latency_ms, http_status=upstream.status)
    await finish_call(deps, call, record)
    if call.front.api is Api.CHAT_COMPLETIONS:
        # (A chat harness that asked for a stream and got a whole answer gets it as the engine
        # sent it.)
        body = strip_chat_response(payload, asked)
    else:
        answer = answer_of(call, record)
        if call.ctx.stream:
            return await _whole_as_stream(request, call, answer)
        body = call.front.encode(call.front_request, answer)
    return web.json_response(
        body, status=upstream.status, headers={CALL_ID_HEADER: ctx.call_id}, dumps=dumps_text
    )


async def _whole_as_stream(
    request: web.Request, call: InFlightCall, answer: Answer
) -> web.StreamResponse:
    """A harness of another API asked for a stream and the engine answered whole: the answer
    as the front's event sequence (the record is already stored)."""
    encoder = call.front.stream_encoder(call.front_request, call.answer_head())
    events = encoder.start()
    for delta in answer_as_deltas(answer.message):
        events += encoder.delta(delta)
    events += encoder.finish(answer)
    writer = ClientWriter(sse_response(200, call.ctx.call_id))
    await writer.prepare(request)
    await writer.end(b"".join(events))
    return writer.response


class _Relay:
    """The per-event work of one relayed stream: assemble, then forward (chat: the engine's
    chunk stripped; other APIs: the front's events for the chunk's delta)."""

    def __init__(self, call: InFlightCall, asked: HarnessAsked, encoder: StreamEncoder | None):
        self.call = call
        self.asked = asked
        self.encoder = encoder
        self.assembler = ChatCaptureAssembler(call.ctx)
        self.done_seen = False
        self.problem: str | None = None

    def handle(self, events: list[Any]) -> list[bytes]:
        out: list[bytes] = []
        for event in events:
            if event.data == DONE_SENTINEL:
                self.done_seen = True
                continue
            try:
                chunk = parse_json_event(event.data)
                if not isinstance(chunk, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                # Not forwarded: a harness would choke on it. The stream ends with an error.
                self.problem = (
                    f"engine sent a malformed stream event ({len(event.data)} bytes): {exc}"
                )
                continue
            self.assembler.add_chunk(chunk)
            if self.encoder is None:
                stripped = strip_chat_chunk(chunk, self.asked)
                if stripped is not None:
                    out.append(encode_json_event(stripped))
            else:
                delta = _canonical_delta(chunk)
                if delta is not None:
                    out += self.encoder.delta(delta)
        return out


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    call: InFlightCall,
    asked: HarnessAsked,
    deps: CaptureDeps,
    t0: float,
) -> web.StreamResponse:
    """Forward SSE events as they complete, assembling the record on the side."""
    ctx = call.ctx
    chat = call.front.api is Api.CHAT_COMPLETIONS
    encoder = None if chat else call.front.stream_encoder(call.front_request, call.answer_head())
    relay = _Relay(call, asked, encoder)
    writer = ClientWriter(sse_response(upstream.status if chat else 200, ctx.call_id))
    # The harness left before the engine's first byte: record the call (nothing arrived) as
    # incomplete; leaving ``async with upstream`` closes the engine's request.
    await writer.prepare(request)
    if encoder is not None:
        await writer.write(b"".join(encoder.start()))
    decoder = SSEStreamDecoder()
    request_encoding: RequestEncoding | None = None
    encoded_request = False
    cancelled = False

    async def pump() -> None:
        nonlocal request_encoding, encoded_request
        async for data in upstream.content.iter_any():
            # One write per upstream read, however many events it completed.
            await writer.write(b"".join(relay.handle(decoder.feed(data))))
            if not encoded_request:
                # The first events are on their way: while the engine generates, encode the
                # request side of the record and check the prompt ids, so the write before
                # the end does less.
                request_encoding, encoded_request = encode_request(call), True
                relay.assembler.settle_prompt()
            if writer.gone or relay.done_seen:
                return  # after [DONE] only the end of the engine's body is left: read below
        await writer.write(b"".join(relay.handle(decoder.close())))

    try:
        if not writer.gone:
            await pump()
    except CLIENT_ERRORS as exc:
        relay.problem = f"engine stream broke: {type(exc).__name__}: {exc}"
    except UnicodeDecodeError as exc:
        relay.problem = f"engine stream is not UTF-8: {exc.reason}"
    except asyncio.CancelledError:
        # The handler was cancelled (the client left, with handler cancellation on, or the
        # server is stopping): keep what arrived, then let the cancellation through.
        writer.gone = cancelled = True

    record = relay.assembler.finish(latency_ms=elapsed_ms(t0), http_status=upstream.status)
    reasons = stream_end_reasons(
        client_gone=writer.gone, problem=relay.problem, done_seen=relay.done_seen
    )
    if reasons:
        record = mark_incomplete(record, reasons)
    if cancelled:
        await asyncio.shield(finish_call(deps, call, record, request_encoding))
        raise asyncio.CancelledError
    await finish_call(deps, call, record, request_encoding)

    final = b""
    if relay.problem:
        # Headers are sent; the status can no longer change: tell the harness in-band, and
        # leave out the clean end so no harness takes the answer for a complete one.
        if encoder is None:
            final = encode_json_event(openai_error_body(relay.problem, "upstream_error"))
        else:
            final = encoder.error(relay.problem)
    elif relay.done_seen:
        final = DONE_EVENT if encoder is None else b"".join(encoder.finish(answer_of(call, record)))
    await writer.end(final)  # the last events and the end of the body: one write
    if relay.done_seen:
        await read_body_end(upstream)
    return writer.response


async def read_body_end(upstream: aiohttp.ClientResponse) -> None:
    """Read the end of an engine's body after its ``[DONE]`` (the chunked terminator, usually
    there already), so the connection goes back to the pool; a body that does not end within
    ``BODY_END_TIMEOUT_S`` is closed instead."""
    try:
        async with asyncio.timeout(BODY_END_TIMEOUT_S):
            await upstream.content.read()
    except CLIENT_ERRORS:
        upstream.close()
