"""Exact-token mode: the proxy renders and splices the prompt, the engine generates from ids.

Owns the adapter side of exact-token calls: build the prompt (the parent's own tokens + the
rendering of the new messages, see ``core.splice``; a call with no verified parent is rendered
from scratch), send it to the engine's tokens-in endpoint (``core.engine_formats``), parse the
generated text back into an assistant message (the family's parser, ``families``), and answer
the harness with a chat completion, streamed as chunk deltas when it asked for a stream. The
record is persisted before the response ends, exactly as in backend-template mode. It knows
no wire API: the call's front codec encodes the answer, whole or event by event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from capture_proxy.core.assembly import mark_incomplete, stream_end_reasons
from capture_proxy.core.engine_formats import Dialect, EngineFormatError, Reader
from capture_proxy.core.fronts.base import Answer, answer_as_deltas
from capture_proxy.core.fronts.chat import chat_usage
from capture_proxy.core.known_messages import MessageFacts, same_messages
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic
from capture_proxy.core.routed_experts import rows_end
from capture_proxy.core.sampling import (
    SamplingError,
    sampling_from_chat,
    sampling_record_tokens_in,
)
from capture_proxy.core.splice import (
    SpliceRefused,
    check_extension,
    check_prefix,
    extend_prompt,
    splice_prompt,
)
from capture_proxy.core.sse import SSEStreamDecoder, parse_json_event
from capture_proxy.core.tokens_in_assembly import TokensInAssembler, prompt_ids_json
from capture_proxy.families.base import (
    ChatRenderer,
    ContinuationRenderer,
    ModelFamily,
    RenderError,
    RendererUnavailable,
    TailRenderer,
    ends_in_open_block,
)
from capture_proxy.families.hf_template import find_tail_ids, tail_context, tail_renderable
from capture_proxy.families.parsing import MessageDelta, OutputParser, apply_deltas
from capture_proxy.proxy.calls import (
    CALL_ID_HEADER,
    CaptureDeps,
    ClientWriter,
    InFlightCall,
    dumps_text,
    elapsed_ms,
    encode_request,
    finish_call,
    record_abandoned,
    record_failed,
    relay_engine_error,
    sse_response,
)
from capture_proxy.proxy.errors import BadRequest, UpstreamTimeout, UpstreamUnavailable
from capture_proxy.proxy.upstream import CLIENT_ERRORS, send_upstream, translate_client_error

log = logging.getLogger("capture_proxy")

EXACT_PROMPT_REFUSED = "exact_prompt_refused"
#: a resolved call whose prompt was spliced from a full render, not extended (see build_prompt)
EXACT_PROMPT_FULL_RENDER = "exact_prompt_full_render"


class ExactTokens:
    """What exact-token mode needs: a renderer, an output parser, the engine's tokens-in
    dialect, the context length and the template's end-of-turn token ids.

    The last two may be left to the engine: ``max_model_len`` from its ``/v1/models`` (vLLM
    reports it per model) and the end-of-turn ids by tokenizing ``end_of_turn_token`` with its
    ``/tokenize``. They are fetched at the first exact-token call, not at start-up, so the proxy
    can start before the engine is ready (a sidecar usually does).
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        parser: OutputParser,
        dialect: Dialect,
        *,
        max_model_len: int | None = None,
        end_of_turn_ids: frozenset[int] | None = None,
        end_of_turn_token: str = "<|im_end|>",
        close_tokens: tuple[str, ...] = ("<|endoftext|>",),
        full_render: bool = False,
        by_model: Mapping[str, ExactTokens] | None = None,
        reasoning_tokens: tuple[str, str] | None = ("<think>", "</think>"),
    ) -> None:
        self.renderer = renderer
        self.parser = parser
        self.dialect = dialect
        self.max_model_len = max_model_len
        self.end_of_turn_ids = end_of_turn_ids
        #: the engine's first ``/v1/models`` id ("": it names none; None: not asked yet), for
        #: an answer to a request that names no model
        self.served_model: str | None = None
        self.end_of_turn_token = end_of_turn_token
        #: render every resolved call's whole conversation (the path before per-call
        #: extension; kept for comparison, e.g. ``benchmarks/long_session.py``)
        self.full_render = full_render
        #: the model family of each model named in ``model_families`` (this one: the rest)
        self.by_model: dict[str, ExactTokens] = dict(by_model or {})
        self._lock = asyncio.Lock()
        token_id = getattr(renderer, "token_id", None)
        #: decode without special tokens, when the renderer is local
        self.decode: Callable[[list[int]], str] | None = getattr(renderer, "decode_text", None)
        #: other stop tokens that close a model's turn when sampled (besides end of turn)
        self._close_extra: frozenset[int] = frozenset()
        if token_id is not None:
            ids = [token_id(t) for t in close_tokens]
            self._close_extra = frozenset(i for i in ids if isinstance(i, int))
        #: the (open, close) markers of the family's reasoning block, and their ids (None:
        #: not known yet; asked of the engine's /tokenize in ``ready`` without a local one)
        self.reasoning_tokens = reasoning_tokens
        self.reasoning_ids: tuple[int, int] | None = None
        if token_id is not None and reasoning_tokens is not None:
            pair = (token_id(reasoning_tokens[0]), token_id(reasoning_tokens[1]))
            if isinstance(pair[0], int) and isinstance(pair[1], int):
                self.reasoning_ids = (pair[0], pair[1])
        if dialect.needs_decode and self.decode is None:
            raise RenderError(
                f"tokens_in_dialect {dialect.name} needs a local tokenizer (tokenizer)"
            )

    @classmethod
    def of_family(
        cls,
        family: ModelFamily,
        dialect: Dialect,
        *,
        max_model_len: int | None = None,
        full_render: bool = False,
    ) -> ExactTokens:
        """Exact tokens with a model family's renderer, parser and turn closers."""
        return cls(
            family.renderer,
            family.parser,
            dialect,
            max_model_len=max_model_len,
            end_of_turn_ids=frozenset({family.end_of_turn_id}),
            end_of_turn_token=family.end_of_turn_token,
            close_tokens=family.close_tokens,
            full_render=full_render,
            reasoning_tokens=family.reasoning_tokens,
        )

    def for_model(self, model: str | None) -> ExactTokens:
        """The exact-token machinery of ``model``'s family (this one when it has none)."""
        return self.by_model.get(model or "", self)

    def opens_reasoning(self, prompt_token_ids: Any) -> bool:
        """Whether the prompt ends inside an open reasoning block (Qwen3-2507 Thinking's
        generation prompt ``<|im_start|>assistant\n<think>\n``): the generation then starts
        as reasoning (``families.base.ends_in_open_block``)."""
        if self.reasoning_ids is None:
            return False
        return ends_in_open_block(prompt_token_ids, *self.reasoning_ids)

    def close_ids(self, end_of_turn_ids: frozenset[int]) -> frozenset[int]:
        """Sampled stop tokens that close the model's turn: end of turn, and (with a local
        tokenizer) ``close_tokens``; after any other last token the turn gets the template's
        end-of-turn token appended."""
        return end_of_turn_ids | self._close_extra

    async def ready(
        self, session: aiohttp.ClientSession, backend: str
    ) -> tuple[int, frozenset[int]]:
        """(max_model_len, end_of_turn_ids), fetched from the engine once when not configured.
        Raises UpstreamUnavailable when the engine cannot tell."""
        async with self._lock:
            timeout = aiohttp.ClientTimeout(total=30)
            try:
                if self.max_model_len is None:
                    data = await _models(session, backend)
                    lengths = [m.get("max_model_len") for m in data.get("data", [])]
                    found = [n for n in lengths if isinstance(n, int)]
                    if not found:
                        raise UpstreamUnavailable(
                            "engine /v1/models reports no max_model_len; set max_model_len",
                            code="engine_bad_response",
                        )
                    self.max_model_len = min(found)
                    self.served_model = _first_model_id(data)
                if self.end_of_turn_ids is None:
                    body = {"prompt": self.end_of_turn_token, "add_special_tokens": False}
                    async with session.post(
                        backend + "/tokenize", json=body, timeout=timeout
                    ) as resp:
                        data = await resp.json(content_type=None)
                    tokens = data.get("tokens") if isinstance(data, dict) else None
                    if not isinstance(tokens, list) or len(tokens) != 1:
                        raise UpstreamUnavailable(
                            f"engine /tokenize does not map {self.end_of_turn_token!r} "
                            "to one token",
                            code="engine_bad_response",
                        )
                    self.end_of_turn_ids = frozenset(tokens)
                if self.reasoning_ids is None and self.reasoning_tokens is not None:
                    self.reasoning_ids = await _single_ids(
                        session, backend, self.reasoning_tokens, timeout
                    )
            except CLIENT_ERRORS as exc:
                raise translate_client_error(exc, backend) from exc
            except ValueError as exc:
                raise UpstreamUnavailable(f"engine metadata unusable: {exc}") from exc
        return self.max_model_len, self.end_of_turn_ids

    async def served_model_name(self, session: aiohttp.ClientSession, backend: str) -> str:
        """The engine's served model (its first ``/v1/models`` id): kept from ``ready``, else
        asked once; "" when the engine cannot tell (asked again at the next call)."""
        async with self._lock:
            if self.served_model is None:
                try:
                    self.served_model = _first_model_id(await _models(session, backend))
                except CLIENT_ERRORS + (ValueError,) as exc:
                    log.warning("engine /v1/models unusable for the model name: %s", exc)
                    return ""
            return self.served_model


