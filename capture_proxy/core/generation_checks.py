"""Checking the token data an engine sent for a call, shared by both assemblies. Pure.

``check_generation`` validates generation ids and log probs (present, of their types, of equal
length; impossible log probs flagged), ``check_usage`` compares the ids received with the
engine's own ``usage`` counts. Both report problems (which make a record ``incomplete``) and
diagnostics; neither raises on engine data. Used by ``assembly`` (template mode) and
``tokens_in_assembly`` (exact-token mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture_proxy.core.records import (
    Diagnostic,
    DiagnosticKind,
    as_log_prob_array,
    as_token_array,
    log_prob_diagnostics,
)


@dataclass(frozen=True)
class CheckedGeneration:
    """Generation arrays as far as they are valid, what is wrong, and what to flag."""

    token_ids: np.ndarray | None
    log_probs: np.ndarray | None
    problems: list[str]
    diagnostics: list[Diagnostic]


def check_usage(
    usage: Any, num_prompt_tokens: int | None, num_generation_tokens: int | None
) -> tuple[list[str], list[Diagnostic]]:
    """Compare the ids received with the engine's own counts (``usage.prompt_tokens``,
    ``usage.completion_tokens``): a stream that lost chunks (vLLM #27482) gives fewer ids
    than the engine generated. A mismatch is a problem (the record is incomplete) and a
    ``token_count_mismatch`` diagnostic; absent counts are not checked."""
    if not isinstance(usage, dict):
        return [], []
    found: dict[str, dict[str, int]] = {}
    for field_name, received in (
        ("prompt_tokens", num_prompt_tokens),
        ("completion_tokens", num_generation_tokens),
    ):
        reported = usage.get(field_name)
        if (
            received is not None
            and isinstance(reported, int)
            and not isinstance(reported, bool)
            and reported != received
        ):
            found[field_name] = {"usage": reported, "received": received}
    if not found:
        return [], []
    problems = [
        f"engine usage.{k} is {v['usage']} but {v['received']} ids were received"
        for k, v in found.items()
    ]
    return problems, [Diagnostic(DiagnosticKind.TOKEN_COUNT_MISMATCH, found)]


def check_generation(
    token_ids: list[int] | None, log_probs: list[float | None] | None
) -> CheckedGeneration:
    """Validate what an engine sent for a generation (None: it sent nothing). Problems make a
    record incomplete: missing ids or log probs (also a log prob list whose every value is null
    or absent: the engine sent none), values that are not token ids or numbers, ids and log
    probs of different lengths. Impossible log probs (non-finite, beyond float32, positive) are
    kept and flagged (``records.log_prob_diagnostics``)."""
    problems: list[str] = []
    diagnostics: list[Diagnostic] = []
    gen = lps = None
    try:
        if token_ids is None:
            problems.append("engine sent no token_ids")
        else:
            gen = as_token_array(token_ids, field_name="token_ids")
        if log_probs is None:
            problems.append("engine sent no logprobs")
        else:
            lps = as_log_prob_array(log_probs, field_name="logprobs")
    except ValueError as exc:
        problems.append(str(exc))
    if gen is not None and lps is not None and gen.shape[0] != lps.shape[0]:
        problems.append(
            f"generation_token_ids has {gen.shape[0]} ids but generation_log_probs has "
            f"{lps.shape[0]} values"
        )
    if lps is not None and log_probs is not None:
        diagnostics += log_prob_diagnostics(lps, log_probs)
        if _all_null(lps, log_probs):
            problems.append(
                f"engine sent no log prob values: all {len(log_probs)} are null or missing"
            )
    return CheckedGeneration(gen, lps, problems, diagnostics)


def _all_null(array: np.ndarray, sent: list[float | None]) -> bool:
    """Every log prob of a non-empty generation is None as sent (``null``, or an entry without
    ``logprob``). O(1) unless the first one is NaN (``array``: ``sent`` as float32)."""
    if array.size == 0 or not math.isnan(float(array[0])):
        return False
    return all(v is None for v in sent)
