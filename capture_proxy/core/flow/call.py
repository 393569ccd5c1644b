"""One captured call in flight, and the steps every back end's flow ends with (sans-io).

Owns the call's request-time state (``Call``: front, parsed request, context, prepared request,
verdict) and the shared sub-flows: finish (verify the link, persist, remember: ``finish``; a
record the store refused ends the call with ``StoreUnavailable``, or for a stream whose headers
are out with the API's in-band error: ``finish_streamed``, ``refused_stream_end``),
record a call the engine failed (``record_failed``) or the harness left (``record_abandoned``),
answer an engine 4xx/5xx in the front's error shape (``relay_engine_error``), show the whole
answer as a stream (``whole_as_stream``). Sub-flows are generators of ``commands``; ``yield
from`` them. Must not import aiohttp or asyncio or do any I/O; the clock is passed in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from capture_proxy.core.assembly import (
    CallContext,
    abandoned_record,
    failed_record,
    mark_incomplete,
)
from capture_proxy.core.capture import PreparedRequest
from capture_proxy.core.flow.commands import (
    Command,
    EndClient,
    Persist,
    Remember,
    RespondJson,
    StartClientStream,
    Verify,
)
from capture_proxy.core.flow.errors import StoreUnavailable
from capture_proxy.core.flow.events import ClientState, Persisted, Verified
from capture_proxy.core.fronts.base import (
    Answer,
    Api,
    FrontCodec,
    FrontRequest,
    StreamEncoder,
    TokenIds,
    answer_as_deltas,
)
from capture_proxy.core.fronts.chat import chat_error_event
from capture_proxy.core.image_spans import record_images
from capture_proxy.core.known_messages import message_digests
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.records import CallRecord, CallStatus
from capture_proxy.core.redact import redact_text
from capture_proxy.core.request_encoding import RequestEncoding

T = TypeVar("T")
#: A flow: yields commands, is sent each command's reply, returns its result.
Flow = Generator[Command, Any, T]
#: Monotonic seconds (``time.perf_counter`` in the proxy; a fake in tests).
Clock = Callable[[], float]

#: The engine path of backend-template mode, whatever API the call came in on.
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Outcome:
    """How a call ended: ``record``: the record as stored (verified), None when the call
    made none (refused before the engine, left before a record could be made)."""

    record: CallRecord | None


@dataclass
class Call:
    """One captured call in flight: its front (codec and parsed request), context, prepared
    canonical request, request-time verdict and retry header. The back end's flow sets
    ``ctx`` (its sampling, routed-expert start) and ``resolution`` (the parent it spliced
    from) once it knows them."""

    front: FrontCodec
    front_request: FrontRequest
    ctx: CallContext
    prepared: PreparedRequest
    resolution: Resolution
    retry_count: str | None
    #: the model an answer names when the request names none (exact-token mode: the
    #: engine's served model, since OpenAI's schema requires a string)
    served_model: str | None = None
    #: the harness session the request names (``core.sessions.session_key`` of
    #: ``ctx.request_received`` and ``ctx.session_headers``; None: none)
    session: tuple[str, str] | None = None

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


def encode_request(call: Call) -> RequestEncoding | None:
    """The ``RequestEncoding`` of the call's request, from the messages' known facts (their
    canonical texts and digests); None when it has no canonical text (the store's write then
    names the problem)."""
    body = call.ctx.request_body
    messages = body.get("messages") or []
    prepared = call.prepared
    facts = prepared.message_facts
    own = body is prepared.body  # (the facts are of the prepared body's values)
    received = call.front_request.received.get("tools")
    try:
        digests = None
        if facts is not None and own and len(facts) == len(messages):
            digests = prepared.digests or message_digests(facts)
        return RequestEncoding.of(
            messages,
            body.get("tools"),
            digests,
            prepared.tools_facts if own else None,
            received,
            call.front_request.received_tools_facts,
        )
    except ValueError:
        return None


def finish(
    call: Call, record: CallRecord, request: RequestEncoding | None = None
) -> Flow[CallRecord]:
    """Verify the link, persist (``request``: the record's ``RequestEncoding``, if computed
    ahead), make the call findable. Returns the record as stored (a verification that fails
    leaves the call unresolved). Raises StoreUnavailable when the store did not take the
    record and the call must not be answered as a success (``Persisted.refused``), unless the
    call failed: its error answer stays (nothing is lost that was acknowledged)."""
    prepared = call.prepared
    record = with_images(call, record)
    reply = yield Verify(
        record,
        call.resolution,
        prepared.linking_messages,
        prepared.harness_note,
        call.retry_count,
        prepared.prefill,
    )
    if isinstance(reply, Verified):
        record = reply.record
    else:
        record = record.replace(
            parent_call_id=None,
            linking={
                "verdict": Verdict.UNRESOLVED.value,
                "reason": f"verification failed: {reply.message}",
            },
        )
    if request is None:
        request = encode_request(call)
    persisted: Persisted = yield Persist(record, request)
    if persisted.ok:
        # (facts that do not fit the record's messages are not kept: RecentCalls.put)
        yield Remember(record, prepared.message_facts, call.session)
    elif persisted.refused and record.status is not CallStatus.FAILED:
        # DESIGN.md, flow step 8: no success for a call nobody can train on.
        raise StoreUnavailable(call.ctx.call_id, persisted.reason)
    return record


def finish_streamed(
    call: Call, record: CallRecord, request: RequestEncoding | None = None
) -> Flow[tuple[CallRecord, StoreUnavailable | None]]:
    """``finish`` for a stream whose headers are sent: the refusal (``StoreUnavailable``) is
    returned beside the record, not raised, for the stream's end (``refused_stream_end``)."""
    try:
        return (yield from finish(call, record, request)), None
    except StoreUnavailable as refusal:
        return record, refusal