async def _single_ids(
    session: aiohttp.ClientSession,
    backend: str,
    markers: tuple[str, str],
    timeout: aiohttp.ClientTimeout,
) -> tuple[int, int] | None:
    """The engine's ids of two markers that are one token each, else None (the vocabulary
    has no such tokens: the family's prompts never open a reasoning block)."""
    ids = []
    for marker in markers:
        body = {"prompt": marker, "add_special_tokens": False}
        async with session.post(backend + "/tokenize", json=body, timeout=timeout) as resp:
            data = await resp.json(content_type=None)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or len(tokens) != 1 or not isinstance(tokens[0], int):
            return None
        ids.append(tokens[0])
    return ids[0], ids[1]


async def _models(session: aiohttp.ClientSession, backend: str) -> Any:
    """The engine's ``GET /v1/models`` answer (JSON). Raises aiohttp's errors, ValueError."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with session.get(backend + "/v1/models", timeout=timeout) as resp:
        return await resp.json(content_type=None)


def _first_model_id(models: Any) -> str:
    """The first model id of a ``/v1/models`` answer, or ""."""
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    model_id = first.get("id") if isinstance(first, dict) else None
    return model_id if isinstance(model_id, str) else ""


@dataclass(frozen=True)
class _Prompt:
    """``experts_start``: the first token position to ask routed-expert rows for: where the
    parent's rows end when the prompt extends the parent, else 0."""

    token_ids: np.ndarray
    spliced_from: str | None
    diagnostics: list[Diagnostic]
    experts_start: int = 0


