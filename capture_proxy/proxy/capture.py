"""The captured chat-completions call: validate, augment, forward, assemble, persist, answer.

Owns the adapter side of DESIGN.md's "flow of one call" for capture paths. Everything that can
be pure (validation, augmentation, stripping, SSE decoding, record assembly) is in
``capture_proxy.core``; this module moves bytes and measures time.

Ordering guarantee: the record is persisted before the response finishes (for a stream, before
``data: [DONE]`` and the end of the body), so a harness that saw the end of its answer can rely
on the call being readable over REST.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from capture_proxy.core.assembly import (
    CallContext,
    ChatCaptureAssembler,
    abandoned_record,
    failed_record,
    mark_incomplete,
    stream_end_reasons,
)
from capture_proxy.core.capture import (
    NoteMatcher,
    PreparedRequest,
    augment_chat_request,
    prepare_request,
    strip_chat_chunk,
    strip_chat_response,
)
from capture_proxy.core.codec import RequestEncoding
from capture_proxy.core.linking import Resolution, Verdict, request_digest
from capture_proxy.core.records import CallRecord
from capture_proxy.core.requests import InvalidRequest, parse_json_object, validate_chat_request
from capture_proxy.core.routing import Route
from capture_proxy.core.sse import (
    DONE_SENTINEL,
    SSEStreamDecoder,
    encode_json_event,
    parse_json_event,
)
from capture_proxy.proxy.errors import BadRequest, UpstreamUnavailable, error_body
from capture_proxy.proxy.linker import Linker
from capture_proxy.proxy.recorder import Recorder
from capture_proxy.proxy.upstream import (
    CLIENT_ERRORS,
    forwardable_headers,
    send_upstream,
    translate_client_error,
)

if TYPE_CHECKING:
    from capture_proxy.proxy.exact import ExactTokens

log = logging.getLogger("capture_proxy")

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
#: Response header naming the captured call, so a harness or test can read it back over REST.
CALL_ID_HEADER = "X-Capture-Call-Id"
DONE_EVENT = b"data: " + DONE_SENTINEL.encode() + b"\n\n"
#: How long the end of an engine's body may take after its ``[DONE]`` (seconds).
BODY_END_TIMEOUT_S = 5.0


def _dumps_body(body: dict[str, Any]) -> bytes:
    """orjson (fast); the stdlib for what orjson refuses (integers past 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False).encode()


def new_call_id() -> str:
    """``call-`` + 32 hex chars (uuid4): unique across replicas without coordination."""
    return f"call-{uuid.uuid4().hex}"


#: Retry headers sent by the OpenAI SDKs (Stainless-generated clients).
RETRY_COUNT_HEADER = "x-stainless-retry-count"
DETOKENIZE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CaptureDeps:
    session: aiohttp.ClientSession
    backend: str
    recorder: Recorder
    linker: Linker
    notes: NoteMatcher | None
    #: exact-token machinery, and which models use it (None: the proxy-wide prompt mode)
    exact: ExactTokens | None = None
    exact_for_model: Callable[[str | None], bool] = lambda model: False
    first_byte_timeout_s: float | None = None
    connect_retries: int = 0


@dataclass(frozen=True)
class InFlightCall:
    """One captured call in flight: its context, prepared request and request-time verdict."""

    ctx: CallContext
    prepared: PreparedRequest
    resolution: Resolution
    retry_count: str | None


async def _resolve(
    deps: CaptureDeps,
    rollout_id: str,
    prepared: PreparedRequest,
    call_id: str,
    created_at: float,
) -> Resolution:
    """Request-time resolution; a failure here never fails the model call."""
    try:
        return await deps.linker.resolve(
            rollout_id,
            prepared.linking_messages,
            prepared.body,
            call_id=call_id,
            created_at=created_at,
        )
    except Exception as exc:
        log.error("rollout %s: parent resolution failed: %s", rollout_id, exc)
        return Resolution(
            Verdict.UNRESOLVED,
            None,
            request_digest(prepared.body),
            reason=f"parent resolution failed: {type(exc).__name__}: {exc}",
        )


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
    if await deps.recorder.persist(record, request):
        try:
            await deps.linker.remember(record)
        except Exception as exc:
            log.error("call %s: indexing failed: %s", record.call_id, exc)


def encode_request(ctx: CallContext) -> RequestEncoding | None:
    """The ``RequestEncoding`` of the call's request; None when it has no canonical text (the
    store's write then names the problem)."""
    try:
        return RequestEncoding.of(
            ctx.request_body.get("messages") or [], ctx.request_body.get("tools")
        )
    except ValueError:
        return None


def upstream_headers(request: web.Request, call_id: str, rollout_id: str) -> dict[str, str]:
    headers = dict(forwardable_headers(request.headers, drop=("accept-encoding", "content-type")))
    headers["Content-Type"] = "application/json"
    headers["Accept-Encoding"] = "identity"
    # vLLM uses X-Request-Id as its request id: engine logs can be matched to our call ids.
    headers["X-Request-Id"] = call_id
    headers["X-NG-Rollout-Id"] = rollout_id
    return headers


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


