"""The flow of one captured call from its parsed request (sans-io): the entry point.

Owns what happens between the front's parse and the back end: the refusal of a prefill the
family cannot continue (before anything is resolved or forwarded), harness notes
(``core.capture.prepare_request``), parent resolution (a command: ``Linker.resolve``; its
failure leaves the call unresolved, never fails it), the call's context, then one back end's
flow: ``core.flow.template_mode`` (the engine renders) or ``core.flow.exact_mode`` (the proxy
sends exact tokens). Returns the ``Outcome`` with the stored record. Must not import aiohttp
or asyncio or do any I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_proxy.core.assembly import CallContext
from capture_proxy.core.capture import NoteMatcher, PreparedRequest, prepare_request
from capture_proxy.core.flow.call import CHAT_COMPLETIONS_PATH, Call, Clock, Flow, Outcome
from capture_proxy.core.flow.commands import Resolve
from capture_proxy.core.flow.events import Resolved, StepFailed
from capture_proxy.core.flow.exact_mode import exact_call
from capture_proxy.core.flow.prompt import ExactFamily, refuse_if_cannot_continue
from capture_proxy.core.flow.template_mode import template_call
from capture_proxy.core.fronts.base import FrontCodec, FrontRequest
from capture_proxy.core.known_bodies import ParsedBody
from capture_proxy.core.known_messages import KnownMessages, MessageFacts
from capture_proxy.core.linking.digests import request_digest, request_digest_after
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.sessions import session_key
from capture_proxy.families.vision import VisionProcessorConfig


@dataclass(frozen=True)
class CallStart:
    """A captured call as the adapter hands it to the flow.

    ``exact``: the exact-token machinery of the call's model (None: backend-template mode);
    ``message_facts``: the facts of the canonical messages (None: derive what is needed);
    ``retry_count``: the harness's retry header; ``session_headers``: the headers naming its
    session, the only other ones a record keeps; ``routed_experts_expectation``: the model's
    ``routed_experts`` setting (``required`` | ``optional`` | ``off``); ``clock``: monotonic
    seconds, for latencies."""

    front: FrontCodec
    front_request: FrontRequest
    rollout_id: str
    call_id: str
    created_at: float
    retry_count: str | None
    notes: NoteMatcher | None
    known: KnownMessages
    message_facts: tuple[MessageFacts, ...] | None
    exact: ExactFamily | None
    routed_experts_expectation: str
    clock: Clock
    #: the image processor settings of the model (``image_processors``; None: none)
    vision: VisionProcessorConfig | None = None
    #: the request's session headers (``core.sessions.session_headers``; None: none)
    session_headers: dict[str, str] | None = None
    #: the request as ``known_bodies`` read it (its session's earlier request, where the
    #: request digest goes on from; None: not read so)
    history: ParsedBody | None = None


def retry_requested(retry_count: str | None) -> bool:
    """The harness says this request is a retry: an OpenAI or Anthropic SDK (Stainless
    clients: OpenCode's, Claude Code's) sends ``x-stainless-retry-count`` = 0 on the first
    attempt and the attempt number on retries."""
    return retry_count is not None and retry_count.strip().isdigit() and int(retry_count) > 0


def _sorted_tools_text(prepared: PreparedRequest) -> bytes | None:
    facts = prepared.tools_facts
    return facts.sorted_text if facts is not None else None


def _request_digest(prepared: PreparedRequest, history: ParsedBody | None) -> str | None:
    """The request digest of the call's canonical body, going on from its session's earlier
    request where ``history`` knows its state (and keeping this one's there); None where it
    cannot be made (the linker's resolution makes it, and names the error)."""
    earlier = history.earlier_digest_state() if history is not None else None
    try:
        digest, state = request_digest_after(prepared.body, _sorted_tools_text(prepared), earlier)
    except Exception:  # (the resolution step's, as before: the call goes on unresolved)
        return None
    if history is not None:
        history.keep_digest_state(state)
    return digest


def captured_call(start: CallStart) -> Flow[Outcome]:
    """The flow of one captured call. Raises the core's errors (``proxy.errors.CORE_ERRORS``
    maps each to the client's error)."""
    chat = start.front_request.chat
    if start.exact is not None:
        refuse_if_cannot_continue(start.exact, chat)
    prepared = prepare_request(
        chat, start.notes, start.message_facts, start.front_request.tools_facts
    )
    session = session_key(start.front_request.received, start.session_headers)
    digest = _request_digest(prepared, start.history)
    reply = yield Resolve(
        start.rollout_id,
        prepared.linking_messages,
        prepared.body,
        start.call_id,
        start.created_at,
        prepared.linking_facts,
        prepared.tools_facts,
        session,
        retry_requested(start.retry_count),
        digest,
        prepared.history_keys,
    )
    if isinstance(reply, Resolved):
        resolution = reply.resolution
    else:
        assert isinstance(reply, StepFailed)
        resolution = Resolution(
            Verdict.UNRESOLVED,
            None,
            digest or request_digest(prepared.body, _sorted_tools_text(prepared)),
            reason=f"parent resolution failed: {reply.error_type}: {reply.message}",
        )
    exact = start.exact
    ctx = CallContext(
        call_id=start.call_id,
        rollout_id=start.rollout_id,
        created_at=start.created_at,
        stream=start.front_request.stream,
        upstream_path=CHAT_COMPLETIONS_PATH if exact is None else exact.dialect.path,
        request_body=prepared.body,
        routed_experts_start=resolution.parent_rows_end or 0,
        api=start.front.api.value,
        request_received=start.front_request.received,
        session_headers=start.session_headers,
        routed_experts_expectation=start.routed_experts_expectation,
        parent_had_rows=resolution.parent_rows_end is not None,
        front_diagnostics=start.front_request.diagnostics,
        prompt_mode="backend_template" if exact is None else "exact_tokens",
        vision=start.vision,
    )
    call = Call(
        start.front,
        start.front_request,
        ctx,
        prepared,
        resolution,
        start.retry_count,
        session=session,
    )
    if exact is None:
        return (yield from template_call(call, start.clock))
    return (yield from exact_call(call, exact, start.known, start.clock))