def _parent_request_messages(parent: Any) -> list[dict[str, Any]]:
    """The parent's request as the harness sent it, less a rewritten trailing note."""
    messages = list(parent.request_messages)
    if (parent.linking or {}).get("harness_note") and messages:
        messages = messages[:-1]
    return messages


def _parent_facts(
    deps: CaptureDeps, parent: Any, messages: list[dict[str, Any]]
) -> tuple[MessageFacts, ...]:
    """The facts of ``messages`` (``_parent_request_messages(parent)``): kept with the
    parent's record in memory, else derived."""
    kept = deps.linker.message_facts(parent.call_id)
    if kept is not None and len(kept) >= len(messages):
        return kept[: len(messages)]
    return deps.known_messages.facts(messages)


async def _full_render(
    exact: ExactTokens, messages: list[dict[str, Any]], tools: Any, kwargs: Any
) -> np.ndarray:
    ids = await exact.renderer.render(
        messages, tools, add_generation_prompt=True, chat_template_kwargs=kwargs
    )
    return np.asarray(ids, dtype=np.uint32)


async def _render_tail(
    exact: ExactTokens,
    messages: list[dict[str, Any]],
    j: int,
    tools: Any,
    kwargs: Any,
    end_of_turn_ids: frozenset[int],
) -> list[int] | None:
    """What follows the parent's end-of-turn token, rendered in a small context (see
    ``families.hf_template``); None when it cannot be found that way."""
    context, new = tail_context(messages, j), messages[j + 1 :]
    renderer = exact.renderer
    if isinstance(renderer, TailRenderer):
        # Small (the new messages and the system turn's text): cheaper on the loop than a
        # hop to a worker thread and back.
        return renderer.render_tail_sync(
            context,
            new,
            tools,
            end_of_turn_text=exact.end_of_turn_token,
            chat_template_kwargs=kwargs,
        )
    if not tail_renderable(context, new):
        return None
    head_ids = await renderer.render(
        context[:-1], tools, add_generation_prompt=False, chat_template_kwargs=kwargs
    )
    small = await renderer.render(
        [*context, *new], tools, add_generation_prompt=True, chat_template_kwargs=kwargs
    )
    return find_tail_ids(head_ids, small, end_of_turn_ids)


