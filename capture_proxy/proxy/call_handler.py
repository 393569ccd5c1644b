"""A captured model call: from the request's bytes to the flow, run on its back end's executor.

Owns the adapter side of a call under a capture path (DESIGN.md, "The flow of one call"): the
front codec's parse (a Responses ``previous_response_id`` served from the store), the choice of
the back end (exact tokens for a model configured so, else the engine's template), then the
call's flow (``core.flow.captured``) driven on that back end's executor (``proxy.executor``,
``proxy.exact``). Core errors become client errors through ``proxy.errors.CORE_ERRORS``. Also
answers ``/v1/messages/count_tokens`` from the tokenizer. Every decision about the call lives
in ``capture_proxy.core.flow``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from capture_proxy.core.flow.captured import CallStart, captured_call
from capture_proxy.core.flow.errors import UnknownPreviousResponse
from capture_proxy.core.fronts import Api, FrontCodec, FrontRequest
from capture_proxy.core.fronts.responses.parse import referenced_history, referenced_response_id
from capture_proxy.core.images import ImageRefused, engine_messages
from capture_proxy.core.json_bodies import parse_json_object
from capture_proxy.core.known_bodies import ParsedBody
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.routing import Route
from capture_proxy.core.sessions import session_headers
from capture_proxy.families.base import ChatRenderer
from capture_proxy.proxy.calls import CaptureDeps, left_response, new_call_id
from capture_proxy.proxy.drive import drive
from capture_proxy.proxy.errors import map_core_errors
from capture_proxy.proxy.exact import ExactExecutor, ExactTokens
from capture_proxy.proxy.executor import CallExecutor
from capture_proxy.proxy.images import complete_images, refuse_images_without_dialect
from capture_proxy.proxy.stopping import CALLS_IN_FLIGHT_KEY

log = logging.getLogger("capture_proxy")

#: Retry headers sent by the OpenAI SDKs (Stainless-generated clients).
RETRY_COUNT_HEADER = "x-stainless-retry-count"


@dataclass(frozen=True)
class BackEnds:
    """The back ends a call may take: exact tokens (and which models use it), else the
    engine's template; ``token_counter`` renders for count-tokens requests."""

    exact: ExactTokens | None
    exact_for_model: Callable[[str | None], bool]
    token_counter: ChatRenderer
    #: the ``routed_experts`` expectation of a model (``required`` | ``optional`` | ``off``)
    routed_experts_for: Callable[[str | None], str] = lambda model: "optional"


async def _previous_messages(
    deps: CaptureDeps, front: FrontCodec, body: dict[str, Any], rollout_id: str
) -> list[dict[str, Any]] | None:
    """The canonical messages a Responses ``previous_response_id`` stands for: that call's
    messages (less its ``instructions``, which the API does not carry over) and its answer
    (the proxy stored it, ``referenced_history``). Raises UnknownPreviousResponse when the
    id is unknown to this rollout or its call has no answer; InvalidFrontRequest. A response
    made with ``store: false`` is served too (the API would not find it): the proxy keeps
    every call, and a harness that sends both gets the history it names."""
    if front.api is not Api.RESPONSES:
        return None
    response_id = referenced_response_id(body)
    if response_id is None:
        return None
    call_id = "call-" + response_id.removeprefix("resp_")
    record = await deps.linker.get_call(call_id)
    if (
        record is None
        or record.rollout_id != rollout_id
        or record.response_message is None
        or not response_id.startswith("resp_")
    ):
        raise UnknownPreviousResponse(response_id)
    return referenced_history(
        record.request_messages, record.response_message, record.request_received
    )


def _message_facts(known: KnownMessages, parsed: FrontRequest, read: ParsedBody) -> Any:
    """The facts of the canonical messages: the front's, else derived here (those of the
    messages the earlier request of the session had as the same objects taken from it; a
    failure leaves the call to derive what it needs from the messages). Kept with the body
    for the session's next request."""
    messages = parsed.chat.get("messages")
    facts = parsed.message_facts
    if facts is None:
        try:
            facts = known.facts(messages or [], read.head_facts_for(messages or []))
        except Exception as exc:
            log.warning("message facts not derived: %s: %s", type(exc).__name__, exc)
            return None
    read.keep_facts(messages, facts)
    return facts