def elapsed_ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


async def handle_captured_chat(
    request: web.Request, route: Route, raw_body: bytes, deps: CaptureDeps
) -> web.StreamResponse:
    """Serve one captured chat-completions call. Raises ProxyError for the middleware."""
    assert route.rollout_id is not None
    try:
        body = parse_json_object(raw_body)
        validate_chat_request(body)
    except InvalidRequest as exc:
        raise BadRequest(str(exc), param=exc.param, code="invalid_request") from exc

    created_at = time.time()
    prepared = prepare_request(body, deps.notes)
    call_id = new_call_id()
    resolution = await _resolve(deps, route.rollout_id, prepared, call_id, created_at)
    upstream_body, asked = augment_chat_request(
        prepared.body, parent_rows_end=resolution.parent_rows_end
    )
    stream = bool(body.get("stream"))
    ctx = CallContext(
        call_id=call_id,
        rollout_id=route.rollout_id,
        created_at=created_at,
        stream=stream,
        upstream_path=route.upstream_path,
        request_body=prepared.body,
        routed_experts_start=resolution.parent_rows_end or 0,
    )
    call = InFlightCall(ctx, prepared, resolution, request.headers.get(RETRY_COUNT_HEADER))
    if deps.exact is not None and deps.exact_for_model(body.get("model")):
        from capture_proxy.proxy.exact import handle_exact_tokens

        return await handle_exact_tokens(request, call, deps, deps.exact)
    url = deps.backend + route.upstream_path
    headers = upstream_headers(request, ctx.call_id, route.rollout_id)
    t0 = time.perf_counter()
    try:
        upstream = await send_upstream(
            deps.session,
            "POST",
            url,
            first_byte_timeout_s=deps.first_byte_timeout_s,
            connect_retries=deps.connect_retries,
            data=_dumps_body(upstream_body),
            headers=headers,
            auto_decompress=True,
        )
    except CLIENT_ERRORS as exc:
        err = translate_client_error(exc, deps.backend)
        await finish_call(
            deps,
            call,
            failed_record(ctx, reason=err.message, latency_ms=elapsed_ms(t0), http_status=None),
        )
        raise err from exc
    except asyncio.CancelledError:
        await record_abandoned(deps, call, t0)
        raise

    async with upstream:
        if upstream.status >= 400:
            return await relay_engine_error(upstream, call, deps, t0)
        content_type = upstream.headers.get("Content-Type", "")
        if stream and content_type.startswith("text/event-stream"):
            return await _relay_stream(request, upstream, call, asked, deps, t0)
        return await _relay_json(upstream, call, asked, deps, t0)


async def relay_engine_error(
    upstream: aiohttp.ClientResponse, call: InFlightCall, deps: CaptureDeps, t0: float
) -> web.Response:
    """Pass an engine 4xx/5xx through in OpenAI's error shape; record the call as failed."""
    ctx = call.ctx
    try:
        raw = await upstream.read()
    except CLIENT_ERRORS as exc:
        raw = b""
        log.warning("call %s: reading the engine's error body failed: %s", ctx.call_id, exc)
    try:
        payload = json.loads(raw)
        shaped = isinstance(payload, dict) and isinstance(payload.get("error"), dict)
    except ValueError:
        payload, shaped = None, False
    if not shaped:
        message = raw.decode("utf-8", "replace")[:2000] or upstream.reason or "engine error"
        error_type = "invalid_request_error" if upstream.status < 500 else "upstream_error"
        payload = error_body(f"engine returned {upstream.status}: {message}", error_type)
    reason = f"engine returned HTTP {upstream.status}"
    await finish_call(
        deps,
        call,
        failed_record(ctx, reason=reason, latency_ms=elapsed_ms(t0), http_status=upstream.status),
    )
    return web.json_response(payload, status=upstream.status, headers={CALL_ID_HEADER: ctx.call_id})


