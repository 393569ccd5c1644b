"""Mapping a chat request's sampling settings onto a tokens-in request. Pure.

Owns which chat-completions fields carry over to the engine's tokens-in endpoints, faithfully
and by name, and the clamp of the generation budget to the context length: a chat request's
``max_tokens`` (or ``max_completion_tokens``) may exceed what the context leaves after the
exact-token prompt; the engine would refuse the request, so it is clamped (and said so).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

#: Chat fields passed to the engine's sampling parameters under the same name (vLLM
#: ``SamplingParams`` / SGLang ``sampling_params`` share these names).
PASSED_THROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    # constrained decoding, which vLLM's /v1/completions also takes
    "logit_bias",
    "structured_outputs",
    "response_format",
)


class SamplingError(ValueError):
    """A sampling field has a value the tokens-in path cannot honour; ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Sampling:
    """``max_tokens`` after the clamp; ``stop`` strings; ``extra`` = the passed-through fields;
    ``clamped_from`` = the requested budget when it was clamped."""

    max_tokens: int
    stop: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    clamped_from: int | None = None


def continued_sampling(sampling: Sampling, num_generated: int) -> Sampling:
    """The sampling of a generation continued after ``num_generated`` tokens (an engine abort):
    the rest of ``max_tokens`` (at least 1) and of ``min_tokens``; the rest unchanged (a stop
    string that spans the two requests is not seen by the engine)."""
    extra = dict(sampling.extra)
    min_tokens = extra.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        extra["min_tokens"] = max(0, min_tokens - num_generated)
    return dataclasses.replace(
        sampling, max_tokens=max(1, sampling.max_tokens - num_generated), extra=extra
    )


def sampling_from_chat(
    body: dict[str, Any], *, num_prompt_tokens: int, max_model_len: int
) -> Sampling:
    """Sampling for a tokens-in call. Raises SamplingError (no room left, bad ``stop``)."""
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise SamplingError(
            f"the prompt has {num_prompt_tokens} tokens; the context length is {max_model_len}",
            "messages",
        )
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    if requested is not None and (
        isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
    ):
        raise SamplingError("max_tokens must be a positive integer", "max_tokens")
    max_tokens = room if requested is None else min(requested, room)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise SamplingError("stop must be a string or a list of strings", "stop")
    extra = {k: body[k] for k in PASSED_THROUGH if body.get(k) is not None}
    clamped = requested if requested is not None and requested > room else None
    return Sampling(max_tokens=max_tokens, stop=stops, extra=extra, clamped_from=clamped)


#: The sampling settings a trainer needs for importance ratios and off-policy corrections,
#: recorded per call by their chat-completions / vLLM names.
RECORDED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
)
#: Of those, the ones an engine applies a default for when they are left out (``max_tokens``
#: and its alias are one setting: the context left).
_DEFAULTED = tuple(k for k in RECORDED if k != "max_completion_tokens")


def sampling_record(sent: dict[str, Any]) -> dict[str, Any]:
    """What a call's record keeps of its sampling: ``sent``, the settings as sent to the
    engine (by name, as sent), and ``engine_defaults``, the names left to the engine's defaults
    (vLLM: its ``SamplingParams`` defaults or the model's ``generation_config``)."""
    values = {k: sent[k] for k in RECORDED if sent.get(k) is not None}
    if "max_completion_tokens" in values and "max_tokens" not in values:
        values["max_tokens"] = values.pop("max_completion_tokens")
    values.pop("max_completion_tokens", None)
    return {
        "sent": values,
        "engine_defaults": [k for k in _DEFAULTED if k not in values],
    }


def sampling_record_tokens_in(sampling: Sampling) -> dict[str, Any]:
    """``sampling_record`` of a tokens-in call (what ``engine_formats`` sends: the clamped
    ``max_tokens``, ``stop`` and the passed-through fields)."""
    sent: dict[str, Any] = {**sampling.extra, "max_tokens": sampling.max_tokens}
    if sampling.stop:
        sent["stop"] = list(sampling.stop)
    return sampling_record(sent)