async def build_prompt(
    call: InFlightCall, deps: CaptureDeps, exact: ExactTokens, end_of_turn_ids: frozenset[int]
) -> _Prompt:
    """The exact-token prompt for ``call``. Raises RenderError (the request cannot render).

    A resolved call's prompt is the parent's prompt + generation ids extended by the rendering
    of the new messages only (work in proportion to the new tokens). The extended prompt must
    begin with parent prompt + generation, token for token, or the link is refused with its
    reason. Only where the extension cannot be had (the template renders the continued turn
    differently in a small context, or a full render is asked for) the whole conversation is
    rendered and spliced, and that is recorded (``exact_prompt_full_render``)."""
    body = call.prepared.body
    messages, tools = body["messages"], body.get("tools")
    kwargs = body.get("chat_template_kwargs")
    res = call.resolution
    if continues_final_message(body):
        # The last message is left open (a prefill): the whole conversation rendered so; the
        # link is taken at verification by tokens (the deepest token-exact ancestor).
        renderer = exact.renderer
        if not isinstance(renderer, ContinuationRenderer):
            raise refuse_continuation()
        ids = await renderer.render_continuation(messages, tools, chat_template_kwargs=kwargs)
        why = {"reason": "continue_final_message"}
        return _Prompt(
            np.asarray(ids, dtype=np.uint32), None, [Diagnostic(EXACT_PROMPT_FULL_RENDER, why)]
        )
    if res.verdict is not Verdict.RESOLVED or res.parent_call_id is None:
        return _Prompt(await _full_render(exact, messages, tools, kwargs), None, [])
    # Several candidates share the digest (parallel sub-agents that answered alike): the
    # first, in the resolution's preference, whose request this history extends.
    refusal: SpliceRefused | None = None
    refused_parent = res.parent_call_id
    parent = None
    for candidate in res.candidates or ():
        found = await deps.linker.get_call(candidate.call_id)
        if found is None or found.status is not CallStatus.COMPLETE:
            continue
        parent_messages = _parent_request_messages(found)
        child_facts = call.prepared.linking_facts
        same = None
        if child_facts is not None:
            same = same_messages(_parent_facts(deps, found, parent_messages), child_facts)
        try:
            j = check_extension(parent_messages, call.prepared.linking_messages, same)
        except SpliceRefused as exc:
            if refusal is None:
                refusal, refused_parent = exc, found.call_id
            continue
        parent = found
        break
    if parent is None:
        diagnostics = [] if refusal is None else [_refused(refused_parent, refusal)]
        return _Prompt(await _full_render(exact, messages, tools, kwargs), None, diagnostics)
    close_ids = exact.close_ids(end_of_turn_ids)
    diags: list[Diagnostic] = []
    try:
        tail = None
        if not exact.full_render:
            tail = await _render_tail(exact, messages, j, tools, kwargs, end_of_turn_ids)
        if tail is not None:
            spliced = extend_prompt(
                parent.prompt_token_ids,
                parent.generation_token_ids,
                tail,
                end_of_turn_id=min(end_of_turn_ids),
                close_ids=close_ids,
            )
        else:
            reason = "configured" if exact.full_render else "template_not_prefix_stable"
            diags.append(Diagnostic(EXACT_PROMPT_FULL_RENDER, {"reason": reason}))
            full = await exact.renderer.render(
                messages, tools, add_generation_prompt=True, chat_template_kwargs=kwargs
            )
            through = await exact.renderer.render(
                messages[: j + 1], tools, add_generation_prompt=False, chat_template_kwargs=kwargs
            )
            spliced = splice_prompt(
                parent.prompt_token_ids,
                parent.generation_token_ids,
                full,
                through,
                end_of_turn_ids=end_of_turn_ids,
                close_ids=close_ids,
            )
        bad = check_prefix(
            spliced.prompt_token_ids, parent.prompt_token_ids, parent.generation_token_ids
        )
        if bad is not None:
            raise SpliceRefused(f"the extended prompt differs from the parent's at token {bad}")
    except SpliceRefused as exc:
        return _Prompt(
            await _full_render(exact, messages, tools, kwargs),
            None,
            [*diags, _refused(parent.call_id, exc)],
        )
    return _Prompt(spliced.prompt_token_ids, parent.call_id, diags, rows_end(parent) or 0)


