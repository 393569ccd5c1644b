"""Assembling the record of an exact-token call from tokens-in engine pieces. Pure.

Owns the checks specific to exact-token mode: the engine must have generated from exactly the
prompt ids the proxy sent (its echo, when it sends one, must be equal), and generation ids and
log probs must have equal length. Like ``assembly``, it never raises on engine data: problems
make the record ``incomplete`` with a ``capture_incomplete`` diagnostic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from capture_proxy.core.assembly import CallContext, call_fields, check_generation, check_usage
from capture_proxy.core.engine_formats import Piece
from capture_proxy.core.records import (
    CallRecord,
    CallStatus,
    Diagnostic,
    DiagnosticKind,
)
from capture_proxy.core.routed_experts import check_row_count, expectation_check


def prompt_ids_json(prompt_token_ids: np.ndarray) -> bytes:
    """The prompt ids as a JSON array (orjson, straight from the array)."""
    return orjson.dumps(prompt_token_ids, option=orjson.OPT_SERIALIZE_NUMPY)


def echo_matches(echo: Any, prompt_token_ids: np.ndarray, prompt_json: bytes | None) -> bool:
    """True when the engine's echo is the prompt sent, id for id. Compared as JSON text, which
    is exact (``5.0`` or ``true`` for ``5`` differ) and runs in C: 0.5 ms for 54k ids, against
    1.5 ms to compare them as Python lists."""
    if not isinstance(echo, list) or len(echo) != prompt_token_ids.shape[0]:
        return False
    try:
        text = orjson.dumps(echo)
    except TypeError:  # not JSON-writable by orjson (an integer past 64 bits): not an id
        return False
    return text == (prompt_json if prompt_json is not None else prompt_ids_json(prompt_token_ids))


class TokensInAssembler:
    """Collect pieces of one generation from ``prompt_token_ids`` (what the proxy sent)."""

    def __init__(
        self,
        ctx: CallContext,
        prompt_token_ids: np.ndarray,
        decode_experts: Callable[[Any], np.ndarray] | None = None,
        prompt_json: bytes | None = None,
    ) -> None:
        """``decode_experts``: the dialect's routed-experts decoder; rows start at
        ``ctx.routed_experts_start``. ``prompt_json``: the prompt ids as the JSON array sent
        (orjson), to compare the engine's echo with."""
        self.ctx = ctx
        self.prompt_json = prompt_json
        self.decode_experts = decode_experts
        self.routed_experts_raw: Any = None
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.log_probs: list[float | None] = []
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.echo: list[int] | None = None
        self.saw_token_ids = False
        self.saw_log_probs = False

    def add(self, piece: Piece) -> None:
        self.token_ids.extend(piece.token_ids)
        self.log_probs.extend(piece.log_probs)
        self.text.append(piece.text)
        self.saw_token_ids |= piece.saw_token_ids
        self.saw_log_probs |= piece.saw_log_probs
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason
        if piece.usage:
            self.usage = piece.usage
        if piece.routed_experts is not None:
            self.routed_experts_raw = piece.routed_experts
        if piece.prompt_token_ids is not None and self.echo is None:
            self.echo = piece.prompt_token_ids

    @property
    def generated_text(self) -> str:
        return "".join(self.text)

    def finish(
        self,
        *,
        response_message: dict[str, Any],
        finish_reason: str | None,
        latency_ms: float,
        http_status: int,
        extra_diagnostics: list[Diagnostic] | None = None,
    ) -> CallRecord:
        problems: list[str] = []
        diagnostics = [*self.ctx.front_diagnostics, *(extra_diagnostics or [])]
        if self.echo is not None and not echo_matches(
            self.echo, self.prompt_token_ids, self.prompt_json
        ):
            problems.append("engine echoed prompt_token_ids that differ from the ids sent")
        checked = check_generation(
            self.token_ids if self.saw_token_ids else None,
            self.log_probs if self.saw_log_probs else None,
        )
        gen, log_probs = checked.token_ids, checked.log_probs
        problems += checked.problems
        diagnostics += checked.diagnostics
        usage_problems, usage_diagnostics = check_usage(
            self.usage,
            int(self.prompt_token_ids.shape[0]),
            int(gen.shape[0]) if gen is not None else None,
        )
        problems += usage_problems
        diagnostics += usage_diagnostics
        experts = None
        if self.routed_experts_raw is not None and self.decode_experts is not None:
            try:
                experts = self.decode_experts(self.routed_experts_raw)
            except ValueError as exc:
                problems.append(f"routed experts unusable: {exc}")
            else:
                mismatch = check_row_count(
                    experts,
                    start=self.ctx.routed_experts_start,
                    num_prompt_tokens=int(self.prompt_token_ids.shape[0]),
                    num_generation_tokens=len(gen) if gen is not None else 0,
                )
                if mismatch is not None:
                    diagnostics.append(mismatch)  # kept as received, flagged
        expert_problems, expert_diagnostics = expectation_check(
            self.ctx.routed_experts_expectation,
            experts,
            stream=self.ctx.stream,
            parent_had_rows=self.ctx.parent_had_rows,
        )
        problems += expert_problems
        diagnostics += expert_diagnostics
        if problems:
            diagnostics.append(Diagnostic(DiagnosticKind.CAPTURE_INCOMPLETE, {"reasons": problems}))
        record = CallRecord(
            **call_fields(self.ctx),
            status=CallStatus.INCOMPLETE if problems else CallStatus.COMPLETE,
            latency_ms=latency_ms,
            response_message=response_message,
            finish_reason=finish_reason,
            usage=self.usage,
            http_status=http_status,
            diagnostics=diagnostics,
            prompt_token_ids=self.prompt_token_ids,
            routed_experts=experts,
            routed_experts_start=self.ctx.routed_experts_start if experts is not None else 0,
        )
        if gen is not None:
            record.generation_token_ids = gen
        if log_probs is not None:
            record.generation_log_probs = log_probs
        return record