async def _relay_json(
    upstream: aiohttp.ClientResponse,
    call: InFlightCall,
    asked: Any,
    deps: CaptureDeps,
    t0: float,
) -> web.Response:
    ctx = call.ctx
    try:
        raw = await upstream.read()
    except CLIENT_ERRORS as exc:
        err = translate_client_error(exc, deps.backend)
        await finish_call(
            deps,
            call,
            failed_record(
                ctx, reason=err.message, latency_ms=elapsed_ms(t0), http_status=upstream.status
            ),
        )
        raise err from exc
    latency_ms = elapsed_ms(t0)
    try:
        payload = json.loads(raw)
        if not isinstance(payload, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        reason = f"engine sent a body that is not a JSON object ({len(raw)} bytes): {exc}"
        await finish_call(
            deps,
            call,
            failed_record(ctx, reason=reason, latency_ms=latency_ms, http_status=upstream.status),
        )
        raise UpstreamUnavailable(reason, code="engine_bad_response") from exc
    assembler = ChatCaptureAssembler(ctx)
    assembler.add_response(payload)
    record = assembler.finish(latency_ms=latency_ms, http_status=upstream.status)
    await finish_call(deps, call, record)
    return web.json_response(
        strip_chat_response(payload, asked),
        status=upstream.status,
        headers={CALL_ID_HEADER: ctx.call_id},
        dumps=lambda obj: json.dumps(obj, ensure_ascii=False),
    )


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    call: InFlightCall,
    asked: Any,
    deps: CaptureDeps,
    t0: float,
) -> web.StreamResponse:
    """Forward SSE events as they complete, assembling the record on the side."""
    ctx = call.ctx
    response = web.StreamResponse(status=upstream.status)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    response.headers[CALL_ID_HEADER] = ctx.call_id
    assembler = ChatCaptureAssembler(ctx)
    decoder = SSEStreamDecoder()
    request_encoding: RequestEncoding | None = None
    encoded_request = False
    done_seen = False
    client_gone = cancelled = False
    upstream_problem: str | None = None
    try:
        await response.prepare(request)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        # The harness left before the engine's first byte: record the call (nothing arrived)
        # as incomplete; leaving ``async with upstream`` closes the engine's request.
        client_gone = True

    async def emit(data: bytes) -> None:
        nonlocal client_gone
        if client_gone:
            return
        try:
            await response.write(data)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            client_gone = True

    def handle_events(events: list[Any]) -> list[bytes]:
        nonlocal done_seen, upstream_problem
        out: list[bytes] = []
        for event in events:
            if event.data == DONE_SENTINEL:
                done_seen = True
                continue
            try:
                chunk = parse_json_event(event.data)
                if not isinstance(chunk, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                # Not forwarded: a harness would choke on it. The stream ends with an error.
                upstream_problem = (
                    f"engine sent a malformed stream event ({len(event.data)} bytes): {exc}"
                )
                continue
            assembler.add_chunk(chunk)
            stripped = strip_chat_chunk(chunk, asked)
            if stripped is not None:
                out.append(encode_json_event(stripped))
        return out

    async def relay() -> None:
        nonlocal request_encoding, encoded_request
        async for data in upstream.content.iter_any():
            # One write per upstream read, however many events it completed.
            pieces = handle_events(decoder.feed(data))
            if pieces:
                await emit(b"".join(pieces))
            if not encoded_request:
                # The first events are on their way: while the engine generates, encode the
                # request side of the record and check the prompt ids, so the write before
                # [DONE] does less.
                request_encoding, encoded_request = encode_request(ctx), True
                assembler.settle_prompt()
            if client_gone or done_seen:
                return  # after [DONE] only the end of the engine's body is left: read below
        pieces = handle_events(decoder.close())
        if pieces:
            await emit(b"".join(pieces))

    try:
        if not client_gone:
            await relay()
    except CLIENT_ERRORS as exc:
        upstream_problem = f"engine stream broke: {type(exc).__name__}: {exc}"
    except UnicodeDecodeError as exc:
        upstream_problem = f"engine stream is not UTF-8: {exc.reason}"
    except asyncio.CancelledError:
        # The handler was cancelled (the client left, with handler cancellation on, or the
        # server is stopping): keep what arrived, then let the cancellation through.
        client_gone = cancelled = True

    record = assembler.finish(latency_ms=elapsed_ms(t0), http_status=upstream.status)
    reasons = stream_end_reasons(
        client_gone=client_gone, problem=upstream_problem, done_seen=done_seen
    )
    if reasons:
        record = mark_incomplete(record, reasons)
    if cancelled:
        await asyncio.shield(finish_call(deps, call, record, request_encoding))
        raise asyncio.CancelledError
    await finish_call(deps, call, record, request_encoding)

    final = b""
    if upstream_problem:
        # Headers are sent; the status can no longer change: tell the harness in-band, and
        # leave out [DONE] so no harness takes the answer for a complete one.
        final = encode_json_event(error_body(upstream_problem, "upstream_error"))
    elif done_seen:
        final = DONE_EVENT
    if not client_gone:
        with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
            await response.write_eof(final)  # the last event and the end of the body: one write
    if done_seen:
        await read_body_end(upstream)
    return response


async def read_body_end(upstream: aiohttp.ClientResponse) -> None:
    """Read the end of an engine's body after its ``[DONE]`` (the chunked terminator, usually
    there already), so the connection goes back to the pool; a body that does not end within
    ``BODY_END_TIMEOUT_S`` is closed instead."""
    try:
        async with asyncio.timeout(BODY_END_TIMEOUT_S):
            await upstream.content.read()
    except CLIENT_ERRORS:
        upstream.close()
