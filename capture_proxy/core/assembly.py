"""Assembling a call record from what the engine sent, streamed or not.

Owns reading vLLM's chat-completions token data (vLLM 0.32 dialect, see notes/engines.md):
top-level ``prompt_token_ids``; per choice ``token_ids``, ``logprobs.content[].logprob``,
``routed_experts``; for streams the same fields spread over chunks (``prompt_token_ids`` on the
first chunk, ``choices[0].token_ids`` per chunk). It also assembles the assistant message
(content, reasoning, tool calls) from stream deltas, and verifies what it got: generation ids
and log probs of equal length (``generation_checks``), prompt ids present. Anything missing or
inconsistent makes the record ``incomplete`` with a ``capture_incomplete`` diagnostic naming the
reason; it never raises on engine data, because a capture failure must never fail the model
call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from capture_proxy.core.engine_formats import choice_stop
from capture_proxy.core.generation_checks import check_generation, check_usage
from capture_proxy.core.records import (
    CallRecord,
    CallStatus,
    Diagnostic,
    DiagnosticKind,
    as_token_array,
)
from capture_proxy.core.routed_experts import (
    check_row_count,
    decode_vllm_routed_experts,
    expectation_check,
)
from capture_proxy.families.vision import VisionProcessorConfig

__all__ = ["CallContext", "ChatCaptureAssembler", "decode_vllm_routed_experts", "failed_record"]


@dataclass(frozen=True)
class CallContext:
    """What is known about a call before the engine answers."""

    call_id: str
    rollout_id: str
    created_at: float
    stream: bool
    upstream_path: str
    request_body: dict[str, Any]
    #: the first token position the engine was asked routed-expert rows for (vLLM
    #: ``routed_experts_prompt_start``); 0 asks for all rows.
    routed_experts_start: int = 0
    #: the wire API of the call and its body as received, less the history field
    api: str = "chat_completions"
    request_received: dict[str, Any] | None = None
    #: the request headers naming the harness's session (``CallRecord.session_headers``)
    session_headers: dict[str, str] | None = None
    #: the sampling settings sent to the engine (``sampling.sampling_record``)
    sampling: dict[str, Any] | None = None
    #: ``routed_experts`` setting for the call's model; whether its digest parent held rows
    routed_experts_expectation: str = "optional"
    parent_had_rows: bool = False
    #: diagnostics the front found in the request (``FrontRequest.diagnostics``), on every
    #: record of the call
    front_diagnostics: tuple[Diagnostic, ...] = ()
    #: how the prompt's tokens were made: ``backend_template`` (the engine rendered the chat
    #: template) | ``exact_tokens`` (the proxy sent token ids); ``CallRecord.prompt_mode``
    prompt_mode: str = "backend_template"
    #: the image processor settings of the call's model (``image_processors``), for its
    #: images' spans and processor params (None: the call has no image)
    vision: VisionProcessorConfig | None = None

    def replace(self, **changes: Any) -> CallContext:
        """A copy with ``changes`` (as ``dataclasses.replace``, without its walk over the
        fields: a flow sets the call's sampling on every call). Raises TypeError naming an
        unknown field."""
        unknown = changes.keys() - _CONTEXT_FIELDS
        if unknown:
            raise TypeError(f"CallContext has no field {sorted(unknown)[0]!r}")
        copy = object.__new__(CallContext)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy


_CONTEXT_FIELDS = frozenset(f.name for f in dataclasses.fields(CallContext))


def call_fields(ctx: CallContext) -> dict[str, Any]:
    """The fields of a record that come from the call's context and request (for
    ``CallRecord(**call_fields(ctx), ...)``)."""
    body = ctx.request_body
    return {
        "call_id": ctx.call_id,
        "rollout_id": ctx.rollout_id,
        "created_at": ctx.created_at,
        "stream": ctx.stream,
        "upstream_path": ctx.upstream_path,
        "api": ctx.api,
        "request_received": ctx.request_received,
        "session_headers": ctx.session_headers,
        "sampling": ctx.sampling,
        "model": body.get("model"),
        "request_messages": list(body.get("messages") or []),
        "request_tools": body.get("tools"),
        "prompt_mode": ctx.prompt_mode,
    }


@dataclass
class _ToolCallParts:
    id: str | None = None
    type: str = "function"
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class ChatCaptureAssembler:
    """Collects the token data and the assistant message of one chat call.

    Feed it the non-streaming body with ``add_response`` or each parsed stream chunk with
    ``add_chunk``, then call ``finish`` for the record. Only choice index 0 is captured
    (the proxy refuses ``n > 1`` under capture).
    """

    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx
        #: the engine's prompt ids as it sent them (None: not yet); [] once ``settle_prompt``
        #: holds them as an array
        self.prompt_token_ids: list[int] | None = None
        self.generation_token_ids: list[int] = []
        self.generation_log_probs: list[float | None] = []
        self.saw_token_ids = False
        self.saw_log_probs = False
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, _ToolCallParts] = {}
        self.finish_reason: str | None = None
        #: vLLM's ``stop_reason`` of choice 0 (the matched stop string or stop token id), for
        #: the fronts' answers; not stored
        self.stop_reason: str | int | None = None
        self.usage: dict[str, Any] | None = None
        self.routed_experts_raw: Any = None
        self.response_message: dict[str, Any] | None = None
        self.problems: list[str] = []
        #: the prompt ids as their array, or why they are not ids (see ``settle_prompt``)
        self._prompt: np.ndarray | None = None
        self._prompt_problem: str | None = None

    # -- streaming ---------------------------------------------------------------------------

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        """One parsed ``chat.completion.chunk`` (runs per streamed token: lean on purpose)."""
        if self.prompt_token_ids is None:
            prompt = chunk.get("prompt_token_ids")
            if prompt is not None:
                self.prompt_token_ids = prompt
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        choices = chunk.get("choices")
        if not choices:
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            self._add_choice_tokens(choice)
            delta = choice.get("delta")
            if delta:
                self.add_delta(delta)
            finish_reason = choice.get("finish_reason")
            if finish_reason is not None:
                self.finish_reason = finish_reason
                self.stop_reason = choice_stop(choice)

    def add_delta(self, delta: dict[str, Any]) -> None:
        """One chunk's ``choices[0].delta``: its content, reasoning and tool-call pieces."""
        content = delta.get("content")
        if isinstance(content, str):
            self.content.append(content)
        reasoning = delta.get("reasoning_content")
        if reasoning is None:
            reasoning = delta.get("reasoning")
        if isinstance(reasoning, str):
            self.reasoning.append(reasoning)
        tool_calls = delta.get("tool_calls")
        if tool_calls:
            for tc in tool_calls:
                self._add_tool_call_delta(tc)

    def add_scanned(
        self, token_ids: list[int] | None, log_probs: list[float | int | None] | None
    ) -> None:
        """A chunk's token data as ``chunk_scan.scan_chat_chunk`` read it (what ``add_chunk``
        takes from ``choices[0].token_ids`` and ``logprobs.content[].logprob``); its delta goes
        to ``add_delta``."""
        if token_ids is not None:
            self.saw_token_ids = True
            self.generation_token_ids += token_ids
        if log_probs is not None:
            self.saw_log_probs = True
            self.generation_log_probs += log_probs

    def _add_tool_call_delta(self, tc: Any) -> None:
        """One piece of a streamed tool call. A piece not of OpenAI's shape (an object with an
        integer ``index``, string ``id``/``type``/``function.name``/``function.arguments``)
        is left out of the message and named in ``problems``: never an error."""
        fn: Any = (tc.get("function") or {}) if isinstance(tc, dict) else None
        try:
            index = int(tc.get("index", 0)) if isinstance(fn, dict) else None
        except (TypeError, ValueError):
            index = None
        if index is None or not all(
            v is None or isinstance(v, str)
            for v in (tc.get("id"), tc.get("type"), fn.get("name"), fn.get("arguments"))
        ):
            self.problems.append(f"engine sent a tool-call delta not of OpenAI's shape: {tc!r:.80}")
            return
        parts = self.tool_calls.setdefault(index, _ToolCallParts())
        if tc.get("id"):
            parts.id = tc["id"]
        if tc.get("type"):
            parts.type = tc["type"]
        if fn.get("name"):
            parts.name += fn["name"]
        if isinstance(fn.get("arguments"), str):
            parts.arguments.append(fn["arguments"])

    def _add_choice_tokens(self, choice: dict[str, Any]) -> None:
        token_ids = choice.get("token_ids")
        if token_ids is not None:
            self.saw_token_ids = True
            if isinstance(token_ids, list):
                self.generation_token_ids.extend(token_ids)
            else:
                self.problems.append("token_ids is not a list")
        logprobs = choice.get("logprobs")
        if logprobs and isinstance(logprobs, dict):
            content = logprobs.get("content")
            if content is not None:
                self.saw_log_probs = True
                out = self.generation_log_probs
                for entry in content:
                    out.append(entry.get("logprob") if isinstance(entry, dict) else None)
        experts = choice.get("routed_experts")
        if experts is not None:
            self.routed_experts_raw = experts

    def settle_prompt(self) -> None:
        """Check and convert the prompt ids now (a long prompt takes a while), rather than in
        ``finish``: the proxy calls this once a stream's first events are forwarded, so the
        work is done while the engine generates, not on the answer's last step."""
        if self._prompt is not None or self._prompt_problem is not None:
            return
        if self.prompt_token_ids is not None:
            try:
                self._prompt = as_token_array(self.prompt_token_ids, field_name="prompt_token_ids")
            except ValueError as exc:
                self._prompt_problem = str(exc)
            else:
                # The list (a Python int per id: ~36 bytes each, and a container the cyclic
                # collector walks) is not needed past here: a stream in flight keeps the array.
                self.prompt_token_ids = []

    def take_prompt(self, prompt: np.ndarray) -> None:
        """The prompt ids as their array already (``chunk_scan.take_prompt``: the body's
        ``prompt_token_ids`` read into it), after the body or chunk that held them was added
        (with that member null). Ignored once the ids are known (the first chunk's count)."""
        if self.prompt_token_ids is None:
            self.prompt_token_ids = []  # (held as the array, as after ``settle_prompt``)
            self._prompt = prompt

    # -- non-streaming -----------------------------------------------------------------------

    def add_response(self, body: dict[str, Any]) -> None:
        """A whole ``chat.completion`` body."""
        self.prompt_token_ids = body.get("prompt_token_ids")
        self.usage = body.get("usage")
        choices = body.get("choices") or []
        first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
        if first is None:
            self.problems.append("response has no choice 0")
            return
        self._add_choice_tokens(first)
        self.finish_reason = first.get("finish_reason")
        self.stop_reason = choice_stop(first)
        message = first.get("message")
        if isinstance(message, dict):
            self.response_message = dict(message)
        else:
            # the tokens are the engine's, but no harness saw them as an answer: not trainable
            # as a complete call
            self.problems.append("engine sent no message in choice 0")

    # -- result ------------------------------------------------------------------------------

    def assembled_message(self) -> dict[str, Any]:
        """The assistant message as the harness will send it back (OpenAI shape)."""
        if self.response_message is not None:
            return self.response_message
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": p.id,
                    "type": p.type,
                    "function": {"name": p.name, "arguments": "".join(p.arguments)},
                }
                for _, p in sorted(self.tool_calls.items())
            ]
        return message

    def finish(self, *, latency_ms: float, http_status: int) -> CallRecord:
        """Build the record and verify it. Never raises on engine data."""
        ctx = self.ctx
        diagnostics = list(ctx.front_diagnostics)
        problems = list(self.problems)
        self.settle_prompt()
        prompt = self._prompt
        if self.prompt_token_ids is None:
            problems.append("engine sent no prompt_token_ids")
        elif self._prompt_problem is not None:
            problems.append(self._prompt_problem)
        checked = check_generation(
            self.generation_token_ids if self.saw_token_ids else None,
            self.generation_log_probs if self.saw_log_probs else None,
        )
        gen, log_probs = checked.token_ids, checked.log_probs
        problems += checked.problems
        diagnostics += checked.diagnostics
        experts = None
        if self.routed_experts_raw is not None:
            try:
                experts = decode_vllm_routed_experts(self.routed_experts_raw)
            except (ValueError, TypeError) as exc:
                diagnostics.append(
                    Diagnostic(DiagnosticKind.ROUTED_EXPERTS_MISMATCH, {"reason": str(exc)})
                )
        usage_problems, usage_diagnostics = check_usage(
            self.usage,
            int(prompt.shape[0]) if prompt is not None else None,
            int(gen.shape[0]) if gen is not None else None,
        )
        problems += usage_problems
        diagnostics += usage_diagnostics
        expert_problems, expert_diagnostics = expectation_check(
            ctx.routed_experts_expectation,
            experts,
            stream=ctx.stream,
            parent_had_rows=ctx.parent_had_rows,
        )
        problems += expert_problems
        diagnostics += expert_diagnostics
        if experts is not None and prompt is not None and gen is not None:
            # Kept as received either way; a wrong row count is named, never "fixed".
            mismatch = check_row_count(
                experts,
                start=ctx.routed_experts_start,
                num_prompt_tokens=prompt.shape[0],
                num_generation_tokens=gen.shape[0],
            )
            if mismatch is not None:
                diagnostics.append(mismatch)
        if self.finish_reason is None and not problems:
            diagnostics.append(Diagnostic(DiagnosticKind.FINISH_REASON_MISSING))
        status = CallStatus.COMPLETE
        if problems:
            status = CallStatus.INCOMPLETE
            diagnostics.append(Diagnostic(DiagnosticKind.CAPTURE_INCOMPLETE, {"reasons": problems}))
        # Keep whatever arrived intact, even on an incomplete record: nothing received is lost
        # (an array not received is the field's empty default, made only then).
        arrays: dict[str, Any] = {}
        if prompt is not None:
            arrays["prompt_token_ids"] = prompt
        if gen is not None:
            arrays["generation_token_ids"] = gen
        if log_probs is not None:
            arrays["generation_log_probs"] = log_probs
        return CallRecord(
            **call_fields(ctx),
            status=status,
            latency_ms=latency_ms,
            response_message=self.assembled_message(),
            finish_reason=self.finish_reason,
            usage=self.usage,
            http_status=http_status,
            diagnostics=diagnostics,
            routed_experts=experts,
            routed_experts_start=ctx.routed_experts_start,
            **arrays,
        )


