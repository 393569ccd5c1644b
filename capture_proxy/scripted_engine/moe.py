"""The scripted engine's MoE mode: deterministic routed experts in both engines' encodings.

Owns the expert ids a pretend MoE model routes each token position to, and their wire forms:
vLLM's ``choices[0].routed_experts`` (base64 of ``.npy`` bytes) and SGLang's
``meta_info.routed_experts`` (base64 of raw little-endian int32). A position's row depends only
on (position, token id at that position), so two calls that share a prefix report the same
rows for it, as a real model would for the same prefix; tests use this to check incremental
fetching and the overlap check. Pure: no aiohttp, no I/O.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import numpy as np

MoeShape = tuple[int, int, int]  # (num_layers, top_k, num_experts)


def expert_rows(token_ids: Sequence[int], moe: MoeShape, start: int = 0) -> np.ndarray:
    """Rows ``[start, len(token_ids) - 1)`` like the engines (the last sampled token has no
    row): ``[num_rows, num_layers, top_k]`` with ``top_k`` distinct ids below ``num_experts``
    per layer, uint8 when ``num_experts <= 256`` else uint16."""
    num_layers, top_k, num_experts = moe
    if not 0 < top_k <= num_experts or num_layers <= 0:
        raise ValueError(f"invalid MoE shape {moe}")
    end = max(start, len(token_ids) - 1)
    pos = np.arange(start, end, dtype=np.int64)
    tok = np.asarray(token_ids, dtype=np.int64)[start:end]
    base = (tok * 2654435761 + pos * 40503)[:, None] + np.arange(num_layers)[None, :] * 7919
    ids = (base[:, :, None] % num_experts + np.arange(top_k)[None, None, :]) % num_experts
    return ids.astype(np.uint8 if num_experts <= 256 else np.uint16)


def vllm_routed_experts(rows: np.ndarray) -> str:
    """vLLM's encoding: base64 of the ``.npy`` bytes of ``rows``."""
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def sglang_routed_experts(rows: np.ndarray) -> str:
    """SGLang's encoding: base64 of ``rows`` as raw little-endian int32."""
    return base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii")
