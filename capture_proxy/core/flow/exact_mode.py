"""Exact-token mode as a flow: the proxy builds the prompt, the engine generates from ids.

Owns the decisions of an exact-token call after its prompt (``core.flow.prompt``): the
sampling settings (``core.sampling``, clamped to the context), the tokens-in request of the
engine's dialect (``core.engine_formats``) with the constraint vLLM puts on the request's tool
choice (``families.structural_tags``), the generated text parsed back into an assistant message
(the family's parser, as the tool choice answers: ``families.tool_choice``), and the answer,
streamed as the front's events as they can be decided when the harness asked for a stream.
The record is persisted before the response ends, exactly as in backend-template mode. Must
not import aiohttp or asyncio or do any I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson

from capture_proxy.core.assembly import mark_incomplete, stream_end_reasons
from capture_proxy.core.engine_formats import EngineFormatError, Reader
from capture_proxy.core.flow.call import (
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
    AskEngineFacts,
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
    EngineFacts,
    EngineFailed,
    EngineResponded,
)
from capture_proxy.core.flow.exact_images import engine_prompt
from capture_proxy.core.flow.prompt import ExactFamily, Prompt, exact_prompt
from capture_proxy.core.flow.resume import resume
from capture_proxy.core.fronts.base import Answer
from capture_proxy.core.fronts.chat import chat_usage
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.records import CallRecord, Diagnostic, DiagnosticKind
from capture_proxy.core.sampling import (
    Sampling,
    SamplingError,
    sampling_from_chat,
    sampling_record_tokens_in,
)
from capture_proxy.core.sse import SSEStreamDecoder, parse_json_event
from capture_proxy.core.tokens_in_assembly import TokensInAssembler, prompt_ids_json
from capture_proxy.families.parsing import MessageDelta, OutputParser, apply_deltas
from capture_proxy.families.structural_tags import ToolConstraintError, tool_constraint
from capture_proxy.families.tool_choice import (
    ToolChoice,
    choice_parser,
    finish_reason,
    tool_choice_of,
)

#: the request's own constraints, which the tool choice's constraint replaces
_OWN_CONSTRAINTS = ("structured_outputs", "response_format")


def _ms(clock: Clock, t0: float) -> float:
    return (clock() - t0) * 1000.0


def constrained(
    sampling: Sampling, exact: ExactFamily, body: dict[str, Any], choice: ToolChoice
) -> Sampling:
    """The sampling with the constraint vLLM's chat completions put on the generation for the
    request's tools and ``tool_choice`` (``families.structural_tags``: a structural tag in
    ``structured_outputs``, replacing the request's own). SGLang's ``/generate`` is not sent
    one: a call that needs it is refused. Raises SamplingError."""
    fmt = getattr(exact.parser, "tool_call_format", None)
    try:
        constraint = tool_constraint(fmt, body.get("tools"), choice, body)
    except ToolConstraintError as exc:
        raise SamplingError(str(exc), exc.param) from None
    if constraint is None:
        return sampling
    if exact.dialect.name == "sglang_generate":
        raise SamplingError(
            f"tool_choice {choice.describe()} constrains the generation as vLLM does (a "
            "structural tag), which is not sent to SGLang's /generate in exact_tokens mode",
            "tool_choice",
        )
    extra = {k: v for k, v in sampling.extra.items() if k not in _OWN_CONSTRAINTS}
    extra["structured_outputs"] = constraint
    return dataclasses.replace(sampling, extra=extra)


def _engine_body(
    call: Call, exact: ExactFamily, prompt: Prompt, sampling: Sampling, prompt_json: bytes
) -> bytes:
    """The tokens-in request (JSON) of the call's prompt; with images, the engine expands each
    image's placeholder itself (``exact_images``)."""
    body = call.prepared.body
    images = call.front_request.images
    with_images = engine_prompt(
        body.get("messages") or [],
        images.images if images else None,
        exact.dialect.name,
        prompt.token_ids,
    )
    engine_body = exact.dialect.request(
        orjson.Fragment(prompt_json if with_images is None else with_images.prompt_json),
        sampling,
        stream=call.ctx.stream,
        model=body.get("model"),
        experts_start=prompt.experts_start,
    )
    if with_images is not None:
        engine_body.update(with_images.fields)
    return orjson.dumps(engine_body)


