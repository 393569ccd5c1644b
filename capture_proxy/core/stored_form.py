"""The stored form of a call record, below the codec: ``EncodedRecord`` (the columns a store
keeps), the canonical JSON text that digests and content addresses use, the messages' chain
digests, what a store keeps per call to split a child's messages without reading any
(``StoredMessages``, ``common_messages_prefix``), and the pieces of a record's metadata that
encoding and migration write alike (``meta_text``, ``tools_ref``, ``delta_items``,
``received_refs``); ``StoredMeta`` is the metadata's shape.

Pure: no I/O. Owns no decision about which stored call is a parent (``prefixes``, the stores)
nor the mapping from a ``CallRecord`` (``codec``) nor the steps between versions
(``record_migrations``); both build on this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
import orjson

#: Delta messages with one of these roles and a canonical JSON of at least ``REF_MIN_BYTES``
#: bytes are content-addressed (a system prompt repeats at every chain root).
REF_ROLES = frozenset({"system", "developer"})
REF_MIN_BYTES = 512

DIGEST_LEN = 32
#: ``MessageDigests.chain[0]``: the chain digest of no message
CHAIN_START = hashlib.sha256(b"").digest()

# Metadata keys of a v4 record, in the order they are written (``same_content`` compares the
# text, so encoding and migration must agree on it).
META_KEYS = (
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
    "prompt_mode",
    "weight_versions",
    "weight_version_source",
    "images",
)

#: Metadata keys written after ``META_KEYS`` only when they hold a value: additive fields of
#: the current version, so that a record without one (every record stored before it) keeps
#: the very text it had, and older v4 readers ignore it.
META_OPTIONAL_KEYS = ("session_headers",)


class RoutedExpertsMeta(TypedDict):
    """``meta["routed_experts"]``: the stored array's dtype name (``uint8``, ``uint16``,
    ``int32``), its shape ``[num_rows, num_layers, top_k]`` and the first row's position in
    prompt + generation (``CallRecord.routed_experts_start``)."""

    dtype: str
    shape: list[int]
    start: int


class StoredMeta(TypedDict, total=False):
    """A v4 record's metadata (``EncodedRecord.meta``, in ``META_KEYS`` order, then the
    ``META_OPTIONAL_KEYS`` that hold a value: ``session_headers``). JSON values the
    engine or the harness sent (the response message, usage, linking, sampling, the received
    body) are kept as given; ``diagnostics`` in ``Diagnostic.to_json`` form. Older records
    also hold ``request_messages`` and ``request_tools`` whole (v1, v2)."""

    model: str | None
    latency_ms: float | None
    stream: bool
    upstream_path: str
    request_tools_sha256: str | None
    response_message: Any
    finish_reason: str | None
    usage: Any
    http_status: int | None
    parent_call_id: str | None
    linking: Any
    retry_of: str | None
    diagnostics: list[dict[str, Any]]
    num_prompt_tokens: int
    num_generation_tokens: int
    routed_experts: RoutedExpertsMeta | None
    api: str
    request_received: dict[str, Any] | None
    request_received_blobs: dict[str, str] | None
    sampling: Any
    prompt_mode: str | None
    weight_versions: list[dict[str, Any]] | None
    weight_version_source: str | None
    images: list[dict[str, Any]] | None
    session_headers: dict[str, str]
    request_messages: list[Any]
    request_tools: Any


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


_COLUMN_VALUES = operator.attrgetter(*COLUMNS)


def column_values(encoded: EncodedRecord) -> tuple[Any, ...]:
    """The values of ``COLUMNS`` (no deep copy, unlike ``dataclasses.astuple``)."""
    values: tuple[Any, ...] = _COLUMN_VALUES(encoded)
    return values


#: One encoder for every canonical text (``json.dumps`` with options builds one per call).
_CANONICAL_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_CONTAINERS = (dict, list, tuple)

#: Floats whose text the stdlib writes without an exponent (``repr``: 0, and magnitudes in
#: [1e-4, 1e16)), and the ones orjson is checked against at import for them (the boundaries
#: and digits that a shortest round-trip writer could spell otherwise).
_PLAIN_FLOAT_MIN, _PLAIN_FLOAT_MAX = 1e-4, 1e16
_FLOAT_PROBES = (
    0.0,
    -0.0,
    1.0,
    -2.5,
    0.1,
    1 / 3,
    1e-4,
    0.00012345,
    0.000999,
    123.456,
    1e15,
    123456789012345.6,
    9999999999999998.0,
    2.0**53,
    -(2.0**52) + 0.5,
    1.7976931348623157e15,
    0.30000000000000004,
)


def _orjson_writes_plain_floats_alike() -> bool:
    """True when this orjson writes the probes' floats as the stdlib does (some versions spell
    numbers otherwise; then floats take the stdlib)."""
    try:
        return all(orjson.dumps(v).decode() == _CANONICAL_ENCODER.encode(v) for v in _FLOAT_PROBES)
    except (TypeError, ValueError):  # pragma: no cover - an orjson that refuses floats
        return False


_PLAIN_FLOATS_ALIKE = _orjson_writes_plain_floats_alike()


def _plain_float(value: float) -> bool:
    """A float both encoders write alike: no exponent (NaN and infinities are not)."""
    return _PLAIN_FLOATS_ALIKE and (
        value == 0.0 or _PLAIN_FLOAT_MIN <= abs(value) < _PLAIN_FLOAT_MAX
    )


def _orjson_writes_it_alike(value: Any) -> bool:
    """True when ``value`` holds only dicts, lists, tuples, ``str``, ``int``, ``bool``, None and
    floats without an exponent (those exact types, no subclasses): orjson's text of it is then
    the stdlib's (tested on every code point, and on floats at and beyond the boundaries), or
    orjson refuses it (a key that is not a string, an integer past 64 bits, a lone surrogate)
    and the stdlib writes it. Not other floats: orjson writes ``1e-05`` as ``0.00001`` (some
    versions ``1e16`` for ``1e+16``), and NaN as ``null``. A walk over the nodes, not over the
    strings' characters, which is where the stdlib's time goes."""
    if type(value) not in _CONTAINERS:
        if type(value) is float:
            return _plain_float(value)
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
            elif kind is not float or not _plain_float(child):
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
        chain = [CHAIN_START]
        for d in digests:
            chain.append(chain_step(chain[-1], d))
        return cls(texts, digests, tuple(chain))

    def __len__(self) -> int:
        return len(self.texts)


def chain_step(before: bytes, digest: bytes) -> bytes:
    """``MessageDigests.chain[j]`` from ``chain[j-1]`` (``before``) and the SHA-256 of the
    j-th message's text (``digest``), 32 bytes each."""
    return hashlib.sha256(before + digest).digest()


