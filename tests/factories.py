"""Small factories for test objects (records with given token ids)."""

from __future__ import annotations

import numpy as np

from capture_proxy.core.records import CallRecord, CallStatus


def record(
    call_id: str,
    prompt: list[int],
    generation: list[int],
    *,
    rollout_id: str = "r1",
    created_at: float = 0.0,
    status: CallStatus = CallStatus.COMPLETE,
    weight_versions: list[tuple[str, int, int]] | None = None,
    weight_version_source: str | None = None,
) -> CallRecord:
    """A record whose log probs are -0.5 * (position + 1), float32. ``weight_versions``:
    ``(version, start, end)`` spans, stored as the record's ``{"version", "start", "end"}``."""
    return CallRecord(
        call_id=call_id,
        rollout_id=rollout_id,
        created_at=created_at,
        status=status,
        prompt_token_ids=np.asarray(prompt, dtype=np.uint32),
        generation_token_ids=np.asarray(generation, dtype=np.uint32),
        generation_log_probs=-0.5 * np.arange(1, len(generation) + 1, dtype=np.float32),
        weight_versions=None
        if weight_versions is None
        else [{"version": v, "start": s, "end": e} for v, s, e in weight_versions],
        weight_version_source=weight_version_source,
    )


def answered_content(content: str, tool_calls: object) -> str:
    """The content vLLM's hermes tool parser answers for a turn written in the Qwen layout
    (content, a newline, the ``<tool_call>`` blocks): the text before the first
    ``<tool_call>``, so the separating newline is part of it when there are calls."""
    return content + "\n" if content and tool_calls else content