def continues_final_message(body: Mapping[str, Any]) -> bool:
    """The request asks to continue its last message rather than answer it (an Anthropic
    prefill, vLLM's ``continue_final_message`` / ``add_generation_prompt: false``)."""
    return bool(body.get("continue_final_message")) or body.get("add_generation_prompt") is False


def can_continue(exact: ExactTokens, model: str | None) -> bool:
    """Whether ``model``'s renderer builds a prompt that ends inside the last message (the
    HF-template families do; harmony does not)."""
    return isinstance(exact.for_model(model).renderer, ContinuationRenderer)


def refuse_continuation() -> BadRequest:
    """A renderer that cannot leave the last message open: the request is refused (nothing
    forwarded or stored) rather than answered as a new turn."""
    return BadRequest(
        "continuing a final assistant message (an Anthropic prefill, or "
        "continue_final_message / add_generation_prompt=false) is not supported by this "
        "model family's renderer in exact-token mode; end the conversation with a user or "
        "tool message, or use prompt_mode backend_template",
        param="messages",
        code="prefill_not_supported",
    )


def _refused(parent_call_id: str, exc: SpliceRefused) -> Diagnostic:
    details: dict[str, Any] = {"parent_call_id": parent_call_id, "reason": exc.reason}
    if exc.message_index is not None:
        details["message_index"] = exc.message_index
    return Diagnostic(EXACT_PROMPT_REFUSED, details)


def _finish_reason(engine_reason: str | None, has_tool_calls: bool) -> str:
    if engine_reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


def _answer(
    call: InFlightCall, asm: TokensInAssembler, message: dict[str, Any], finish_reason: str
) -> Answer:
    return Answer(
        call_id=call.ctx.call_id,
        created_at=call.ctx.created_at,
        model=call.answer_model,
        message=message,
        finish_reason=finish_reason,
        usage=chat_usage(int(asm.prompt_token_ids.shape[0]), len(asm.token_ids)),
        token_ids=asm.token_ids,
        log_probs=asm.log_probs,
        prompt_token_ids=asm.prompt_token_ids,
    )