def failed_record(
    ctx: CallContext, *, reason: str, latency_ms: float, http_status: int | None
) -> CallRecord:
    """A record for a call the engine did not answer (unreachable, error status, cut stream)."""
    return CallRecord(
        **call_fields(ctx),
        status=CallStatus.FAILED,
        latency_ms=latency_ms,
        http_status=http_status,
        diagnostics=[
            *ctx.front_diagnostics,
            Diagnostic(DiagnosticKind.UPSTREAM_FAILED, {"reason": reason}),
        ],
    )


def abandoned_record(ctx: CallContext, *, reason: str, latency_ms: float) -> CallRecord:
    """A record for a call the harness left before the engine answered: ``incomplete``, no
    token data, ``capture_incomplete`` naming ``reason``."""
    return CallRecord(
        **call_fields(ctx),
        status=CallStatus.INCOMPLETE,
        latency_ms=latency_ms,
        diagnostics=[
            *ctx.front_diagnostics,
            Diagnostic(DiagnosticKind.CAPTURE_INCOMPLETE, {"reasons": [reason]}),
        ],
    )


def stream_end_reasons(*, client_gone: bool, problem: str | None, done_seen: bool) -> list[str]:
    """Why a relayed stream did not end cleanly (empty when it did)."""
    reasons = []
    if client_gone:
        reasons.append("client disconnected before the stream ended")
    if problem:
        reasons.append(problem)
    elif not done_seen and not client_gone:
        reasons.append("engine stream ended without [DONE]")
    return reasons


def mark_incomplete(record: CallRecord, reasons: list[str]) -> CallRecord:
    """The record as ``incomplete``, its ``capture_incomplete`` reasons extended by ``reasons``
    (one diagnostic of that kind per call)."""
    diagnostics = list(record.diagnostics)
    existing = next((d for d in diagnostics if d.kind == DiagnosticKind.CAPTURE_INCOMPLETE), None)
    if existing is not None:
        diagnostics.remove(existing)
        reasons = [*existing.details.get("reasons", []), *reasons]
    diagnostics.append(Diagnostic(DiagnosticKind.CAPTURE_INCOMPLETE, {"reasons": reasons}))
    return record.replace(status=CallStatus.INCOMPLETE, diagnostics=diagnostics)
