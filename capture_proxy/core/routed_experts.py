"""Routed experts: the engines' encodings, the row ranges they cover, and their verification.

Owns decoding both engine dialects (see notes/engines.md), the request fields that ask an engine
for only the rows a chain does not hold yet, and the checks on what came back. Pure: no I/O, no
aiohttp; a failed check never raises on engine data, it returns a ``routed_experts_mismatch``
diagnostic and the caller keeps the data as received.

Row ranges. A row is the routing of one token position's forward pass:
``routed_experts[i]`` is ``[num_layers, top_k]`` for position ``start + i`` of prompt +
generation. Both engines return rows ``[start, num_prompt + num_generation - 1)``: the last
sampled token was never fed through the model. vLLM's ``routed_experts_prompt_start`` and
SGLang's ``routed_experts_start_len`` set ``start`` (rows before it are skipped), so a child
whose parent already holds rows ``[.., parent_rows_end)`` asks for ``start = parent_rows_end``.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from capture_proxy.core.records import CallRecord, Diagnostic, DiagnosticKind


def decode_vllm_routed_experts(value: Any) -> np.ndarray:
    """Decode vLLM's ``choices[i].routed_experts``: base64 of ``.npy`` bytes (current) or nested
    lists (older releases). Returns an integer array ``[num_rows, num_layers, top_k]``.
    Raises ValueError on anything else."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except (binascii.Error, OSError, EOFError) as exc:
            raise ValueError(f"routed_experts: not base64 .npy: {exc}") from exc
    elif isinstance(value, list):
        arr = np.asarray(value)
    else:
        raise ValueError(f"routed_experts: unsupported encoding {type(value).__name__}")
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"routed_experts: expected integer [rows, layers, top_k], got {arr.shape}")
    return arr


def decode_sglang_routed_experts(value: Any, *, num_layers: int, top_k: int) -> np.ndarray:
    """Decode SGLang's ``meta_info.routed_experts``: base64 of raw little-endian int32, reshaped
    to ``[num_rows, num_layers, top_k]`` (``num_layers`` = the model's ``num_hidden_layers``,
    ``top_k`` = ``num_experts_per_tok``). Raises ValueError when it is not base64 or its size is
    not a whole number of rows."""
    if not isinstance(value, str):
        raise ValueError(f"routed_experts: expected a base64 string, got {type(value).__name__}")
    if num_layers <= 0 or top_k <= 0:
        raise ValueError("routed_experts: num_layers and top_k must be positive")
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"routed_experts: not base64: {exc}") from exc
    row_bytes = 4 * num_layers * top_k
    if len(raw) % row_bytes:
        raise ValueError(
            f"routed_experts: {len(raw)} bytes is not a whole number of int32 rows of "
            f"[{num_layers}, {top_k}]"
        )
    return np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k).astype(np.int32)


def routed_experts_request_fields(
    parent_rows_end: int | None, *, dialect: str = "vllm"
) -> dict[str, Any]:
    """Request fields that ask the engine for only the rows a chain does not hold yet.

    ``parent_rows_end``: end of the rows the parent call holds (``rows_end(parent)``), or None
    when there is no parent (or it holds no rows): then every row is asked for. ``dialect``:
    ``"vllm"`` (chat completions; rows come whenever the server runs with
    ``--enable-return-routed-experts``) or ``"sglang"`` (``/generate``, asks explicitly).
    Raises ValueError for an unknown dialect or a negative row index.
    """
    if parent_rows_end is not None and parent_rows_end < 0:
        raise ValueError("parent_rows_end must be >= 0")
    if dialect == "vllm":
        return {} if not parent_rows_end else {"routed_experts_prompt_start": parent_rows_end}
    if dialect == "sglang":
        return {"return_routed_experts": True, "routed_experts_start_len": parent_rows_end or 0}
    raise ValueError(f"unknown engine dialect {dialect!r}")


def expected_rows(num_prompt_tokens: int, num_generation_tokens: int, start: int) -> range:
    """Token positions an engine returns rows for: ``[start, num_prompt + num_generation - 1)``
    (empty when ``start`` is past the end)."""
    return range(start, max(start, num_prompt_tokens + num_generation_tokens - 1))


def rows_end(record: CallRecord) -> int | None:
    """One past the last token position ``record`` holds a row for, or None without rows."""
    if record.routed_experts is None:
        return None
    return record.routed_experts_start + int(record.routed_experts.shape[0])