def exact_call(call: Call, exact: ExactFamily, known: KnownMessages, clock: Clock) -> Flow[Outcome]:
    """Serve one captured call from exact tokens. Raises RenderError, SamplingError,
    PrefillNotSupported (nothing stored), EngineUnreachable, EngineAnswerUnusable (the call
    recorded as failed)."""
    body = call.prepared.body
    t_ready = clock()
    facts = yield AskEngineFacts(served_model=body.get("model") is None)
    if isinstance(facts, EngineFailed):
        # The engine cannot be asked what the prompt needs: the call fails, and is recorded
        # as failed, as in backend-template mode.
        yield from record_failed(call, _ms(clock, t_ready), facts.message, None)
        raise engine_unreachable(facts.message, facts.code, facts.timeout, call.ctx.call_id)
    assert isinstance(facts, EngineFacts)
    if body.get("model") is None:
        call.served_model = facts.served_model
    prompt = yield from exact_prompt(call, exact, known, facts.end_of_turn_ids)
    sampling = sampling_from_chat(
        body, num_prompt_tokens=int(prompt.token_ids.shape[0]), max_model_len=facts.max_model_len
    )
    choice = tool_choice_of(body)
    sampling = constrained(sampling, exact, body, choice)
    if prompt.spliced_from is not None:
        # Verification prefers the parent the prompt was spliced from.
        call.resolution = call.resolution.preferring(prompt.spliced_from)
    # Rows are asked for from where the parent's end (0 when the prompt is not the parent's).
    call.ctx = call.ctx.replace(
        sampling=sampling_record_tokens_in(sampling),
        routed_experts_start=prompt.experts_start,
    )
    extra_diags = list(prompt.diagnostics)
    if sampling.clamped_from is not None:
        clamped = {"requested": sampling.clamped_from, "max_tokens": sampling.max_tokens}
        extra_diags.append(Diagnostic("max_tokens_clamped", clamped))
    # The prompt is the one part of the body that grows with the history: written once, by
    # orjson straight from the array, put in the body as it is and compared with the echo.
    prompt_json = prompt_ids_json(prompt.token_ids)
    engine_body = _engine_body(call, exact, prompt, sampling, prompt_json)
    t0 = clock()
    reply = yield SendToEngine(exact.dialect.path, engine_body, False)
    if isinstance(reply, ClientLeft):
        return Outcome((yield from record_abandoned(call, _ms(clock, t0), prompt.token_ids)))
    if isinstance(reply, EngineFailed):
        yield from record_failed(call, _ms(clock, t0), reply.message, None, prompt.token_ids)
        raise engine_unreachable(reply.message, reply.code, reply.timeout, call.ctx.call_id)
    assert isinstance(reply, EngineResponded)
    asm = TokensInAssembler(
        call.ctx, prompt.token_ids, exact.dialect.decode_routed_experts, prompt_json
    )
    if reply.status >= 400:
        got = yield ReadEngineBody()
        raw = got.data if isinstance(got, EngineBody) else b""
        return (
            yield from relay_engine_error(
                call, reply.status, raw, reply.reason, _ms(clock, t0), prompt.token_ids
            )
        )
    asm.observe(reply.weight_version)
    run = _Generation(
        call,
        exact,
        asm,
        exact.dialect.reader(exact.decode),
        extra_diags,
        clock,
        t0,
        sampling,
        choice,
    )
    if call.ctx.stream and reply.event_stream:
        return (yield from run.stream(reply.status))
    return (yield from run.whole(reply.status))