def refused_stream_end(encoder: StreamEncoder | None, refusal: StoreUnavailable) -> bytes:
    """The last event of a stream whose call the store refused: its API's in-band error (the
    front's ``encoder``; None: the engine's chat chunks relayed, OpenAI's error event), and no
    clean end (no ``[DONE]``, ``message_stop`` or ``response.completed``), so no harness takes
    the answer for one it may keep."""
    if encoder is None:
        return chat_error_event(refusal.message, code=refusal.code)
    return encoder.error(refusal.message, code=refusal.code)


def with_images(call: Call, record: CallRecord) -> CallRecord:
    """``record`` with its images (``core.image_spans``): their entries in prompt order, their
    bytes for the store; incomplete when its prompt's placeholder runs do not pair with them.
    A call without images is returned as it is."""
    request_images = call.front_request.images
    if request_images is None:
        return record
    found = record_images(
        call.ctx.request_body.get("messages") or [],
        request_images.images,
        record.prompt_token_ids,
        call.ctx.vision,
    )
    record = record.replace(
        images=found.entries,
        image_data=found.data,
        diagnostics=[*record.diagnostics, *found.diagnostics],
    )
    if found.unaligned and record.status is CallStatus.COMPLETE:
        record = mark_incomplete(
            record, ["the prompt's image placeholders do not pair with the request's images"]
        )
    return record


def record_failed(
    call: Call,
    latency_ms: float,
    reason: str,
    http_status: int | None,
    prompt_token_ids: Any = None,
) -> Flow[CallRecord]:
    """Record a call the engine did not answer (``prompt_token_ids``: the prompt, when the
    proxy built it)."""
    record = failed_record(
        call.ctx, reason=redact_text(reason), latency_ms=latency_ms, http_status=http_status
    )
    if prompt_token_ids is not None:
        record.prompt_token_ids = prompt_token_ids
    return (yield from finish(call, record))


def record_abandoned(
    call: Call, latency_ms: float, prompt_token_ids: Any = None
) -> Flow[CallRecord]:
    """Record a call the harness left before the engine answered (``incomplete``, no token
    data). ``prompt_token_ids``: the prompt, when the proxy built it."""
    record = abandoned_record(
        call.ctx, reason="client disconnected before the engine answered", latency_ms=latency_ms
    )
    if prompt_token_ids is not None:
        record.prompt_token_ids = prompt_token_ids
    # A refusal has no one to tell: the harness left.
    return (yield from finish_streamed(call, record))[0]


def _engine_error_message(payload: Any, raw: bytes, reason: str | None) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        message = payload["error"].get("message")
        if isinstance(message, str):
            return message
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return str(payload["message"])
    return raw.decode("utf-8", "replace")[:2000] or reason or "engine error"


def engine_error_body(call: Call, status: int, raw: bytes, reason: str | None) -> Any:
    """The client's body for an engine 4xx/5xx: a chat-completions call gets the engine's
    OpenAI-shaped body as sent; other calls (or a body of another shape) the front's error
    shape, naming the engine's message."""
    try:
        payload: Any = json.loads(raw)
    except ValueError:
        payload = None
    shaped = isinstance(payload, dict) and isinstance(payload.get("error"), dict)
    if shaped and call.front.api == Api.CHAT_COMPLETIONS:
        return payload
    message = _engine_error_message(payload, raw, reason)
    error_type = "invalid_request_error" if status < 500 else "upstream_error"
    return call.front.error_body(
        status, f"engine returned {status}: {message}", error_type=error_type, param=None, code=None
    )


def relay_engine_error(
    call: Call,
    status: int,
    raw: bytes,
    reason: str | None,
    latency_ms: float,
    prompt_token_ids: Any = None,
) -> Flow[Outcome]:
    """Answer an engine 4xx/5xx in the front's error shape; record the call as failed."""
    body = engine_error_body(call, status, raw, reason)
    record = yield from record_failed(
        call, latency_ms, f"engine returned HTTP {status}", status, prompt_token_ids
    )
    yield RespondJson(status, body)
    return Outcome(record)


def whole_as_stream(call: Call, answer: Answer) -> Flow[bool]:
    """A harness asked for a stream and the engine answered whole: the answer as the front's
    event sequence, in one write (the record is already stored). Returns whether the client
    was still there."""
    encoder = call.front.stream_encoder(
        call.front_request, call.answer_head(answer.prompt_token_ids)
    )
    events = encoder.start()
    for delta in answer_as_deltas(answer.message):
        events += encoder.delta(delta)
    events += encoder.finish(answer)
    state: ClientState = yield StartClientStream(200)
    if state.gone:
        return False
    state = yield EndClient(b"".join(events))
    return not state.gone
