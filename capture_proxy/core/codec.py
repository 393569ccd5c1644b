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
- 2: a record may hold only the prompt tokens after a *prompt parent*: a stored call
  of the same rollout whose prompt + generation is a prefix of this record's prompt
  (``prompt_parent_call_id``, ``prompt_prefix_len`` = that call's prompt + generation length).
  ``prompt_token_ids`` then holds the remaining ``num_prompt_tokens - prompt_prefix_len`` ids,
  so a chain of T turns stores O(T) tokens, not O(T^2). ``tokens_sha256`` (SHA-256 of the
  ``<u4`` bytes of the full prompt followed by the generation) lets a store find prompt parents
  and compare re-puts without rebuilding prompts. Reading rebuilds full prompts root first
  (``decode_records``), each prompt from its parent's once, and checks every length.
  v1 -> v2 (``MIGRATIONS``): the prompt stays whole (no prompt parent), the digest and the
  token counts are computed from the stored bytes.
- 3 (current): the request's JSON grows linearly with a chain too. ``request_messages`` are
  stored as a delta after the same base as the prompt (the prompt parent): the record keeps
  ``messages_prefix_len`` = k, the length of the common prefix of its messages with the base's
  full messages (compared as canonical JSON texts, see ``canonical_json``), and only
  ``messages[k:]`` in ``messages_delta``. Large repeated JSON is content-addressed: the
  ``request_tools`` list (meta ``request_tools_sha256``) and every system/developer message of
  at least ``REF_MIN_BYTES`` in the delta are stored once per distinct content under the
  SHA-256 of their canonical JSON (``EncodedRecord.json_blobs`` carries the texts a record
  refers to; a store keeps them in a table of its own). Per call: ``num_messages``,
  ``messages_sha256`` (the chain digest of all messages, ``MessageDigests``) and
  ``messages_chain`` (the chain digests of the delta's positions) let a store choose k without
  reading any other call's messages. Reading rebuilds messages root first, in the prompts'
  order, and checks every length.
  A v3 record may also carry ``api`` (the wire API; absent: ``chat_completions``) and
  ``request_received`` (the body as received less its history field; values of at least
  ``REF_MIN_BYTES`` of canonical JSON content-addressed under ``request_received_blobs``) and
  ``sampling`` (the sampling settings sent, and those left to the engine's defaults):
  additive fields that older v3 readers ignore, so the version is unchanged.
  v2 -> v3: the messages stay whole (k = 0) and the tools (and large system messages) move to
  ``json_blobs``; a store may rebase the messages afterwards (``rebase_messages``).

Decoded records may share message dicts (a child's prefix is its parent's list items) and
parsed tools lists: treat ``request_messages`` and ``request_tools`` of read records as
read-only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from capture_proxy.core.records import (
    LOG_PROB_DTYPE,
    SCHEMA_VERSION,  # the one version constant: what this codec writes; newer is refused
    TOKEN_DTYPE,
    CallRecord,
    CallStatus,
    Diagnostic,
)

_ROUTED_EXPERT_DTYPES = {"uint8": "<u1", "uint16": "<u2", "int32": "<i4"}

#: Delta messages with one of these roles and a canonical JSON of at least ``REF_MIN_BYTES``
#: bytes are content-addressed (a system prompt repeats at every chain root).
REF_ROLES = frozenset({"system", "developer"})
REF_MIN_BYTES = 512

_DIGEST_LEN = 32
_CHAIN_START = hashlib.sha256(b"").digest()

# Metadata keys of a v3 record, in the order they are written (``same_content`` compares the
# text, so encoding and migration must agree on it).
_META_KEYS = (
    "model",
    "latency_ms",
    "stream",
    "upstream_path",
    "request_tools_sha256",
    "response_message",
    "finish_reason",
    "usage",
    "http_status",
    "parent_call_id",
    "linking",
    "retry_of",
    "diagnostics",
    "num_prompt_tokens",
    "num_generation_tokens",
    "routed_experts",
    "api",
    "request_received",
    "request_received_blobs",
    "sampling",
)


class UnsupportedSchemaVersion(ValueError):
    """A stored record is newer than this reader knows; refusing is safer than guessing."""


class CorruptRecord(ValueError):
    """A stored record's arrays do not match its metadata (lengths, dtype, shape)."""


@dataclass(frozen=True)
class EncodedRecord:
    """A record ready to store: ``meta`` (JSON text) and four binary arrays (or None).

    ``prompt_token_ids`` holds the prompt ids after ``prompt_prefix_len`` (all of them when
    ``prompt_parent_call_id`` is None). ``messages_delta`` holds the request messages after
    ``messages_prefix_len`` (taken from the prompt parent's full messages) as a JSON array whose
    items are ``[message]`` (inline) or a hex SHA-256 (a text in ``json_blobs``). The fields
    after ``routed_experts`` are v2's and v3's; a record read from an older store leaves them
    at their defaults until ``migrate`` fills them in. ``json_blobs`` (hex SHA-256 -> canonical
    JSON text) is not a column: the texts the record refers to, for a store to keep once.
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
    messages_delta: str = "[]"
    messages_prefix_len: int = 0
    num_messages: int = 0
    messages_sha256: bytes = b""
    messages_chain: bytes = b""
    json_blobs: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)


#: The stored columns of an ``EncodedRecord``, in field order (every field but ``json_blobs``).
COLUMNS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(EncodedRecord) if f.name != "json_blobs"
)


def column_values(encoded: EncodedRecord) -> tuple[Any, ...]:
    """The values of ``COLUMNS`` (no deep copy, unlike ``dataclasses.astuple``)."""
    return tuple(getattr(encoded, name) for name in COLUMNS)


@dataclass(frozen=True)
class PromptParent:
    """The stored call a record's prompt extends: ``prefix_len`` is that call's
    ``num_prompt_tokens + num_generation_tokens``."""

    call_id: str
    prefix_len: int


#: One encoder for every canonical text (``json.dumps`` with options builds one per call).
_CANONICAL_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_CONTAINERS = (dict, list, tuple)


def _orjson_writes_it_alike(value: Any) -> bool:
    """True when ``value`` holds only dicts, lists, tuples, ``str``, ``int``, ``bool`` and
    None (those exact types, no subclasses): orjson's text of it is then the stdlib's (tested
    on every code point), or orjson refuses it (a key that is not a string, an integer past 64
    bits, a lone surrogate) and the stdlib writes it. Not floats: orjson writes ``1e16`` where
    the stdlib writes ``1e+16``, and NaN as ``null``. A walk over the nodes, not over the
    strings' characters, which is where the stdlib's time goes."""
    if type(value) not in _CONTAINERS:
        return value is None or type(value) in (str, int, bool)
    stack = [value]
    while stack:
        item = stack.pop()
        for child in item.values() if type(item) is dict else item:
            kind = type(child)
            if kind is str or kind is int or kind is bool or child is None:
                continue
            if kind is dict or kind is list or kind is tuple:
                stack.append(child)
            else:
                return False
    return True


def canonical_json(value: Any) -> str:
    """The one JSON text of a value that digests and content addresses use: compact, UTF-8
    (not ASCII-escaped), keys in their order (so a round trip keeps it), no NaN (ValueError).
    ``1``, ``1.0`` and ``true`` differ, as JSON values do.

    The text is the stdlib encoder's; orjson writes it when it writes it alike (see
    ``_orjson_writes_it_alike``), 10-20x faster on a long agent history."""
    if _orjson_writes_it_alike(value):
        try:
            return orjson.dumps(value).decode()
        except TypeError:
            pass
    return _CANONICAL_ENCODER.encode(value)


def json_sha256(text: str) -> str:
    """Hex SHA-256 of a canonical JSON text (its UTF-8 bytes): the content address."""
    return json_sha256_bytes(text).hex()


def json_sha256_bytes(text: str) -> bytes:
    """SHA-256 of a canonical JSON text's UTF-8 bytes (32 bytes)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class MessageDigests:
    """Canonical texts and digests of a request's messages.

    ``chain[j]`` (0 <= j <= n) is the chain digest of the first j messages:
    ``chain[0] = sha256(b"")``, ``chain[j] = sha256(chain[j-1] + sha256(text[j-1]))``. Two
    message lists have equal chain digests at j exactly when their first j canonical texts are
    equal (barring SHA-256 collisions), so a store compares prefixes with one digest each.
    """

    texts: tuple[str, ...]
    digests: tuple[bytes, ...]
    chain: tuple[bytes, ...]

    @classmethod
    def of(cls, messages: Sequence[Any]) -> MessageDigests:
        """Raises ValueError on a message without a canonical text (NaN, infinities)."""
        texts = tuple(canonical_json(m) for m in messages)
        return cls.of_texts(texts, tuple(json_sha256_bytes(t) for t in texts))

    @classmethod
    def of_texts(cls, texts: tuple[str, ...], digests: tuple[bytes, ...]) -> MessageDigests:
        """From the messages' canonical texts and their SHA-256 digests (known already, e.g.
        ``known_messages.MessageFacts``): only the chain is computed."""
        chain = [_CHAIN_START]
        for d in digests:
            chain.append(hashlib.sha256(chain[-1] + d).digest())
        return cls(texts, digests, tuple(chain))

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True)
class RequestEncoding:
    """The request side of a record's stored form: the messages' ``MessageDigests`` and the
    tools' canonical text and content address. It depends only on the request, so the proxy
    computes it while the engine is still prefilling, and the write at the end of the call
    (before ``[DONE]``) encodes only what the engine sent.

    ``messages`` and ``tools`` are the very objects it was computed from: ``belongs_to``
    compares them with a record's by identity (never by value, which would cost what this
    saves), so an encoding is only used for the record built from the same request.
    """

    messages: tuple[Any, ...]
    tools: Any
    message_digests: MessageDigests
    tools_text: str | None
    tools_sha256: str | None

    @classmethod
    def of(
        cls, messages: Sequence[Any], tools: Any, digests: MessageDigests | None = None
    ) -> RequestEncoding:
        """``digests``: the messages' ``MessageDigests`` when known already. Raises ValueError
        on values without a canonical text (NaN, infinities)."""
        text = canonical_json(tools) if tools is not None else None
        return cls(
            tuple(messages),
            tools,
            digests if digests is not None else MessageDigests.of(messages),
            text,
            json_sha256(text) if text is not None else None,
        )

    def belongs_to(self, record: CallRecord) -> bool:
        """True when ``record`` carries the same message and tools objects."""
        messages = record.request_messages
        return (
            self.tools is record.request_tools
            and len(self.messages) == len(messages)
            and all(a is b for a, b in zip(self.messages, messages, strict=True))
        )


@dataclass(frozen=True)
class StoredMessages:
    """What a store keeps per call to compare a child's messages with it, without reading any
    messages: ``messages_prefix_len`` (k), ``num_messages`` (n), ``messages_chain`` (the chain
    digests of positions k+1..n) and the call's own prompt parent."""

    call_id: str
    prompt_parent_call_id: str | None
    messages_prefix_len: int
    num_messages: int
    messages_chain: bytes

    def chain_at(self, j: int) -> bytes:
        """The chain digest at position j, k < j <= n."""
        i = (j - self.messages_prefix_len - 1) * _DIGEST_LEN
        return self.messages_chain[i : i + _DIGEST_LEN]


def common_messages_prefix(
    messages: MessageDigests, base_id: str, lookup: Callable[[str], StoredMessages | None]
) -> int:
    """k: the length of the common prefix of ``messages`` with the full messages of the stored
    call ``base_id``. ``lookup`` gives a stored call's ``StoredMessages`` (None when it is not
    stored). Looks at the base and, only while the prefix ends before the base's delta, at its
    prompt ancestors (whose deltas hold the earlier positions): usually one row."""
    current = lookup(base_id)
    top = len(messages)
    while current is not None:
        k, n = current.messages_prefix_len, current.num_messages
        # Positions k+1..min(n, top) are held by this call; chain equality is monotone in j.
        for j in range(min(n, top), k, -1):
            if current.chain_at(j) == messages.chain[j]:
                return j
        top = min(top, k)
        if top == 0 or current.prompt_parent_call_id is None:
            return 0
        current = lookup(current.prompt_parent_call_id)
    return 0


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


#: What a key absent from older metadata means (so a migrated record's text equals a new one's).
_META_DEFAULTS: dict[str, Any] = {"api": "chat_completions"}


def _meta_text(meta: Mapping[str, Any]) -> str:
    return canonical_json({key: meta.get(key, _META_DEFAULTS.get(key)) for key in _META_KEYS})


def _tools_ref(tools: Any, blobs: dict[str, str]) -> str | None:
    if tools is None:
        return None
    text = canonical_json(tools)
    sha = json_sha256(text)
    blobs[sha] = text
    return sha


def _encoded_tools_ref(request: RequestEncoding, blobs: dict[str, str]) -> str | None:
    if request.tools_text is None or request.tools_sha256 is None:
        return None
    blobs[request.tools_sha256] = request.tools_text
    return request.tools_sha256


def _received_refs(
    received: Mapping[str, Any] | None, blobs: dict[str, str]
) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
    """The received body's small values inline, and its large ones (a system prompt, a tools
    list: they repeat on every call of a session) content-addressed: ``{key: sha256}``."""
    if received is None:
        return None, None
    inline: dict[str, Any] = {}
    refs: dict[str, str] = {}
    for key, value in received.items():
        text = canonical_json(value)
        if len(text) >= REF_MIN_BYTES:
            sha = json_sha256(text)
            blobs[sha] = text
            refs[key] = sha
        else:
            inline[key] = value
    return inline, refs or None


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


def _delta_items(
    messages: Sequence[Any], digests: MessageDigests, start: int, blobs: dict[str, str]
) -> str:
    """``messages[start:]`` as the stored JSON array: ``[message]`` or a hex content address."""
    parts: list[str] = []
    for i in range(start, len(messages)):
        text = digests.texts[i]
        msg = messages[i]
        if len(text) >= REF_MIN_BYTES and isinstance(msg, dict) and msg.get("role") in REF_ROLES:
            sha = digests.digests[i].hex()
            blobs[sha] = text
            parts.append(f'"{sha}"')
        else:
            parts.append(f"[{text}]")
    return "[" + ",".join(parts) + "]"


def encode_record(
    record: CallRecord,
    *,
    prompt_parent: PromptParent | None = None,
    messages_prefix_len: int = 0,
    request: RequestEncoding | None = None,
) -> EncodedRecord:
    """Serialise a record in the current schema version.

    ``prompt_parent``: the stored call whose prompt + generation the record's prompt begins
    with (chosen by the store, see ``prefixes``); only the prompt ids after it are kept. The
    caller vouches for the prefix; ``tokens_sha256`` and the lengths let a reader check it.
    ``messages_prefix_len``: how many leading request messages equal the prompt parent's
    (``common_messages_prefix``); only the rest are kept. ``request``: the record's
    ``RequestEncoding`` when the caller computed it ahead (else it is computed here).
    Raises ValueError when the arrays have the wrong rank, the prefix is longer than the
    prompt, the messages prefix is longer than the messages or has no prompt parent, or
    ``request`` does not belong to the record.
    """
    if request is None:
        request = RequestEncoding.of(record.request_messages, record.request_tools)
    elif not request.belongs_to(record):
        raise ValueError("request encoding does not belong to the record's messages and tools")
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
    blobs: dict[str, str] = {}
    meta = {
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
    }
    meta["request_received"], meta["request_received_blobs"] = _received_refs(
        record.request_received, blobs
    )
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
        meta=_meta_text(meta),
        prompt_token_ids=record.prompt_token_ids[prefix_len:].astype("<u4", copy=False).tobytes(),
        generation_token_ids=record.generation_token_ids.astype("<u4", copy=False).tobytes(),
        generation_log_probs=record.generation_log_probs.astype("<f4", copy=False).tobytes(),
        routed_experts=experts_bytes,
        prompt_parent_call_id=prompt_parent.call_id if prompt_parent is not None else None,
        prompt_prefix_len=prefix_len,
        num_prompt_tokens=record.num_prompt_tokens,
        num_generation_tokens=record.num_generation_tokens,
        tokens_sha256=token_digest(record.prompt_token_ids, record.generation_token_ids),
        messages_delta=_delta_items(messages, digests, messages_prefix_len, blobs),
        messages_prefix_len=messages_prefix_len,
        num_messages=len(messages),
        messages_sha256=digests.chain[-1],
        messages_chain=b"".join(digests.chain[messages_prefix_len + 1 :]),
        json_blobs=blobs,
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


def _v2_to_v3(encoded: EncodedRecord) -> EncodedRecord:
    """v2 kept the whole messages and tools in the metadata: the messages stay whole (k = 0),
    the tools (and large system messages) become content-addressed."""
    old = json.loads(encoded.meta)
    messages = old.get("request_messages") or []
    blobs: dict[str, str] = {}
    old["request_tools_sha256"] = _tools_ref(old.get("request_tools"), blobs)
    digests = MessageDigests.of(messages)
    return dataclasses.replace(
        encoded,
        schema_version=3,
        meta=_meta_text(old),
        messages_delta=_delta_items(messages, digests, 0, blobs),
        messages_prefix_len=0,
        num_messages=len(messages),
        messages_sha256=digests.chain[-1],
        messages_chain=b"".join(digests.chain[1:]),
        json_blobs=blobs,
    )


#: One step per version: ``MIGRATIONS[v]`` turns a version-v record into version v + 1.
MIGRATIONS: dict[int, Callable[[EncodedRecord], EncodedRecord]] = {1: _v1_to_v2, 2: _v2_to_v3}


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


def rebase_messages(
    encoded: EncodedRecord, messages: Sequence[Any], base_messages: Sequence[Any]
) -> EncodedRecord:
    """Re-split a current-version record whose full messages are ``messages`` against its
    prompt parent's full ``base_messages`` (a store migrating whole v2 messages to deltas).
    A record without a prompt parent is returned as it is."""
    if encoded.prompt_parent_call_id is None:
        return encoded
    digests = MessageDigests.of(messages)
    if digests.chain[-1] != encoded.messages_sha256:
        raise ValueError(f"record {encoded.call_id}: messages differ from the stored ones")
    base = MessageDigests.of(base_messages)
    k = 0
    for k in range(min(len(digests), len(base)), -1, -1):
        if digests.chain[k] == base.chain[k]:
            break
    blobs: dict[str, str] = {}
    return dataclasses.replace(
        encoded,
        messages_delta=_delta_items(messages, digests, k, blobs),
        messages_prefix_len=k,
        messages_chain=b"".join(digests.chain[k + 1 :]),
        json_blobs=blobs | _tools_blob(encoded),
    )


def _tools_blob(encoded: EncodedRecord) -> dict[str, str]:
    sha = json.loads(encoded.meta).get("request_tools_sha256")
    return {sha: encoded.json_blobs[sha]} if sha is not None else {}


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
    if len(encoded.messages_chain) != _DIGEST_LEN * (encoded.num_messages - k):
        raise CorruptRecord(f"record {encoded.call_id}: messages_chain length differs")
    return out


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
    messages = _decode_messages(encoded, messages_prefix, parsed_json)
    tools_sha = meta.get("request_tools_sha256")
    tools = None if tools_sha is None else _blob_value(encoded, tools_sha, parsed_json)
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
        api=meta.get("api") or "chat_completions",
        request_received=_decode_received(encoded, meta, parsed_json),
        sampling=meta.get("sampling"),
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
