"""A captured model call, from the front codec to the back end.

Owns the way of a call under a capture path (DESIGN.md, "The flow of one call"): front codec
(parse the wire API into the canonical conversation; Responses ``previous_response_id`` served
from the store), harness notes, parent resolution, then one back end: the engine renders the
template (``template``) or the proxy sends exact tokens (``exact``). Both relay, assemble,
verify and persist through ``calls`` and encode the answer with the call's front codec. Also
answers ``/v1/messages/count_tokens`` from the tokenizer and refuses generation endpoints it
cannot capture. Everything pure lives in ``capture_proxy.core``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from capture_proxy.core.assembly import CallContext
from capture_proxy.core.capture import augment_chat_request, prepare_request
from capture_proxy.core.fronts import Api, FrontCodec, FrontRequest, InvalidFrontRequest
from capture_proxy.core.fronts.responses.parse import referenced_response_id
from capture_proxy.core.json_bodies import InvalidRequest, parse_json_object
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.linking.digests import request_digest
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.routing import Route
from capture_proxy.core.sampling import sampling_record
from capture_proxy.families.base import ChatRenderer, RenderError, RendererUnavailable
from capture_proxy.proxy.calls import (
    CHAT_COMPLETIONS_PATH,
    CaptureDeps,
    InFlightCall,
    new_call_id,
)
from capture_proxy.proxy.errors import BadRequest, UpstreamUnavailable
from capture_proxy.proxy.exact import (
    ExactTokens,
    can_continue,
    continues_final_message,
    handle_exact_tokens,
    refuse_continuation,
)
from capture_proxy.proxy.template import handle_template

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


def _bad_request(exc: InvalidRequest | InvalidFrontRequest) -> BadRequest:
    return BadRequest(str(exc), param=exc.param, code="invalid_request")


async def _previous_messages(
    deps: CaptureDeps, front: FrontCodec, body: dict[str, Any], rollout_id: str
) -> list[dict[str, Any]] | None:
    """The canonical messages a Responses ``previous_response_id`` stands for: that call's
    messages and its answer (the proxy stored it). Raises BadRequest naming the field when
    the id is unknown to this rollout or its call has no answer."""
    if front.api is not Api.RESPONSES:
        return None
    try:
        response_id = referenced_response_id(body)
    except InvalidFrontRequest as exc:
        raise _bad_request(exc) from exc
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
        raise BadRequest(
            f"previous_response_id {response_id!r} names no answered response of this rollout",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return [*record.request_messages, record.response_message]


def retry_requested(retry_count: str | None) -> bool:
    """The harness says this request is a retry: an OpenAI or Anthropic SDK (Stainless
    clients: OpenCode's, Claude Code's) sends ``x-stainless-retry-count`` = 0 on the first
    attempt and the attempt number on retries."""
    return retry_count is not None and retry_count.strip().isdigit() and int(retry_count) > 0


async def _resolve(
    deps: CaptureDeps,
    rollout_id: str,
    prepared: Any,
    call_id: str,
    created_at: float,
    retry_count: str | None,
) -> Resolution:
    """Request-time resolution; a failure here never fails the model call."""
    try:
        return await deps.linker.resolve(
            rollout_id,
            prepared.linking_messages,
            prepared.body,
            call_id=call_id,
            created_at=created_at,
            retry_requested=retry_requested(retry_count),
            linking_facts=prepared.linking_facts,
        )
    except Exception as exc:
        log.error("rollout %s: parent resolution failed: %s", rollout_id, exc)
        return Resolution(
            Verdict.UNRESOLVED,
            None,
            request_digest(prepared.body),
            reason=f"parent resolution failed: {type(exc).__name__}: {exc}",
        )


def _message_facts(known: KnownMessages, parsed: FrontRequest) -> Any:
    """The facts of the canonical messages: the front's, else derived here (a failure leaves
    the call to derive what it needs from the messages)."""
    if parsed.message_facts is not None:
        return parsed.message_facts
    try:
        return known.facts(parsed.chat.get("messages") or [])
    except Exception as exc:
        log.warning("message facts not derived: %s: %s", type(exc).__name__, exc)
        return None


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
    assert route.rollout_id is not None
    try:
        body = parse_json_object(raw_body)
    except InvalidRequest as exc:
        raise _bad_request(exc) from exc
    previous = await _previous_messages(deps, front, body, route.rollout_id)
    known = deps.known_messages
    try:
        parsed: FrontRequest = front.parse(body, previous=previous, known=known)
    except InvalidFrontRequest as exc:
        raise _bad_request(exc) from exc

    model = parsed.chat.get("model")
    if (
        back_ends.exact is not None
        and back_ends.exact_for_model(model)
        and continues_final_message(parsed.chat)
        and not can_continue(back_ends.exact, model)
    ):
        raise refuse_continuation()
    created_at = time.time()
    prepared = prepare_request(parsed.chat, deps.notes, _message_facts(known, parsed))
    call_id = new_call_id()
    retry_count = request.headers.get(RETRY_COUNT_HEADER)
    resolution = await _resolve(deps, route.rollout_id, prepared, call_id, created_at, retry_count)
    ctx = CallContext(
        call_id=call_id,
        rollout_id=route.rollout_id,
        created_at=created_at,
        stream=parsed.stream,
        upstream_path=CHAT_COMPLETIONS_PATH,
        request_body=prepared.body,
        routed_experts_start=resolution.parent_rows_end or 0,
        api=front.api.value,
        request_received=parsed.received,
        routed_experts_expectation=back_ends.routed_experts_for(prepared.body.get("model")),
        parent_had_rows=resolution.parent_rows_end is not None,
        front_diagnostics=parsed.diagnostics,
    )
    call = InFlightCall(front, parsed, ctx, prepared, resolution, retry_count)
    metrics = deps.recorder.metrics
    metrics.inc_in_flight()
    try:
        return await _to_back_end(request, call, deps, back_ends)
    finally:
        metrics.dec_in_flight()


async def _to_back_end(
    request: web.Request, call: InFlightCall, deps: CaptureDeps, back_ends: BackEnds
) -> web.StreamResponse:
    """Exact tokens for a model configured so, else the engine's template."""
    ctx, prepared, resolution = call.ctx, call.prepared, call.resolution
    exact = back_ends.exact
    if exact is not None and back_ends.exact_for_model(prepared.body.get("model")):
        call = dataclasses.replace(
            call, ctx=dataclasses.replace(ctx, upstream_path=exact.dialect.path)
        )
        return await handle_exact_tokens(request, call, deps, exact)
    upstream_body, asked = augment_chat_request(
        prepared.body,
        parent_rows_end=resolution.parent_rows_end,
        routed_experts=ctx.routed_experts_expectation != "off",
    )
    call = dataclasses.replace(
        call, ctx=dataclasses.replace(ctx, sampling=sampling_record(upstream_body))
    )
    return await handle_template(request, call, deps, upstream_body, asked)


async def handle_count_tokens(
    raw_body: bytes, parse: Callable[[dict[str, Any]], FrontRequest], back_ends: BackEnds
) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt's length as the chat template renders
    it (with the generation prompt), from the exact-token renderer or the engine's
    ``/tokenize``. Not captured."""
    try:
        parsed = parse(parse_json_object(raw_body))
    except (InvalidRequest, InvalidFrontRequest) as exc:
        raise _bad_request(exc) from exc
    chat = parsed.chat
    renderer = back_ends.token_counter
    if back_ends.exact is not None and back_ends.exact_for_model(chat.get("model")):
        renderer = back_ends.exact.renderer
    try:
        ids = await renderer.render(
            chat["messages"],
            chat.get("tools"),
            add_generation_prompt=True,
            chat_template_kwargs=chat.get("chat_template_kwargs"),
        )
    except RendererUnavailable as exc:
        raise UpstreamUnavailable(str(exc), code="engine_unreachable") from exc
    except RenderError as exc:
        raise BadRequest(str(exc), param="messages", code="render_failed") from exc
    return web.json_response({"input_tokens": len(ids)})
