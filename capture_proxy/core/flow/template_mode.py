"""Backend-template mode as a flow: the engine renders the chat template (sans-io).

Owns the decisions of an engine-rendered call: the chat request with the token-data extras of
``core.capture`` (``augment_chat_request``), the relay of the answer as it arrives while the
record is assembled on the side (a chat-completions call gets the engine's own chunks, stripped
of what the proxy added: "capture is additive"; a call of another API gets the canonical answer
encoded by its front codec, event by event), then verify, persist, finish.

Ordering guarantee: the record is persisted before the response finishes (for a stream, before
its last event and the end of the body), so a harness that saw the end of its answer can rely
on the call being readable over REST. Must not import aiohttp or asyncio or do any I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from capture_proxy.core import chunk_scan
from capture_proxy.core.assembly import ChatCaptureAssembler, mark_incomplete, stream_end_reasons
from capture_proxy.core.capture import (
    HarnessAsked,
    augment_chat_request,
    strip_chat_chunk,
    strip_chat_response,
)
from capture_proxy.core.flow.call import (
    CHAT_COMPLETIONS_PATH,
    Call,
    Clock,
    Flow,
    Outcome,
    encode_request,
    finish,
    finish_streamed,
    record_abandoned,
    record_failed,
    refused_stream_end,
    relay_engine_error,
    whole_as_stream,
)
from capture_proxy.core.flow.commands import (
    READ_ENGINE,
    DrainEngine,
    EndClient,
    ReadEngineBody,
    RespondJson,
    SendToEngine,
    StartClientStream,
    WriteClient,
)
from capture_proxy.core.flow.errors import (
    GENERATION_ABORTED,
    EngineAnswerUnusable,
    GenerationAborted,
    engine_unreachable,
)
from capture_proxy.core.flow.events import (
    ClientLeft,
    ClientState,
    EngineBody,
    EngineBroke,
    EngineEnd,
    EngineFailed,
    EngineResponded,
)
from capture_proxy.core.fronts.base import Answer, Api, StreamEncoder
from capture_proxy.core.fronts.chat import DONE_EVENT, openai_error_body
from capture_proxy.core.json_bodies import loads_like_stdlib
from capture_proxy.core.records import CallRecord, Diagnostic, DiagnosticKind
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.sampling import sampling_record
from capture_proxy.core.sse import (
    DONE_SENTINEL,
    SSEStreamDecoder,
    encode_json_event,
    parse_json_event,
)
from capture_proxy.core.version_spans import Observation, WeightVersions

_DONE = DONE_SENTINEL.encode()


def _not_utf8(exc: UnicodeDecodeError) -> str:
    """Why a stream whose bytes are not UTF-8 ended (the record's reason)."""
    return f"engine stream is not UTF-8: {exc.reason}"


#: Why an aborted engine-rendered generation is not continued (backend-template mode: the
#: proxy has no tokens-in request and parser of its own for the model to continue it with).
ABORTED = (
    "the engine aborted the generation (finish_reason abort: a pause for a weight update) and "
    "backend-template mode cannot continue it tokens in; the harness is asked to retry "
    "(prompt_mode exact_tokens continues it, or pause with mode keep or wait)"
)


def with_versions(record: CallRecord, seen: Observation, *, whole: bool) -> CallRecord:
    """``record`` with the weight versions observed around its engine request
    (``core.version_spans``: source ``observed``)."""
    if seen.first is None:
        return record  # (no reading: the versions are unknown, the record as it is)
    versions = WeightVersions()
    versions.add_segment(record.num_generation_tokens, observed=seen, whole=whole)
    spans, source = versions.result()
    if spans is None:
        return record
    diagnostics = record.diagnostics
    if versions.changed:
        changed = Diagnostic(DiagnosticKind.WEIGHT_VERSION_CHANGED, {"changes": versions.changed})
        diagnostics = [*diagnostics, changed]
    return record.replace(
        weight_versions=spans, weight_version_source=source, diagnostics=diagnostics
    )


def aborted_record(record: CallRecord) -> CallRecord:
    """An aborted generation's record: incomplete, with the reason."""
    record = mark_incomplete(record, [ABORTED])
    details = {"reason": ABORTED, "at_token": record.num_generation_tokens}
    return record.replace(
        diagnostics=[*record.diagnostics, Diagnostic(DiagnosticKind.GENERATION_ABORTED, details)]
    )


#: Keys of an engine delta that carry the answer (``reasoning``: vLLM's newer name).
_DELTA_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")


def dumps_body(body: dict[str, Any]) -> bytes:
    """orjson (fast); the stdlib for what orjson refuses (integers past 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False).encode()


def answer_of(call: Call, record: CallRecord, stop_reason: str | int | None = None) -> Answer:
    """The canonical answer from an assembled record (``stop_reason``: the engine's, which
    the record does not keep)."""
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
        stop_reason=stop_reason,
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
    return _answer_part(choices[0].get("delta"))


def _answer_part(delta: Any) -> dict[str, Any] | None:
    """``_canonical_delta`` of the delta itself."""
    if not isinstance(delta, dict):
        return None
    out: dict[str, Any] = {}
    for key in _DELTA_KEYS:
        value = delta.get(key)
        if value:
            out["reasoning_content" if key == "reasoning" else key] = value
    return out or None


def template_call(call: Call, clock: Clock) -> Flow[Outcome]:
    """Serve one captured call through the engine's chat endpoint. Raises
    ``EngineUnreachable`` / ``EngineAnswerUnusable`` (the call recorded as failed)."""
    upstream_body, asked = augment_chat_request(
        call.prepared.body,
        parent_rows_end=call.resolution.parent_rows_end,
        routed_experts=call.ctx.routed_experts_expectation != "off",
        images=call.front_request.images.images if call.front_request.images else None,
    )
    call.ctx = call.ctx.replace(sampling=sampling_record(upstream_body))
    t0 = clock()
    reply = yield SendToEngine(CHAT_COMPLETIONS_PATH, dumps_body(upstream_body), True)
    if isinstance(reply, ClientLeft):
        return Outcome((yield from record_abandoned(call, _ms(clock, t0))))
    if isinstance(reply, EngineFailed):
        yield from record_failed(call, _ms(clock, t0), reply.message, None)
        raise _unreachable(reply, call)
    assert isinstance(reply, EngineResponded)
    if reply.status >= 400:
        body = yield ReadEngineBody()
        raw = body.data if isinstance(body, EngineBody) else b""
        return (
            yield from relay_engine_error(call, reply.status, raw, reply.reason, _ms(clock, t0))
        )
    seen = Observation()
    seen.seen(reply.weight_version, 0)
    if call.ctx.stream and reply.event_stream:
        return (yield from _relay_stream(call, asked, reply.status, clock, t0, seen))
    return (yield from _relay_json(call, asked, reply.status, clock, t0, seen))


def _ms(clock: Clock, t0: float) -> float:
    return (clock() - t0) * 1000.0


def _unreachable(reply: EngineFailed, call: Call) -> Exception:
    return engine_unreachable(reply.message, reply.code, reply.timeout, call.ctx.call_id)


def _relay_json(
    call: Call, asked: HarnessAsked, status: int, clock: Clock, t0: float, seen: Observation
) -> Flow[Outcome]:
    reply = yield ReadEngineBody()
    if isinstance(reply, ClientLeft):
        return Outcome((yield from record_abandoned(call, _ms(clock, t0))))
    if isinstance(reply, EngineFailed):
        yield from record_failed(call, _ms(clock, t0), reply.message, status)
        raise _unreachable(reply, call)
    raw = reply.data
    latency_ms = _ms(clock, t0)
    # The prompt's ids straight into their array (the harness did not ask for them: the body
    # it gets has none): the rest of the body is what orjson parses.
    body_raw, prompt = (raw, None) if asked.return_token_ids else chunk_scan.take_prompt(raw)
    try:
        payload = loads_like_stdlib(body_raw)
        if not isinstance(payload, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        reason = f"engine sent a body that is not a JSON object ({len(raw)} bytes): {exc}"
        yield from record_failed(call, _ms(clock, t0), reason, status)
        raise EngineAnswerUnusable(reason) from exc
    assembler = ChatCaptureAssembler(call.ctx)
    assembler.add_response(payload)
    if prompt is not None:
        assembler.take_prompt(prompt)
    seen.seen(reply.weight_version, len(assembler.generation_token_ids))
    record = assembler.finish(latency_ms=latency_ms, http_status=status)
    record = with_versions(record, seen, whole=True)
    aborted = assembler.finish_reason == "abort"
    if aborted:
        record = aborted_record(record)
    record = yield from finish(call, record)
    if aborted:
        # Never a truncated answer that looks finished: an error the harness retries.
        raise GenerationAborted(ABORTED, call.ctx.call_id)
    if call.front.api is Api.CHAT_COMPLETIONS:
        # (A chat harness that asked for a stream and got a whole answer gets it as the engine
        # sent it.)
        body = strip_chat_response(payload, asked)
    else:
        answer = answer_of(call, record, assembler.stop_reason)
        if call.ctx.stream:
            yield from whole_as_stream(call, answer)
            return Outcome(record)
        body = call.front.encode(call.front_request, answer)
    yield RespondJson(status, body)
    return Outcome(record)


class _Relay:
    """The per-event work of one relayed stream: assemble, then forward (chat: the engine's
    chunk stripped; other APIs: the front's events for the chunk's delta)."""

    def __init__(
        self, call: Call, asked: HarnessAsked, encoder: StreamEncoder | None, seen: Observation
    ):
        self.asked = asked
        self.encoder = encoder
        self.assembler = ChatCaptureAssembler(call.ctx)
        self.done_seen = False
        self.problem: str | None = None
        self.seen = seen
        self.aborted = False
        self.broken = False  # the engine's stream is not UTF-8: it ends here
        self.scan = chunk_scan.SCAN
        self.flags = chunk_scan.scan_flags(asked, event=encoder is None)

    def handle(self, datas: list[bytes]) -> list[bytes]:
        """The client's events for the engine events' data (``SSEStreamDecoder.feed_data``),
        in order. Data that is not UTF-8 stops the stream: ``broken`` is set and what came
        before it is returned. A chunk the compiled scan reads (``chunk_scan``) is not parsed
        here; any other takes the Python path (``_handle_parsed``)."""
        out: list[bytes] = []
        scan, flags = self.scan, self.flags
        for data in datas:
            if data == _DONE:
                self.done_seen = True
                continue
            scanned = scan(data, flags) if scan is not None else None
            if scanned is None:
                if not self._handle_parsed(data, out):
                    return out
                continue
            event, delta, content, token_ids, log_probs = scanned
            self.assembler.add_scanned(token_ids, log_probs)
            parsed = None
            if content is not None:
                self.assembler.content.append(content)
            elif delta is not None:
                parsed = orjson.loads(delta)
                self.assembler.add_delta(parsed)
            if self.encoder is None:
                out.append(event)  # type: ignore[arg-type]
            else:
                answer = {"content": content} if content else _answer_part(parsed)
                if answer is not None:
                    out += self.encoder.delta(answer)
        return out

    def _handle_parsed(self, data: bytes, out: list[bytes]) -> bool:
        """One event's data on the Python path, its events appended to ``out``. False: the
        stream is broken (not UTF-8) and ends here. The first chunk's prompt ids go straight
        into their array (``chunk_scan.take_prompt``) when the harness did not ask for them."""
        prompt = None
        if self.assembler.prompt_token_ids is None and not self.asked.return_token_ids:
            data, prompt = chunk_scan.take_prompt(data)
        try:
            chunk = parse_json_event(data)
            if type(chunk) is not dict:
                raise ValueError("not a JSON object")
        except UnicodeDecodeError as exc:
            self.problem, self.broken = _not_utf8(exc), True
            return False
        except ValueError as exc:
            # Not forwarded: a harness would choke on it. The stream ends with an error.
            self.problem = f"engine sent a malformed stream event ({len(data)} bytes): {exc}"
            return True
        self.assembler.add_chunk(chunk)
        if prompt is not None:
            self.assembler.take_prompt(prompt)
        if self.assembler.finish_reason == "abort" and not self.aborted:
            # Not forwarded: the harness would take the cut answer for a finished one.
            self.aborted, self.problem = True, ABORTED
            return True
        if self.encoder is None:
            stripped = strip_chat_chunk(chunk, self.asked)
            if stripped is not None:
                out.append(encode_json_event(stripped))
        else:
            delta = _canonical_delta(chunk)
            if delta is not None:
                out += self.encoder.delta(delta)
        return True


def _pump(call: Call, relay: _Relay) -> Flow[tuple[bool, RequestEncoding | None]]:
    """Engine bytes in, the client's events out, one write per engine read however many
    events it completed. Returns (client gone, the request's encoding)."""
    decoder = SSEStreamDecoder()
    request_encoding: RequestEncoding | None = None
    encoded = False
    while True:
        piece = yield READ_ENGINE
        if isinstance(piece, ClientLeft):
            return True, request_encoding
        if isinstance(piece, EngineBroke):
            relay.problem = f"engine stream broke: {piece.error_type}: {piece.message}"
            return False, request_encoding
        if piece.weight_version is not None:
            relay.seen.seen(piece.weight_version, len(relay.assembler.generation_token_ids))
        try:
            end = isinstance(piece, EngineEnd)
            datas = decoder.close_data() if end else decoder.feed_data(piece.data)
        except UnicodeDecodeError as exc:
            relay.problem = _not_utf8(exc)
            return False, request_encoding
        state: ClientState = yield WriteClient(b"".join(relay.handle(datas)))
        if end or relay.broken:
            return state.gone, request_encoding
        if not encoded:
            # The first events are on their way: while the engine generates, encode the
            # request side of the record and check the prompt ids, so the write before the
            # end does less.
            request_encoding, encoded = encode_request(call), True
            relay.assembler.settle_prompt()
        if state.gone or relay.done_seen:
            # after [DONE] only the end of the engine's body is left: drained at the end
            return state.gone, request_encoding


def _relay_stream(
    call: Call, asked: HarnessAsked, status: int, clock: Clock, t0: float, seen: Observation
) -> Flow[Outcome]:
    """Forward SSE events as they complete, assembling the record on the side."""
    chat = call.front.api is Api.CHAT_COMPLETIONS
    encoder = None if chat else call.front.stream_encoder(call.front_request, call.answer_head())
    relay = _Relay(call, asked, encoder, seen)
    # The harness left before the engine's first byte: the call (nothing arrived) is recorded
    # as incomplete; the executor's end closes the engine's request.
    state: ClientState = yield StartClientStream(status if chat else 200)
    gone, request_encoding = state.gone, None
    if not gone and encoder is not None:
        state = yield WriteClient(b"".join(encoder.start()))
        gone = state.gone
    if not gone:
        gone, request_encoding = yield from _pump(call, relay)
    record = relay.assembler.finish(latency_ms=_ms(clock, t0), http_status=status)
    record = with_versions(record, relay.seen, whole=False)
    problem = None if relay.aborted else relay.problem
    reasons = stream_end_reasons(client_gone=gone, problem=problem, done_seen=relay.done_seen)
    if reasons:
        record = mark_incomplete(record, reasons)
    if relay.aborted:
        record = aborted_record(record)
    record, refusal = yield from finish_streamed(call, record, request_encoding)
    if gone:
        return Outcome(record)
    final = b""
    if refusal is not None:
        final = refused_stream_end(encoder, refusal)
    elif relay.problem:
        # Headers are sent; the status can no longer change: tell the harness in-band, and
        # leave out the clean end so no harness takes the answer for a complete one.
        if encoder is None:
            final = encode_json_event(openai_error_body(relay.problem, "upstream_error"))
        else:
            # an abort is the error a retry may cure (Anthropic's overloaded_error), as the
            # 503 of a whole answer is
            final = encoder.error(relay.problem, code=GENERATION_ABORTED if relay.aborted else None)
    elif relay.done_seen:
        final = (
            DONE_EVENT
            if encoder is None
            else b"".join(encoder.finish(answer_of(call, record, relay.assembler.stop_reason)))
        )
    yield EndClient(final)  # the last events and the end of the body: one write
    if relay.done_seen:
        yield DrainEngine()
    return Outcome(record)