async def handle_exact_tokens(
    request: web.Request, call: InFlightCall, deps: CaptureDeps, exact: ExactTokens
) -> web.StreamResponse:
    """Serve one captured call from exact tokens. Raises ProxyError."""
    body = call.prepared.body
    exact = exact.for_model(body.get("model"))
    ctx = call.ctx
    t_ready = time.perf_counter()
    try:
        max_model_len, end_of_turn_ids = await exact.ready(deps.session, deps.backend)
    except (UpstreamUnavailable, UpstreamTimeout) as exc:
        # The engine cannot be asked what the prompt needs: the call fails, and is recorded
        # as failed, as in backend-template mode.
        await record_failed(deps, call, t_ready, exc.message, None)
        exc.call_id = call.ctx.call_id
        raise
    if body.get("model") is None:
        served = await exact.served_model_name(deps.session, deps.backend)
        call = dataclasses.replace(call, served_model=served)
    try:
        prompt = await build_prompt(call, deps, exact, end_of_turn_ids)
        sampling = sampling_from_chat(
            body, num_prompt_tokens=int(prompt.token_ids.shape[0]), max_model_len=max_model_len
        )
    except RendererUnavailable as exc:
        raise UpstreamUnavailable(str(exc), code="engine_unreachable") from exc
    except RenderError as exc:
        raise BadRequest(str(exc), param="messages", code="render_failed") from exc
    except SamplingError as exc:
        raise BadRequest(str(exc), param=exc.param, code="invalid_request") from exc
    if prompt.spliced_from is not None:
        # Verification prefers the parent the prompt was spliced from.
        call = dataclasses.replace(call, resolution=call.resolution.preferring(prompt.spliced_from))
    call = dataclasses.replace(
        call, ctx=dataclasses.replace(call.ctx, sampling=sampling_record_tokens_in(sampling))
    )
    ctx = call.ctx
    extra_diags = list(prompt.diagnostics)
    if sampling.clamped_from is not None:
        extra_diags.append(
            Diagnostic(
                "max_tokens_clamped",
                {"requested": sampling.clamped_from, "max_tokens": sampling.max_tokens},
            )
        )
    # The prompt is the one part of the body that grows with the history: written once, by
    # orjson straight from the array, put in the body as it is and compared with the echo.
    prompt_json = prompt_ids_json(prompt.token_ids)
    engine_body = exact.dialect.request(
        orjson.Fragment(prompt_json),
        sampling,
        stream=ctx.stream,
        model=body.get("model"),
        experts_start=prompt.experts_start,
    )
    # Rows are asked for from where the parent's end (0 when the prompt is not the parent's).
    ctx = dataclasses.replace(ctx, routed_experts_start=prompt.experts_start)
    call = dataclasses.replace(call, ctx=ctx)
    headers = {
        "Content-Type": "application/json",
        "Accept-Encoding": "identity",
        "X-Request-Id": ctx.call_id,
        "X-NG-Rollout-Id": ctx.rollout_id,
    }
    if request.headers.get("Authorization"):
        headers["Authorization"] = request.headers["Authorization"]
    t0 = time.perf_counter()
    try:
        upstream = await send_upstream(
            deps.session,
            "POST",
            deps.backend + exact.dialect.path,
            first_byte_timeout_s=deps.first_byte_timeout_s,
            connect_retries=deps.connect_retries,
            data=orjson.dumps(engine_body),
            headers=headers,
            auto_decompress=True,
        )
    except CLIENT_ERRORS as exc:
        err = translate_client_error(exc, deps.backend)
        await record_failed(deps, call, t0, err.message, None, prompt.token_ids)
        err.call_id = call.ctx.call_id
        raise err from exc
    except asyncio.CancelledError:
        await record_abandoned(deps, call, t0, prompt.token_ids)
        raise
    assembler = TokensInAssembler(
        ctx, prompt.token_ids, exact.dialect.decode_routed_experts, prompt_json
    )
    reader = exact.dialect.reader(exact.decode)
    deps.recorder.metrics.observe_upstream(first_byte_s=time.perf_counter() - t0)
    async with upstream:
        if upstream.status >= 400:
            return await relay_engine_error(upstream, call, deps, t0, prompt.token_ids)
        run = _Generation(call, deps, exact, assembler, reader, extra_diags, t0)
        if ctx.stream and upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
            return await run.stream(request, upstream)
        return await run.whole(request, upstream)