@dataclass
class _Generation:
    """One tokens-in generation: engine pieces in, the record and the front's answer out. An
    engine abort (a pause for a weight update) is continued tokens in once the engine serves
    again (``_resume``): the harness sees one answer."""

    call: Call
    exact: ExactFamily
    asm: TokensInAssembler
    reader: Reader
    extra_diags: list[Diagnostic]
    clock: Clock
    t0: float
    sampling: Sampling
    #: the request's tool choice: how the generation is parsed and finishes
    choice: ToolChoice
    resumes: list[dict[str, Any]] = field(default_factory=list)
    #: why an aborted generation was not continued (the call is then incomplete)
    aborted: str | None = None

    def record(
        self, message: dict[str, Any], finish_reason: str, status: int, whole: bool = False
    ) -> CallRecord:
        diagnostics = list(self.extra_diags)
        if self.resumes:
            diagnostics.append(
                Diagnostic(DiagnosticKind.GENERATION_RESUMED, {"resumes": self.resumes})
            )
        record = self.asm.finish(
            response_message=message,
            finish_reason=finish_reason,
            latency_ms=_ms(self.clock, self.t0),
            http_status=status,
            extra_diagnostics=diagnostics,
            whole=whole,
        )
        if self.aborted is not None:
            generated = len(self.asm.token_ids)
            details = {"reason": self.aborted, "at_token": generated}
            record = mark_incomplete(record, [self.aborted])
            record.diagnostics.append(Diagnostic(DiagnosticKind.GENERATION_ABORTED, details))
        return record

    @property
    def parser(self) -> OutputParser:
        return choice_parser(self.exact.parser, self.choice)

    def answer(self, message: dict[str, Any], finish_reason: str) -> Answer:
        call, asm = self.call, self.asm
        return Answer(
            call_id=call.ctx.call_id,
            created_at=call.ctx.created_at,
            model=call.answer_model,
            message=message,
            finish_reason=finish_reason,
            usage=chat_usage(int(asm.prompt_token_ids.shape[0]), len(asm.token_ids)),
            stop_reason=asm.stop_reason,
            token_ids=asm.token_ids,
            log_probs=asm.log_probs,
            prompt_token_ids=asm.prompt_token_ids,
        )

    def _resume(self) -> Flow[str]:
        return (yield from resume(self))

    def _read_whole(self, status: int) -> Flow[Outcome | None]:
        """Read one engine body into the assembler (None), or record the call abandoned."""
        call, asm = self.call, self.asm
        reply = yield ReadEngineBody()
        if isinstance(reply, ClientLeft):
            latency_ms = _ms(self.clock, self.t0)
            return Outcome((yield from record_abandoned(call, latency_ms, asm.prompt_token_ids)))
        try:
            if isinstance(reply, EngineFailed):
                raise _ReadFailed(f"{reply.error_type}: {reply.detail}")
            # parse_json_event: engines write bare NaN / -Infinity log probs (orjson refuses)
            payload = parse_json_event(reply.data)
            if not isinstance(payload, dict):
                raise EngineFormatError("not a JSON object")
            asm.add(self.reader.whole(payload))
        except (_ReadFailed, ValueError) as exc:
            detail = str(exc) if isinstance(exc, _ReadFailed) else f"{type(exc).__name__}: {exc}"
            reason = f"engine answer unusable: {detail}"
            latency_ms = _ms(self.clock, self.t0)
            yield from record_failed(call, latency_ms, reason, status, asm.prompt_token_ids)
            err = EngineAnswerUnusable(reason)
            err.call_id = call.ctx.call_id
            raise err from exc
        asm.observe(reply.weight_version)
        return None

    def whole(self, status: int) -> Flow[Outcome]:
        call, asm = self.call, self.asm
        left = yield from self._read_whole(status)
        while left is None and asm.finish_reason == "abort" and self.aborted is None:
            resumed = yield from self._resume()
            if resumed == "left":
                latency_ms = _ms(self.clock, self.t0)
                return Outcome(
                    (yield from record_abandoned(call, latency_ms, asm.prompt_token_ids))
                )
            if resumed == "continued":
                left = yield from self._read_whole(status)
        if left is not None:
            return left
        parsed = self.parser.parse(
            asm.generated_text,
            call.ctx.call_id,
            token_ids=asm.token_ids,
            tools=call.prepared.body.get("tools"),
            in_reasoning=self.exact.opens_reasoning(asm.prompt_token_ids),
        )
        reason = finish_reason(self.choice, asm.finish_reason, bool(parsed.tool_calls))
        message = parsed.to_openai()
        record = yield from finish(call, self.record(message, reason, status, whole=True))
        if self.aborted is not None:
            # Never a truncated answer that looks finished: an error the harness retries.
            raise GenerationAborted(self.aborted, call.ctx.call_id)
        answer = self.answer(message, reason)
        if call.ctx.stream:
            # Asked for a stream; the engine answered whole: the whole answer as events.
            yield from whole_as_stream(call, answer)
        else:
            yield RespondJson(200, call.front.encode(call.front_request, answer))
        return Outcome(record)

    def _pump_all(self, pump: _Pump) -> Flow[bool]:
        """Pump the engine's stream and, after each abort, its continuation's; whether the
        harness left."""
        gone = yield from pump.run()
        while not gone and pump.problem is None and self.asm.finish_reason == "abort":
            resumed = yield from self._resume()
            if resumed == "left":
                return True
            if resumed == "stopped":
                pump.problem = self.aborted
                break
            gone = yield from pump.run()
        return gone

    def stream(self, status: int) -> Flow[Outcome]:
        """Engine token chunks in, the front's events out, as they can be decided."""
        call, asm = self.call, self.asm
        encoder = call.front.stream_encoder(
            call.front_request, call.answer_head(asm.prompt_token_ids)
        )
        state: ClientState = yield StartClientStream(200)
        if not state.gone:
            state = yield WriteClient(b"".join(encoder.start()))
        # The first events are out: encode the request side of the record while the engine
        # generates.
        request_encoding = encode_request(call)
        pump = _Pump(self, encoder)
        gone = state.gone
        if not gone:
            gone = yield from self._pump_all(pump)
        events: list[bytes] = []
        for d in pump.parser_stream.finish():
            pump.deltas.append(d)
            events += encoder.delta(d.to_openai())
        message = apply_deltas(pump.deltas).to_openai()
        reason = finish_reason(self.choice, asm.finish_reason, bool(message.get("tool_calls")))
        record = self.record(message, reason, status)
        problem = None if self.aborted is not None else pump.problem
        reasons = stream_end_reasons(client_gone=gone, problem=problem, done_seen=pump.done)
        if reasons:
            record = mark_incomplete(record, reasons)
        record, refusal = yield from finish_streamed(call, record, request_encoding)
        if gone:
            return Outcome(record)
        if refusal is not None:
            events.append(refused_stream_end(encoder, refusal))
        elif pump.problem:
            # an abort not continued is the error a retry may cure (Anthropic's
            # overloaded_error), as the 503 of a whole answer is
            code = GENERATION_ABORTED if self.aborted is not None else None
            events.append(encoder.error(pump.problem, code=code))
        else:
            events += encoder.finish(self.answer(message, reason))
        yield EndClient(b"".join(events))
        return Outcome(record)