def token_digest(prompt: np.ndarray, generation: np.ndarray) -> bytes:
    """SHA-256 of the ``<u4`` bytes of ``prompt`` followed by ``generation``."""
    h = hashlib.sha256(prompt.astype("<u4", copy=False).tobytes())
    h.update(generation.astype("<u4", copy=False).tobytes())
    return h.digest()


#: What a key absent from older metadata means (so a migrated record's text equals a new one's).
META_DEFAULTS: dict[str, Any] = {"api": "chat_completions"}


def meta_text(meta: Mapping[str, Any]) -> str:
    """The metadata's canonical text: ``META_KEYS`` in order, a key absent from older
    metadata as ``META_DEFAULTS`` says (so a migrated record's text equals a new one's), then
    the ``META_OPTIONAL_KEYS`` that hold a value."""
    out = {key: meta.get(key, META_DEFAULTS.get(key)) for key in META_KEYS}
    for key in META_OPTIONAL_KEYS:
        if meta.get(key) is not None:
            out[key] = meta[key]
    return canonical_json(out)


def tools_ref(tools: Any, blobs: dict[str, str]) -> str | None:
    """The content address of a tools list (its text added to ``blobs``), None for none."""
    if tools is None:
        return None
    text = canonical_json(tools)
    sha = json_sha256(text)
    blobs[sha] = text
    return sha


def _short_scalar(value: Any) -> bool:
    """True for a value whose canonical text is surely shorter than ``REF_MIN_BYTES``: None, a
    bool, a float, an int below 10**18, a str of fewer than 80 characters (an escape writes a
    character in at most 6)."""
    kind = type(value)
    if kind is str:
        return len(value) < 80
    if kind is int:
        return -(10**18) < value < 10**18
    return value is None or kind is bool or kind is float


def received_refs(
    received: Mapping[str, Any] | None,
    blobs: dict[str, str],
    *,
    known: Sequence[tuple[Any, str | None, str | None]] = (),
) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
    """The received body's small values inline, and its large ones (a system prompt, a tools
    list: they repeat on every call of a session) content-addressed: ``{key: sha256}``, their
    texts added to ``blobs``. ``known``: values whose canonical text and hex address were
    computed already, as ``(value, text, sha256)`` (the request's tools: the chat front keeps
    the body's object, the other fronts their own tools' facts); a received value takes them
    when it is that very object (identity, never equality: ``1 == True``)."""
    if received is None:
        return None, None
    inline: dict[str, Any] = {}
    refs: dict[str, str] = {}
    for key, value in received.items():
        if _short_scalar(value):  # its text is shorter than REF_MIN_BYTES: not written here
            inline[key] = value
            continue
        text, sha = None, None
        for obj, known_text, known_sha in known:
            if value is obj and known_text is not None:
                text, sha = known_text, known_sha
                break
        if text is None:
            text = canonical_json(value)
        if len(text) >= REF_MIN_BYTES:
            sha = sha or json_sha256(text)
            blobs[sha] = text
            refs[key] = sha
        else:
            inline[key] = value
    return inline, refs or None


def delta_items(
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
        i = (j - self.messages_prefix_len - 1) * DIGEST_LEN
        return self.messages_chain[i : i + DIGEST_LEN]


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
