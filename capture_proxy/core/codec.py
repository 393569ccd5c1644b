"""The stored form of a call record: JSON metadata beside little-endian binary arrays.

Owns the mapping ``CallRecord`` <-> ``EncodedRecord`` and the schema-version check. It does no
I/O: stores decide where the bytes go (SQLite BLOBs for the embedded store).

Arrays are stored as raw little-endian bytes, never as JSON lists:
- ``prompt_token_ids`` / ``generation_token_ids``: ``<u4`` (uint32);
- ``generation_log_probs``: ``<f4`` (float32; NaN and infinities kept bit for bit);
- ``routed_experts``: the dtype and shape recorded in the metadata (``uint8`` when the expert
  count fits in 256, else ``uint16``; ``int32`` only when the engine's ids do not fit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture_proxy.core.records import (
    LOG_PROB_DTYPE,
    SCHEMA_VERSION,
    TOKEN_DTYPE,
    CallRecord,
    CallStatus,
    Diagnostic,
)

_ROUTED_EXPERT_DTYPES = {"uint8": "<u1", "uint16": "<u2", "int32": "<i4"}


class UnsupportedSchemaVersion(ValueError):
    """A stored record is newer than this reader knows; refusing is safer than guessing."""


class CorruptRecord(ValueError):
    """A stored record's arrays do not match its metadata (lengths, dtype, shape)."""


@dataclass(frozen=True)
class EncodedRecord:
    """A record ready to store: ``meta`` (JSON text) and four binary arrays (or None)."""

    call_id: str
    rollout_id: str
    created_at: float
    status: str
    schema_version: int
    meta: str
    prompt_token_ids: bytes
    generation_token_ids: bytes
    generation_log_probs: bytes
    routed_experts: bytes | None


def compact_routed_experts(experts: np.ndarray) -> np.ndarray:
    """Narrow routed expert ids to the smallest dtype that holds them.

    ``experts``: integer ``[num_rows, num_layers, top_k]``. Returns uint8 when every id is
    below 256, uint16 below 65,536, else int32. Raises ValueError on negative ids.
    """
    if experts.size and int(experts.min()) < 0:
        raise ValueError("routed_experts: negative expert id")
    top = int(experts.max()) if experts.size else 0
    if top < 256:
        return experts.astype(np.uint8, copy=False)
    if top < 65536:
        return experts.astype(np.uint16, copy=False)
    return experts.astype(np.int32, copy=False)


def encode_record(record: CallRecord) -> EncodedRecord:
    """Serialise a record. Raises ValueError when the arrays have the wrong rank."""
    experts_meta: dict[str, Any] | None = None
    experts_bytes: bytes | None = None
    if record.routed_experts is not None:
        arr = compact_routed_experts(np.asarray(record.routed_experts))
        if arr.ndim != 3:
            raise ValueError("routed_experts: expected shape [num_rows, num_layers, top_k]")
        dtype_name = arr.dtype.name
        experts_meta = {
            "dtype": dtype_name,
            "shape": list(arr.shape),
            "start": record.routed_experts_start,
        }
        experts_bytes = arr.astype(_ROUTED_EXPERT_DTYPES[dtype_name], copy=False).tobytes()
    meta = {
        "model": record.model,
        "latency_ms": record.latency_ms,
        "stream": record.stream,
        "upstream_path": record.upstream_path,
        "request_messages": record.request_messages,
        "request_tools": record.request_tools,
        "response_message": record.response_message,
        "finish_reason": record.finish_reason,
        "usage": record.usage,
        "http_status": record.http_status,
        "parent_call_id": record.parent_call_id,
        "diagnostics": [d.to_json() for d in record.diagnostics],
        "num_prompt_tokens": record.num_prompt_tokens,
        "num_generation_tokens": record.num_generation_tokens,
        "routed_experts": experts_meta,
    }
    return EncodedRecord(
        call_id=record.call_id,
        rollout_id=record.rollout_id,
        created_at=record.created_at,
        status=record.status.value,
        schema_version=record.schema_version,
        meta=json.dumps(meta, ensure_ascii=False, separators=(",", ":"), allow_nan=False),
        prompt_token_ids=record.prompt_token_ids.astype("<u4", copy=False).tobytes(),
        generation_token_ids=record.generation_token_ids.astype("<u4", copy=False).tobytes(),
        generation_log_probs=record.generation_log_probs.astype("<f4", copy=False).tobytes(),
        routed_experts=experts_bytes,
    )


def decode_record(encoded: EncodedRecord) -> CallRecord:
    """Rebuild a record. Raises UnsupportedSchemaVersion for records newer than
    ``SCHEMA_VERSION`` and CorruptRecord when arrays disagree with the metadata."""
    if encoded.schema_version > SCHEMA_VERSION:
        raise UnsupportedSchemaVersion(
            f"record {encoded.call_id} has schema_version {encoded.schema_version}; "
            f"this reader knows up to {SCHEMA_VERSION}"
        )
    meta = json.loads(encoded.meta)
    prompt = np.frombuffer(encoded.prompt_token_ids, dtype="<u4").astype(TOKEN_DTYPE)
    generation = np.frombuffer(encoded.generation_token_ids, dtype="<u4").astype(TOKEN_DTYPE)
    log_probs = np.frombuffer(encoded.generation_log_probs, dtype="<f4").astype(LOG_PROB_DTYPE)
    if prompt.shape[0] != meta["num_prompt_tokens"]:
        raise CorruptRecord(f"record {encoded.call_id}: prompt_token_ids length differs")
    if generation.shape[0] != meta["num_generation_tokens"]:
        raise CorruptRecord(f"record {encoded.call_id}: generation_token_ids length differs")
    experts = None
    experts_start = 0
    experts_meta = meta.get("routed_experts")
    if experts_meta is not None:
        if encoded.routed_experts is None:
            raise CorruptRecord(f"record {encoded.call_id}: routed_experts bytes missing")
        dtype = _ROUTED_EXPERT_DTYPES[experts_meta["dtype"]]
        flat = np.frombuffer(encoded.routed_experts, dtype=dtype)
        shape = tuple(experts_meta["shape"])
        if flat.size != int(np.prod(shape)):
            raise CorruptRecord(f"record {encoded.call_id}: routed_experts size differs")
        experts = flat.reshape(shape).astype(np.dtype(experts_meta["dtype"]))
        experts_start = int(experts_meta["start"])
    return CallRecord(
        call_id=encoded.call_id,
        rollout_id=encoded.rollout_id,
        created_at=encoded.created_at,
        status=CallStatus(encoded.status),
        schema_version=encoded.schema_version,
        model=meta.get("model"),
        latency_ms=meta.get("latency_ms"),
        stream=bool(meta.get("stream")),
        upstream_path=meta.get("upstream_path") or "/v1/chat/completions",
        request_messages=meta.get("request_messages") or [],
        request_tools=meta.get("request_tools"),
        response_message=meta.get("response_message"),
        finish_reason=meta.get("finish_reason"),
        usage=meta.get("usage"),
        http_status=meta.get("http_status"),
        parent_call_id=meta.get("parent_call_id"),
        diagnostics=[Diagnostic.from_json(d) for d in meta.get("diagnostics") or []],
        prompt_token_ids=prompt,
        generation_token_ids=generation,
        generation_log_probs=log_probs,
        routed_experts=experts,
        routed_experts_start=experts_start,
    )