@dataclass
class _Generation:
    """One tokens-in generation: engine pieces in, the record and the front's answer out."""

    call: InFlightCall
    deps: CaptureDeps
    exact: ExactTokens
    asm: TokensInAssembler
    reader: Reader
    extra_diags: list[Diagnostic]
    t0: float

    def record(self, message: dict[str, Any], finish_reason: str, status: int) -> CallRecord:
        return self.asm.finish(
            response_message=message,
            finish_reason=finish_reason,
            latency_ms=elapsed_ms(self.t0),
            http_status=status,
            extra_diagnostics=self.extra_diags,
        )

    async def whole(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        call, asm = self.call, self.asm
        try:
            # parse_json_event: engines write bare NaN / -Infinity log probs (orjson refuses)
            payload = parse_json_event(await upstream.read())
            if not isinstance(payload, dict):
                raise EngineFormatError("not a JSON object")
            asm.add(self.reader.whole(payload))
        except CLIENT_ERRORS + (ValueError,) as exc:
            reason = f"engine answer unusable: {type(exc).__name__}: {exc}"
            await record_failed(
                self.deps, call, self.t0, reason, upstream.status, asm.prompt_token_ids
            )
            err = UpstreamUnavailable(reason, code="engine_bad_response")
            err.call_id = call.ctx.call_id
            raise err from exc
        parsed = self.exact.parser.parse(
            asm.generated_text,
            call.ctx.call_id,
            token_ids=asm.token_ids,
            tools=call.prepared.body.get("tools"),
            in_reasoning=self.exact.opens_reasoning(asm.prompt_token_ids),
        )
        finish_reason = _finish_reason(asm.finish_reason, bool(parsed.tool_calls))
        message = parsed.to_openai()
        await finish_call(self.deps, call, self.record(message, finish_reason, upstream.status))
        answer = _answer(call, asm, message, finish_reason)
        if call.ctx.stream:
            # Asked for a stream; the engine answered whole: the whole answer as events.
            encoder = call.front.stream_encoder(
                call.front_request, call.answer_head(answer.prompt_token_ids)
            )
            events = encoder.start()
            for delta in answer_as_deltas(message):
                events += encoder.delta(delta)
            events += encoder.finish(answer)
            writer = ClientWriter(sse_response(200, call.ctx.call_id))
            await writer.prepare(request)
            await writer.end(b"".join(events))
            return writer.response
        return web.json_response(
            call.front.encode(call.front_request, answer),
            headers={CALL_ID_HEADER: call.ctx.call_id},
            dumps=dumps_text,
        )

    async def stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Engine token chunks in, the front's events out, as they can be decided."""
        call, asm = self.call, self.asm
        ctx = call.ctx
        encoder = call.front.stream_encoder(
            call.front_request, call.answer_head(asm.prompt_token_ids)
        )
        writer = ClientWriter(sse_response(200, ctx.call_id))
        await writer.prepare(request)
        await writer.write(b"".join(encoder.start()))
        # The first events are out: encode the request side of the record while the engine
        # generates.
        request_encoding = encode_request(call)
        cancelled = False
        problem: str | None = None
        done = False
        deltas: list[MessageDelta] = []
        parser_stream = self.exact.parser.stream(
            ctx.call_id,
            call.prepared.body.get("tools"),
            in_reasoning=self.exact.opens_reasoning(asm.prompt_token_ids),
        )
        decoder = SSEStreamDecoder()
        try:
            async for data in upstream.content.iter_any():
                out: list[bytes] = []
                for event in decoder.feed(data):
                    if event.data == "[DONE]":
                        done = True
                        continue
                    piece = self.reader.chunk(parse_json_event(event.data))
                    asm.add(piece)
                    new = parser_stream.feed(piece.text, piece.token_ids)
                    deltas += new
                    if new:
                        # token data goes with the first delta of its piece
                        out += encoder.delta(
                            new[0].to_openai(),
                            token_ids=piece.token_ids,
                            log_probs=piece.log_probs,
                        )
                        for d in new[1:]:
                            out += encoder.delta(d.to_openai())
                    elif piece.token_ids:
                        out += encoder.delta(
                            {}, token_ids=piece.token_ids, log_probs=piece.log_probs
                        )
                await writer.write(b"".join(out))
                if writer.gone:
                    break
        except CLIENT_ERRORS as exc:
            problem = f"engine stream broke: {type(exc).__name__}: {exc}"
        except (ValueError, EngineFormatError) as exc:
            problem = f"engine sent a malformed stream event: {exc}"
        except asyncio.CancelledError:
            writer.gone = cancelled = True  # keep what arrived; re-raised after persisting
        tail = parser_stream.finish()
        deltas += tail
        events: list[bytes] = []
        for d in tail:
            events += encoder.delta(d.to_openai())
        message = apply_deltas(deltas).to_openai()
        finish_reason = _finish_reason(asm.finish_reason, bool(message.get("tool_calls")))
        record = self.record(message, finish_reason, upstream.status)
        reasons = stream_end_reasons(client_gone=writer.gone, problem=problem, done_seen=done)
        if reasons:
            record = mark_incomplete(record, reasons)
        if cancelled:
            await asyncio.shield(finish_call(self.deps, call, record, request_encoding))
            raise asyncio.CancelledError
        await finish_call(self.deps, call, record, request_encoding)
        if problem:
            events.append(encoder.error(problem))
        else:
            events += encoder.finish(_answer(call, asm, message, finish_reason))
        await writer.end(b"".join(events))
        return writer.response