class _ReadFailed(Exception):
    """The engine's whole body could not be read (its exception's class name and text)."""


class _Pump:
    """The engine's stream read piece by piece: each piece assembled, parsed into message
    deltas and forwarded as the front's events, one write per engine read."""

    def __init__(self, gen: _Generation, encoder: Any) -> None:
        self.gen = gen
        self.encoder = encoder
        self.deltas: list[MessageDelta] = []
        self.problem: str | None = None
        self.done = False
        call = gen.call
        self.parser_stream = gen.parser.stream(
            call.ctx.call_id,
            call.prepared.body.get("tools"),
            in_reasoning=gen.exact.opens_reasoning(gen.asm.prompt_token_ids),
        )

    def events_of(self, data: bytes, decoder: SSEStreamDecoder) -> list[bytes]:
        """The front's events for one engine read. Raises ValueError, EngineFormatError."""
        out: list[bytes] = []
        encoder, asm = self.encoder, self.gen.asm
        for event_data in decoder.feed_data(data):
            if event_data == b"[DONE]":
                self.done = True
                continue
            piece = self.gen.reader.chunk_data(event_data)
            asm.add(piece)
            new = self.parser_stream.feed(piece.text, piece.token_ids)
            self.deltas += new
            if new:
                # token data goes with the first delta of its piece
                out += encoder.delta(
                    new[0].to_openai(), token_ids=piece.token_ids, log_probs=piece.log_probs
                )
                for d in new[1:]:
                    out += encoder.delta(d.to_openai())
            elif piece.token_ids:
                out += encoder.delta({}, token_ids=piece.token_ids, log_probs=piece.log_probs)
        return out

    def run(self) -> Flow[bool]:
        """Read one engine stream until its end, a problem or the client leaving; returns
        whether the client left."""
        decoder = SSEStreamDecoder()
        self.done = False
        while True:
            piece = yield READ_ENGINE
            if isinstance(piece, ClientLeft):
                return True
            if isinstance(piece, EngineBroke):
                self.problem = f"engine stream broke: {piece.error_type}: {piece.message}"
                return False
            if piece.weight_version is not None:
                self.gen.asm.observe(piece.weight_version)
            if isinstance(piece, EngineEnd):
                return False
            try:
                out = self.events_of(piece.data, decoder)
            except (ValueError, EngineFormatError) as exc:
                self.problem = f"engine sent a malformed stream event: {exc}"
                return False
            state: ClientState = yield WriteClient(b"".join(out))
            if state.gone:
                return True