def check_row_count(
    experts: np.ndarray, *, start: int, num_prompt_tokens: int, num_generation_tokens: int
) -> Diagnostic | None:
    """None when ``experts`` has one row per expected position (see ``expected_rows``), else a
    ``routed_experts_mismatch`` diagnostic with ``expected_rows`` and ``got_rows``."""
    want = len(expected_rows(num_prompt_tokens, num_generation_tokens, start))
    got = int(experts.shape[0])
    if got == want:
        return None
    return Diagnostic(
        DiagnosticKind.ROUTED_EXPERTS_MISMATCH,
        {
            "reason": "row_count",
            "start": start,
            "expected_rows": want,
            "got_rows": got,
        },
    )


def check_overlap(
    parent: np.ndarray, parent_start: int, child: np.ndarray, child_start: int
) -> Diagnostic | None:
    """None when the rows both arrays hold for the same token positions agree (or they share
    none), else a ``routed_experts_mismatch`` diagnostic naming the first differing position.
    Differing ``[num_layers, top_k]`` shapes are a mismatch too."""
    if parent.shape[1:] != child.shape[1:]:
        return Diagnostic(
            DiagnosticKind.ROUTED_EXPERTS_MISMATCH,
            {
                "reason": "shape",
                "parent_shape": list(parent.shape[1:]),
                "child_shape": list(child.shape[1:]),
            },
        )
    lo = max(parent_start, child_start)
    hi = min(parent_start + parent.shape[0], child_start + child.shape[0])
    if hi <= lo:
        return None
    a = parent[lo - parent_start : hi - parent_start].astype(np.int64)
    b = child[lo - child_start : hi - child_start].astype(np.int64)
    differs = np.flatnonzero((a != b).reshape(hi - lo, -1).any(axis=1))
    if differs.size == 0:
        return None
    return Diagnostic(
        DiagnosticKind.ROUTED_EXPERTS_MISMATCH,
        {
            "reason": "overlap_disagrees",
            "first_position": lo + int(differs[0]),
            "num_positions": int(differs.size),
        },
    )


def align_to_sequence(
    parts: list[tuple[np.ndarray, int]], num_tokens: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Lay rows of several calls of one chain path over one sequence of ``num_tokens``.

    ``parts``: ``(rows [n, num_layers, top_k], start)`` in path order (root first). A position
    takes its row from the first call that covers it (the call whose sampling that routing
    served); later calls fill only positions not yet covered. Returns ``(routed_experts
    [num_tokens, num_layers, top_k], mask uint8 [num_tokens])`` where ``mask`` is 1 where a
    row is present (uncovered rows are 0 in the array), or None when no part has rows.
    The dtype is the widest of the parts'. Raises ValueError when parts differ in
    ``[num_layers, top_k]``.
    """
    if not parts:
        return None
    inner = parts[0][0].shape[1:]
    if any(rows.shape[1:] != inner for rows, _ in parts):
        raise ValueError("routed_experts: calls of one chain differ in [num_layers, top_k]")
    dtype = np.result_type(*(rows.dtype for rows, _ in parts))
    out = np.zeros((num_tokens, *inner), dtype=dtype)
    mask = np.zeros(num_tokens, dtype=np.uint8)
    for rows, start in parts:
        end = min(start + rows.shape[0], num_tokens)
        if end <= start:
            continue
        free = mask[start:end] == 0
        out[start:end][free] = rows[: end - start][free]
        mask[start:end] = 1
    return out, mask


#: What a model's calls promise about routed experts (setting ``routed_experts``):
#: ``required`` (an MoE model trained with routing replay: a call without rows is incomplete),
#: ``optional`` (rows are kept when the engine sends them; a call that should have had them,
#: because its parent did, is flagged), ``off`` (not asked for, not checked).
EXPECTATIONS = ("required", "optional", "off")

UNAVAILABLE_HINT = (
    "vLLM's OpenAI-format streaming returns no routed experts: use exact-token mode with "
    "tokens_in_dialect vllm_generate (/inference/v1/generate streams them) or sglang_generate, "
    "or non-streaming calls"
)


def expectation_check(
    expectation: str, experts: Any, *, stream: bool, parent_had_rows: bool
) -> tuple[list[str], list[Diagnostic]]:
    """(problems that make the record incomplete, diagnostics) for a call whose engine sent
    ``experts`` (None: no rows). ``required``: no rows is a problem and a
    ``routed_experts_unavailable`` diagnostic; ``optional``: only the diagnostic, and only when
    rows were to be expected (the parent held rows); ``off``: nothing."""
    if experts is not None or expectation == "off":
        return [], []
    if expectation == "optional" and not parent_had_rows:
        return [], []
    details = {
        "reason": "the engine returned no routed experts" + (" (streamed call)" if stream else ""),
        "expectation": expectation,
        "hint": UNAVAILABLE_HINT,
    }
    diagnostics = [Diagnostic(DiagnosticKind.ROUTED_EXPERTS_UNAVAILABLE, details)]
    if expectation == "required":
        return [f"routed experts are required but {details['reason']}"], diagnostics
    return [], diagnostics