async def handle_captured_call(
    request: web.Request,
    route: Route,
    raw_body: bytes,
    front: FrontCodec,
    deps: CaptureDeps,
    back_ends: BackEnds,
) -> web.StreamResponse:
    """Serve one captured model call of ``front``'s API. Raises ProxyError for the
    middleware (which shapes it for the front)."""
    rollout_id = route.rollout_id
    assert rollout_id is not None
    known = deps.known_messages
    with map_core_errors():
        read = deps.known_bodies.parse(raw_body, rollout_id, front.history_member)
        body = read.body
        previous = await _previous_messages(deps, front, body, rollout_id)
        parsed = front.parse(
            body,
            previous=previous,
            known=known,
            images=deps.images.limits,
            known_tools=deps.known_tools,
            history=read,
        )
        if parsed.images is not None or previous is not None:
            store = deps.recorder.store
            parsed = await complete_images(parsed, deps.images, deps.image_session, store)
    model = parsed.chat.get("model")
    exact = None
    if back_ends.exact is not None and back_ends.exact_for_model(model):
        exact = back_ends.exact.for_model(model)
        with map_core_errors():
            refuse_images_without_dialect(parsed, exact.dialect.name)
    start = CallStart(
        front=front,
        front_request=parsed,
        rollout_id=rollout_id,
        call_id=new_call_id(),
        created_at=time.time(),
        retry_count=request.headers.get(RETRY_COUNT_HEADER),
        notes=deps.notes,
        known=known,
        message_facts=_message_facts(known, parsed, read),
        exact=exact,
        routed_experts_expectation=back_ends.routed_experts_for(model),
        clock=time.perf_counter,
        vision=deps.images.processor_for(model) if parsed.images is not None else None,
        session_headers=session_headers(request.headers.items()),
        history=read,
    )
    executor = (
        CallExecutor(request, deps, start.call_id, rollout_id)
        if exact is None
        else ExactExecutor(request, deps, start.call_id, rollout_id, exact)
    )
    metrics = deps.recorder.metrics
    metrics.inc_in_flight()
    try:
        with map_core_errors(), request.app[CALLS_IN_FLIGHT_KEY].track(start.call_id, rollout_id):
            await drive(captured_call(start), executor)
    finally:
        metrics.dec_in_flight()
        deps.linker.release(rollout_id, start.call_id, unstored=executor.unanswered_unstored)
    if executor.response is None:
        # The harness left before the answer began (the executor found its connection gone
        # while the engine generated): the call is recorded, the answer has no one to go to.
        return left_response(start.call_id)
    return executor.response


async def handle_count_tokens(
    raw_body: bytes, parse: Callable[[dict[str, Any]], FrontRequest], back_ends: BackEnds
) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt's length as the chat template renders
    it (with the generation prompt), from the exact-token renderer or the engine's
    ``/tokenize`` (which gets images as ``data:`` URLs; a remote image is not fetched to be
    counted: refused). Not captured."""
    with map_core_errors():
        parsed = parse(parse_json_object(raw_body))
        chat = parsed.chat
        messages: list[Any] = list(chat["messages"])
        renderer = back_ends.token_counter
        if back_ends.exact is not None and back_ends.exact_for_model(chat.get("model")):
            renderer = back_ends.exact.renderer
        elif parsed.images is not None:
            if parsed.images.pending:
                where = parsed.images.pending[0].path
                raise ImageRefused(f"'{where}': a remote image is not fetched to be counted", where)
            messages = engine_messages(messages, parsed.images.images)
        ids = await renderer.render(
            messages,
            chat.get("tools"),
            add_generation_prompt=True,
            chat_template_kwargs=chat.get("chat_template_kwargs"),
        )
    return web.json_response({"input_tokens": len(ids)})
