"""The stored form of a call record: JSON metadata beside little-endian binary arrays.

Owns the mapping ``CallRecord`` <-> ``EncodedRecord``, the schema-version check and the
one-step migrations of older stored forms. It does no I/O: stores decide where the bytes go
(SQLite BLOBs for the embedded store) and which stored call is a record's prompt parent.

Arrays are stored as raw little-endian bytes, never as JSON lists:
- ``prompt_token_ids`` / ``generation_token_ids``: ``<u4`` (uint32);
- ``generation_log_probs``: ``<f4`` (float32; NaN and infinities kept bit for bit);
- ``routed_experts``: the dtype and shape recorded in the metadata (``uint8`` when the expert
  count fits in 256, else ``uint16``; ``int32`` only when the engine's ids do not fit).

Schema versions:
- 1: every record holds its full prompt.
- 2 (current): a record may hold only the prompt tokens after a *prompt parent*: a stored call
  of the same rollout whose prompt + generation is a prefix of this record's prompt
  (``prompt_parent_call_id``, ``prompt_prefix_len`` = that call's prompt + generation length).
  ``prompt_token_ids`` then holds the remaining ``num_prompt_tokens - prompt_prefix_len`` ids,
  so a chain of T turns stores O(T) tokens, not O(T^2). ``tokens_sha256`` (SHA-256 of the
  ``<u4`` bytes of the full prompt followed by the generation) lets a store find prompt parents
  and compare re-puts without rebuilding prompts. Reading rebuilds full prompts root first
  (``decode_records``), each prompt from its parent's once, and checks every length.
  v1 -> v2 (``MIGRATIONS``): the prompt stays whole (no prompt parent), the digest and the
  token counts are computed from the stored bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable
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
    """A record ready to store: ``meta`` (JSON text) and four binary arrays (or None).

    ``prompt_token_ids`` holds the prompt ids after ``prompt_prefix_len`` (all of them when
    ``prompt_parent_call_id`` is None). The last four fields are v2's; a v1 record read from an
    old store leaves them at their defaults until ``migrate`` fills them in.
    """

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
    prompt_parent_call_id: str | None = None
    prompt_prefix_len: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    tokens_sha256: bytes = b""


@dataclass(frozen=True)
class PromptParent:
    """The stored call a record's prompt extends: ``prefix_len`` is that call's
    ``num_prompt_tokens + num_generation_tokens``."""

    call_id: str
    prefix_len: int


def token_digest(prompt: np.ndarray, generation: np.ndarray) -> bytes:
    """SHA-256 of the ``<u4`` bytes of ``prompt`` followed by ``generation``."""
    h = hashlib.sha256(prompt.astype("<u4", copy=False).tobytes())
    h.update(generation.astype("<u4", copy=False).tobytes())
    return h.digest()


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


def encode_record(
    record: CallRecord, *, prompt_parent: PromptParent | None = None
) -> EncodedRecord:
    """Serialise a record in the current schema version.

    ``prompt_parent``: the stored call whose prompt + generation the record's prompt begins
    with (chosen by the store, see ``prefixes``); only the prompt ids after it are kept. The
    caller vouches for the prefix; ``tokens_sha256`` and the lengths let a reader check it.
    Raises ValueError when the arrays have the wrong rank or the prefix is longer than the
    prompt.
    """
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
        "linking": record.linking,
        "retry_of": record.retry_of,
        "diagnostics": [d.to_json() for d in record.diagnostics],
        "num_prompt_tokens": record.num_prompt_tokens,
        "num_generation_tokens": record.num_generation_tokens,
        "routed_experts": experts_meta,
    }
    prefix_len = prompt_parent.prefix_len if prompt_parent is not None else 0
    if not 0 <= prefix_len <= record.num_prompt_tokens:
        raise ValueError(f"prompt_prefix_len {prefix_len} is outside the prompt")
    return EncodedRecord(
        call_id=record.call_id,
        rollout_id=record.rollout_id,
        created_at=record.created_at,
        status=record.status.value,
        schema_version=SCHEMA_VERSION,
        meta=json.dumps(meta, ensure_ascii=False, separators=(",", ":"), allow_nan=False),
        prompt_token_ids=record.prompt_token_ids[prefix_len:].astype("<u4", copy=False).tobytes(),
        generation_token_ids=record.generation_token_ids.astype("<u4", copy=False).tobytes(),
        generation_log_probs=record.generation_log_probs.astype("<f4", copy=False).tobytes(),
        routed_experts=experts_bytes,
        prompt_parent_call_id=prompt_parent.call_id if prompt_parent is not None else None,
        prompt_prefix_len=prefix_len,
        num_prompt_tokens=record.num_prompt_tokens,
        num_generation_tokens=record.num_generation_tokens,
        tokens_sha256=token_digest(record.prompt_token_ids, record.generation_token_ids),
    )


def _v1_to_v2(encoded: EncodedRecord) -> EncodedRecord:
    """v1 kept the whole prompt: no prompt parent; digest and counts from the stored bytes."""
    prompt = np.frombuffer(encoded.prompt_token_ids, dtype="<u4")
    generation = np.frombuffer(encoded.generation_token_ids, dtype="<u4")
    return dataclasses.replace(
        encoded,
        schema_version=2,
        prompt_parent_call_id=None,
        prompt_prefix_len=0,
        num_prompt_tokens=int(prompt.shape[0]),
        num_generation_tokens=int(generation.shape[0]),
        tokens_sha256=token_digest(prompt, generation),
    )


#: One step per version: ``MIGRATIONS[v]`` turns a version-v record into version v + 1.
MIGRATIONS: dict[int, Callable[[EncodedRecord], EncodedRecord]] = {1: _v1_to_v2}


def migrate(encoded: EncodedRecord) -> EncodedRecord:
    """Bring a stored record to ``SCHEMA_VERSION`` one step at a time. Raises
    UnsupportedSchemaVersion for a record newer than this reader (or older than any step)."""
    if encoded.schema_version > SCHEMA_VERSION:
        raise UnsupportedSchemaVersion(
            f"record {encoded.call_id} has schema_version {encoded.schema_version}; "
            f"this reader knows up to {SCHEMA_VERSION}"
        )
    while encoded.schema_version < SCHEMA_VERSION:
        step = MIGRATIONS.get(encoded.schema_version)
        if step is None:
            raise UnsupportedSchemaVersion(
                f"record {encoded.call_id}: no migration from schema_version "
                f"{encoded.schema_version}"
            )
        encoded = step(encoded)
    return encoded


def same_content(a: EncodedRecord, b: EncodedRecord) -> bool:
    """True when two stored forms hold the same call. The prompt's split (which parent, how
    many ids kept) depends on what was stored before, so prompts compare by digest and length.
    """
    a, b = migrate(a), migrate(b)
    keep: dict[str, Any] = {
        "prompt_token_ids": b"",
        "prompt_parent_call_id": None,
        "prompt_prefix_len": 0,
    }
    return dataclasses.replace(a, **keep) == dataclasses.replace(b, **keep)


def decode_record(
    encoded: EncodedRecord, *, prompt_prefix: tuple[np.ndarray, ...] = ()
) -> CallRecord:
    """Rebuild a record (migrating older versions first).

    ``prompt_prefix``: for a record with a prompt parent, that parent's full prompt and
    generation ids (the pieces are joined in order); ``decode_records`` supplies them.
    Raises UnsupportedSchemaVersion for records newer than ``SCHEMA_VERSION`` and
    CorruptRecord when arrays disagree with the metadata or the prefix has the wrong length.
    """
    encoded = migrate(encoded)
    meta = json.loads(encoded.meta)
    delta = np.frombuffer(encoded.prompt_token_ids, dtype="<u4")
    if encoded.prompt_parent_call_id is None:
        prompt = delta.astype(TOKEN_DTYPE)
    else:
        prefix_len = sum(int(p.shape[0]) for p in prompt_prefix)
        if prefix_len != encoded.prompt_prefix_len:
            raise CorruptRecord(
                f"record {encoded.call_id}: prompt parent {encoded.prompt_parent_call_id} gives "
                f"{prefix_len} tokens, the record expects {encoded.prompt_prefix_len}"
            )
        prompt = np.concatenate([*prompt_prefix, delta]).astype(TOKEN_DTYPE, copy=False)
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
        schema_version=encoded.schema_version,  # migrated: always SCHEMA_VERSION
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
        linking=meta.get("linking"),
        retry_of=meta.get("retry_of"),
        diagnostics=[Diagnostic.from_json(d) for d in meta.get("diagnostics") or []],
        prompt_token_ids=prompt,
        generation_token_ids=generation,
        generation_log_probs=log_probs,
        routed_experts=experts,
        routed_experts_start=experts_start,
    )


def decode_records(rows: Iterable[EncodedRecord]) -> list[CallRecord]:
    """Decode stored records, rebuilding full prompts from prompt parents.

    ``rows`` must include every prompt ancestor of each record (a store reads a rollout's rows
    together, or walks one record's ancestry). Each prompt is built once from its parent's
    decoded arrays, so a chain of T calls costs one pass over what it holds, not T walks to the
    root. Records come back in input order. Raises CorruptRecord for a missing ancestor, a
    prompt parent cycle or a length that does not match, and UnsupportedSchemaVersion as
    ``decode_record`` does.
    """
    encoded = [migrate(r) for r in rows]
    by_id = {r.call_id: r for r in encoded}
    done: dict[str, CallRecord] = {}
    for row in encoded:
        # Walk up to the first decoded (or root) ancestor, then decode back down.
        path = [row]
        seen = {row.call_id}
        while path[-1].call_id not in done and path[-1].prompt_parent_call_id is not None:
            parent_id = path[-1].prompt_parent_call_id
            if parent_id in done:
                break
            parent = by_id.get(parent_id)
            if parent is None:
                raise CorruptRecord(
                    f"record {path[-1].call_id}: prompt parent {parent_id} is not stored"
                )
            if parent_id in seen:
                raise CorruptRecord(f"record {row.call_id}: prompt parents form a cycle")
            seen.add(parent_id)
            path.append(parent)
        for item in reversed(path):
            if item.call_id in done:
                continue
            prefix: tuple[np.ndarray, ...] = ()
            if item.prompt_parent_call_id is not None:
                parent_record = done[item.prompt_parent_call_id]
                prefix = (parent_record.prompt_token_ids, parent_record.generation_token_ids)
            done[item.call_id] = decode_record(item, prompt_prefix=prefix)
    return [done[r.call_id] for r in encoded]
