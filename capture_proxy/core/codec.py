"""The stored form of a call record: JSON metadata beside little-endian binary arrays.

Owns the mapping ``CallRecord`` <-> ``EncodedRecord`` in the current schema version, what a
store keeps per call to split a child's messages (``StoredMessages``) and the order in which a
rollout's records decode (``decode_records``). The stored form itself (``EncodedRecord``, the
canonical JSON, the metadata's shape ``StoredMeta``) is ``stored_form``'s; the schema versions
and the one-step migrations of older stored forms are ``record_migrations``'s; the request
side, computed before the engine answers (``RequestEncoding``), is ``request_encoding``'s. It
does no I/O: stores decide where the bytes go (SQLite BLOBs for the embedded store) and which
stored call is a record's prompt parent.

Arrays are stored as raw little-endian bytes, never as JSON lists:
- ``prompt_token_ids`` / ``generation_token_ids``: ``<u4`` (uint32);
- ``generation_log_probs``: ``<f4`` (float32; NaN and infinities kept bit for bit);
- ``routed_experts``: the dtype and shape recorded in the metadata (``uint8`` when the expert
  count fits in 256, else ``uint16``; ``int32`` only when the engine's ids do not fit).

Decoded records may share message dicts (a child's prefix is its parent's list items) and
parsed tools lists: treat ``request_messages`` and ``request_tools`` of read records as
read-only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture_proxy.core.record_migrations import migrate
from capture_proxy.core.records import (
    LOG_PROB_DTYPE,
    SCHEMA_VERSION,  # the one version constant: what this codec writes; newer is refused
    TOKEN_DTYPE,
    CallRecord,
    CallStatus,
    Diagnostic,
)
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.stored_form import (
    DIGEST_LEN,
    CorruptRecord,
    EncodedRecord,
    RoutedExpertsMeta,
    StoredMeta,
    delta_items,
    json_sha256,
    meta_text,
    received_refs,
    token_digest,
)

_ROUTED_EXPERT_DTYPES = {"uint8": "<u1", "uint16": "<u2", "int32": "<i4"}


@dataclass(frozen=True)
class PromptParent:
    """The stored call a record's prompt extends: ``prefix_len`` is that call's
    ``num_prompt_tokens + num_generation_tokens``."""

    call_id: str
    prefix_len: int


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


def _encoded_tools_ref(request: RequestEncoding, blobs: dict[str, str]) -> str | None:
    if request.tools_text is None or request.tools_sha256 is None:
        return None
    blobs[request.tools_sha256] = request.tools_text
    return request.tools_sha256


def _decode_received(
    encoded: EncodedRecord, meta: Mapping[str, Any], parsed: dict[str, Any] | None
) -> dict[str, Any] | None:
    inline = meta.get("request_received")
    if inline is None:
        return None
    out = dict(inline)
    for key, sha in (meta.get("request_received_blobs") or {}).items():
        out[key] = _blob_value(encoded, sha, parsed)
    return out


def _routed_experts_form(record: CallRecord) -> tuple[RoutedExpertsMeta | None, bytes | None]:
    """The routed experts' metadata and bytes (the smallest dtype that holds the ids), or
    None, None. Raises ValueError for an array that is not ``[num_rows, num_layers, top_k]``."""
    if record.routed_experts is None:
        return None, None
    arr = compact_routed_experts(np.asarray(record.routed_experts))
    if arr.ndim != 3:
        raise ValueError("routed_experts: expected shape [num_rows, num_layers, top_k]")
    dtype_name = arr.dtype.name
    experts_meta: RoutedExpertsMeta = {
        "dtype": dtype_name,
        "shape": list(arr.shape),
        "start": record.routed_experts_start,
    }
    return experts_meta, arr.astype(_ROUTED_EXPERT_DTYPES[dtype_name], copy=False).tobytes()


def _meta_of(
    record: CallRecord,
    request: RequestEncoding,
    experts_meta: RoutedExpertsMeta | None,
    blobs: dict[str, str],
) -> StoredMeta:
    """The record's metadata; the texts it refers to (tools, large received values) are
    added to ``blobs``."""
    meta: StoredMeta = {
        "model": record.model,
        "latency_ms": record.latency_ms,
        "stream": record.stream,
        "upstream_path": record.upstream_path,
        "request_tools_sha256": _encoded_tools_ref(request, blobs),
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
        "api": record.api,
        "sampling": record.sampling,
        "prompt_mode": record.prompt_mode,
        "weight_versions": record.weight_versions,
        "weight_version_source": record.weight_version_source,
        "images": record.images,
    }
    if record.session_headers is not None:
        meta["session_headers"] = record.session_headers
    known = [
        (request.tools, request.tools_text, request.tools_sha256),
        (request.received_tools, request.received_tools_text, request.received_tools_sha256),
    ]
    meta["request_received"], meta["request_received_blobs"] = received_refs(
        record.request_received, blobs, known=[k for k in known if k[0] is not None]
    )
    return meta


def encode_record(
    record: CallRecord,
    *,
    prompt_parent: PromptParent | None = None,
    messages_prefix_len: int = 0,
    request: RequestEncoding | None = None,
    tokens_sha256: bytes | None = None,
) -> EncodedRecord:
    """Serialise a record in the current schema version.

    ``prompt_parent``: the stored call whose prompt + generation the record's prompt begins
    with (chosen by the store, see ``prefixes``); only the prompt ids after it are kept. The
    caller vouches for the prefix; ``tokens_sha256`` and the lengths let a reader check it.
    ``messages_prefix_len``: how many leading request messages equal the prompt parent's
    (``common_messages_prefix``); only the rest are kept. ``request``: the record's
    ``RequestEncoding`` when the caller computed it ahead (else it is computed here).
    ``tokens_sha256``: the record's ``token_digest`` when the caller computed it already
    (``prefixes.choose_with_digest``: the same pass that chose the parent), else computed here.
    Raises ValueError when the arrays have the wrong rank, the prefix is longer than the
    prompt, the messages prefix is longer than the messages or has no prompt parent, or
    ``request`` does not belong to the record.
    """
    if request is None:
        request = RequestEncoding.of(record.request_messages, record.request_tools)
    elif not request.belongs_to(record):
        raise ValueError("request encoding does not belong to the record's messages and tools")
    experts_meta, experts_bytes = _routed_experts_form(record)
    blobs: dict[str, str] = {}
    meta = _meta_of(record, request, experts_meta, blobs)
    prefix_len = prompt_parent.prefix_len if prompt_parent is not None else 0
    if not 0 <= prefix_len <= record.num_prompt_tokens:
        raise ValueError(f"prompt_prefix_len {prefix_len} is outside the prompt")
    messages = record.request_messages
    digests = request.message_digests
    if not 0 <= messages_prefix_len <= len(messages) or (
        messages_prefix_len and prompt_parent is None
    ):
        raise ValueError(f"messages_prefix_len {messages_prefix_len} is outside the messages")
    return EncodedRecord(
        call_id=record.call_id,
        rollout_id=record.rollout_id,
        created_at=record.created_at,
        status=record.status.value,
        schema_version=SCHEMA_VERSION,
        meta=meta_text(meta),
        prompt_token_ids=record.prompt_token_ids[prefix_len:].astype("<u4", copy=False).tobytes(),
        generation_token_ids=record.generation_token_ids.astype("<u4", copy=False).tobytes(),
        generation_log_probs=record.generation_log_probs.astype("<f4", copy=False).tobytes(),
        routed_experts=experts_bytes,
        prompt_parent_call_id=prompt_parent.call_id if prompt_parent is not None else None,
        prompt_prefix_len=prefix_len,
        num_prompt_tokens=record.num_prompt_tokens,
        num_generation_tokens=record.num_generation_tokens,
        tokens_sha256=tokens_sha256
        or token_digest(record.prompt_token_ids, record.generation_token_ids),
        messages_delta=delta_items(messages, digests, messages_prefix_len, blobs),
        messages_prefix_len=messages_prefix_len,
        num_messages=len(messages),
        messages_sha256=digests.chain[-1],
        messages_chain=b"".join(digests.chain[messages_prefix_len + 1 :]),
        json_blobs=blobs,
    )


def same_content(a: EncodedRecord, b: EncodedRecord) -> bool:
    """True when two stored forms hold the same call. The prompt's and the messages' split
    (which parent, how much kept) depends on what was stored before, so prompts compare by
    digest and length, messages by chain digest and count."""
    a, b = migrate(a), migrate(b)
    keep: dict[str, Any] = {
        "prompt_token_ids": b"",
        "prompt_parent_call_id": None,
        "prompt_prefix_len": 0,
        "messages_delta": "",
        "messages_prefix_len": 0,
        "messages_chain": b"",
    }
    return dataclasses.replace(a, **keep) == dataclasses.replace(b, **keep)


def _blob_value(encoded: EncodedRecord, sha: str, parsed: dict[str, Any] | None) -> Any:
    if parsed is not None and sha in parsed:
        return parsed[sha]
    text = encoded.json_blobs.get(sha)
    if text is None:
        raise CorruptRecord(f"record {encoded.call_id}: JSON {sha} is not stored")
    if json_sha256(text) != sha:
        raise CorruptRecord(f"record {encoded.call_id}: JSON {sha} does not match its address")
    value = json.loads(text)
    if parsed is not None:
        parsed[sha] = value
    return value


def _decode_messages(
    encoded: EncodedRecord,
    messages_prefix: Sequence[Any] | None,
    parsed: dict[str, Any] | None,
) -> list[Any]:
    k = encoded.messages_prefix_len
    if k:
        if encoded.prompt_parent_call_id is None or messages_prefix is None:
            raise CorruptRecord(
                f"record {encoded.call_id}: {k} messages from a base that is not given"
            )
        if len(messages_prefix) < k:
            raise CorruptRecord(
                f"record {encoded.call_id}: prompt parent {encoded.prompt_parent_call_id} gives "
                f"{len(messages_prefix)} messages, the record expects at least {k}"
            )
    try:
        items = json.loads(encoded.messages_delta)
    except ValueError as exc:
        raise CorruptRecord(f"record {encoded.call_id}: messages are not JSON") from exc
    out = list(messages_prefix[:k]) if k and messages_prefix is not None else []
    for item in items:
        if isinstance(item, str):
            out.append(_blob_value(encoded, item, parsed))
        elif isinstance(item, list) and len(item) == 1:
            out.append(item[0])
        else:
            raise CorruptRecord(f"record {encoded.call_id}: a stored message has no form")
    if len(out) != encoded.num_messages:
        raise CorruptRecord(
            f"record {encoded.call_id}: {len(out)} messages rebuilt, {encoded.num_messages} stored"
        )
    if len(encoded.messages_chain) != DIGEST_LEN * (encoded.num_messages - k):
        raise CorruptRecord(f"record {encoded.call_id}: messages_chain length differs")
    return out


def _decode_prompt(encoded: EncodedRecord, prompt_prefix: tuple[np.ndarray, ...]) -> np.ndarray:
    """The full prompt: the prompt parent's pieces, then the stored delta. Raises CorruptRecord
    when the pieces' length is not the record's ``prompt_prefix_len``."""
    delta = np.frombuffer(encoded.prompt_token_ids, dtype="<u4")
    if encoded.prompt_parent_call_id is None:
        return delta.astype(TOKEN_DTYPE)
    prefix_len = sum(int(p.shape[0]) for p in prompt_prefix)
    if prefix_len != encoded.prompt_prefix_len:
        raise CorruptRecord(
            f"record {encoded.call_id}: prompt parent {encoded.prompt_parent_call_id} gives "
            f"{prefix_len} tokens, the record expects {encoded.prompt_prefix_len}"
        )
    return np.concatenate([*prompt_prefix, delta]).astype(TOKEN_DTYPE, copy=False)


def _decode_routed_experts(
    encoded: EncodedRecord, experts_meta: RoutedExpertsMeta | None
) -> tuple[np.ndarray | None, int]:
    """The routed experts (``[num_rows, num_layers, top_k]`` in their stored dtype) and their
    start, or None, 0. Raises CorruptRecord when the bytes are missing or of another size."""
    if experts_meta is None:
        return None, 0
    if encoded.routed_experts is None:
        raise CorruptRecord(f"record {encoded.call_id}: routed_experts bytes missing")
    dtype = _ROUTED_EXPERT_DTYPES[experts_meta["dtype"]]
    flat = np.frombuffer(encoded.routed_experts, dtype=dtype)
    shape = tuple(experts_meta["shape"])
    if flat.size != int(np.prod(shape)):
        raise CorruptRecord(f"record {encoded.call_id}: routed_experts size differs")
    return flat.reshape(shape).astype(np.dtype(experts_meta["dtype"])), int(experts_meta["start"])


def decode_record(
    encoded: EncodedRecord,
    *,
    prompt_prefix: tuple[np.ndarray, ...] = (),
    messages_prefix: Sequence[Any] | None = None,
    parsed_json: dict[str, Any] | None = None,
) -> CallRecord:
    """Rebuild a record (migrating older versions first).

    ``prompt_prefix``: for a record with a prompt parent, that parent's full prompt and
    generation ids (the pieces are joined in order); ``messages_prefix``: that parent's full
    request messages (the record takes the first ``messages_prefix_len``); ``decode_records``
    supplies both. ``parsed_json``: a cache of parsed content-addressed JSON (shared values).
    Raises UnsupportedSchemaVersion for records newer than ``SCHEMA_VERSION`` and
    CorruptRecord when arrays disagree with the metadata, a prefix has the wrong length or a
    content-addressed JSON text is missing.
    """
    encoded = migrate(encoded)
    meta: StoredMeta = json.loads(encoded.meta)
    prompt = _decode_prompt(encoded, prompt_prefix)
    generation = np.frombuffer(encoded.generation_token_ids, dtype="<u4").astype(TOKEN_DTYPE)
    log_probs = np.frombuffer(encoded.generation_log_probs, dtype="<f4").astype(LOG_PROB_DTYPE)
    if prompt.shape[0] != meta["num_prompt_tokens"]:
        raise CorruptRecord(f"record {encoded.call_id}: prompt_token_ids length differs")
    if generation.shape[0] != meta["num_generation_tokens"]:
        raise CorruptRecord(f"record {encoded.call_id}: generation_token_ids length differs")
    messages = _decode_messages(encoded, messages_prefix, parsed_json)
    tools_sha = meta.get("request_tools_sha256")
    tools = None if tools_sha is None else _blob_value(encoded, tools_sha, parsed_json)
    experts, experts_start = _decode_routed_experts(encoded, meta.get("routed_experts"))
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
        api=meta.get("api") or "chat_completions",
        request_received=_decode_received(encoded, meta, parsed_json),
        session_headers=meta.get("session_headers"),
        sampling=meta.get("sampling"),
        prompt_mode=meta.get("prompt_mode"),
        weight_versions=meta.get("weight_versions"),
        weight_version_source=meta.get("weight_version_source"),
        images=meta.get("images"),
        request_messages=messages,
        request_tools=tools,
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


def parents_first(rows: Iterable[EncodedRecord]) -> list[EncodedRecord]:
    """``rows`` (migrated) in an order where each record comes after its prompt parent.

    ``rows`` must include every prompt ancestor of each record. Raises CorruptRecord for a
    missing ancestor or a prompt parent cycle, UnsupportedSchemaVersion as ``migrate`` does.
    """
    encoded = [migrate(r) for r in rows]
    by_id = {r.call_id: r for r in encoded}
    placed: set[str] = set()
    order: list[EncodedRecord] = []
    for row in encoded:
        # Walk up to the first placed (or root) ancestor, then place back down.
        path = [row]
        seen = {row.call_id}
        while path[-1].call_id not in placed and path[-1].prompt_parent_call_id is not None:
            parent_id = path[-1].prompt_parent_call_id
            if parent_id in placed:
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
            if item.call_id not in placed:
                placed.add(item.call_id)
                order.append(item)
    return order


def decode_records(rows: Iterable[EncodedRecord]) -> list[CallRecord]:
    """Decode stored records, rebuilding full prompts and messages from prompt parents.

    ``rows`` must include every prompt ancestor of each record (a store reads a rollout's rows
    together, or walks one record's ancestry). Each prompt and message list is built once from
    its parent's decoded ones, so a chain of T calls costs one pass over what it holds, not T
    walks to the root. Records come back in input order. Raises CorruptRecord for a missing
    ancestor, a prompt parent cycle or a length that does not match, and
    UnsupportedSchemaVersion as ``decode_record`` does.
    """
    rows = list(rows)
    done: dict[str, CallRecord] = {}
    parsed: dict[str, Any] = {}
    for item in parents_first(rows):
        prefix: tuple[np.ndarray, ...] = ()
        messages_prefix: list[Any] | None = None
        if item.prompt_parent_call_id is not None:
            parent_record = done[item.prompt_parent_call_id]
            prefix = (parent_record.prompt_token_ids, parent_record.generation_token_ids)
            messages_prefix = parent_record.request_messages
        done[item.call_id] = decode_record(
            item, prompt_prefix=prefix, messages_prefix=messages_prefix, parsed_json=parsed
        )
    return [done[r.call_id] for r in rows]
