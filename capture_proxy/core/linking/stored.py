"""What the link index keeps of a stored call, read from its record or from its stored row.

Owns ``StoredCall``: the facts ``LinkIndex.add`` files a stored call under (child and request
digests, its answer, status, model, verified parent, retry target, routed-expert rows, token
key, the harness session its request named: in its body or its kept session headers),
``of_record`` (from a ``CallRecord``: the index's own calls, and rollouts read whole) and
``of_row`` (from a v4 row's columns and metadata, without decoding its arrays or messages: a
worker of ``serve --workers`` catching up with the calls the others stored costs a few
columns per call, however deep its chain). Both
give the same facts for the same call; a row that cannot tell one of them (an older record, a
row without its block digest) gives None and the caller reads the record whole. One exception:
a row whose request kept the field naming the session apart (a blob: at least 512 bytes, which
no harness sends) tells no session, rather than make every catch-up read the rollout whole;
the session only breaks ties between token-identical candidates. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from capture_proxy.core.linking.digests import child_digest
from capture_proxy.core.linking.prefill import continued_turn, history_before_turn, offered_turn
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.records import CallRecord, CallStatus
from capture_proxy.core.routed_experts import rows_end as record_rows_end
from capture_proxy.core.sessions import SESSION_FIELDS, session_key
from capture_proxy.core.stored_form import DIGEST_LEN

#: The top-level request fields a harness names its session in (a row that stored one of
#: them apart, as a blob, does not tell the session from its metadata).
_SESSION_TOP_FIELDS = frozenset(f.path[0] for f in SESSION_FIELDS if f.path)

#: ``of_record``'s ``session`` when the caller does not know it: read from the record.
FROM_RECORD: Final = "from_record"
#: A call's harness session (``core.sessions.session_key``; None: none), or ``FROM_RECORD``.
SessionOrFromRecord = tuple[str, str] | None | Literal["from_record"]

#: The record schema whose metadata ``of_row`` reads.
ROW_SCHEMA_VERSION = 4


@dataclass(frozen=True, slots=True)
class StoredCall:
    """A stored call as the link index files it (``LinkIndex.add``'s arguments)."""

    call_id: str
    created_at: float
    status: str
    model: str | None
    child_digest: str | None
    request_digest: str | None
    harness_note: bool
    rows_end: int | None
    #: the token key of a complete call with output (``prefixes.token_digests``), else None
    num_tokens: int | None
    tokens_sha256: bytes | None
    block_sha256: bytes | None
    #: the turn it offers its children: its answer, merged after its prefill when it
    #: continued one (``prefill.offered_turn``); None for a failed call
    response: Mapping[str, Any] | None
    parent_call_id: str | None
    retry_of: str | None
    #: the harness session its request named (``core.sessions``), if any
    session: tuple[str, str] | None = None
    #: its request's own history key (``capture.PreparedRequest.history_keys``), if known
    history: bytes | None = None


def _has_token_key(status: str, num_generation_tokens: int) -> bool:
    return status == CallStatus.COMPLETE.value and num_generation_tokens > 0


def of_record(
    record: CallRecord,
    digests: RecordDigests | None = None,
    session: SessionOrFromRecord = FROM_RECORD,
) -> StoredCall:
    """The facts of a stored record: the child digest its record keeps (else derived from its
    request and the turn it offers; a failed call has none: it is indexed for its request
    only). ``digests``: the record's ``RecordDigests``, if made already (verification's);
    ``session``: the harness session its request names (``core.sessions.session_key`` of its
    ``request_received`` and ``session_headers``), when the caller read it already (the
    call's own flow, at resolution), else ``FROM_RECORD``."""
    linking = record.linking or {}
    response = offered_turn(record)
    child = linking.get("child_digest")
    if child is None and response is not None:
        child = child_digest(history_before_turn(record), response)
    num_tokens = tokens_sha256 = block_sha256 = None
    if _has_token_key(record.status.value, record.num_generation_tokens):
        if digests is None or not digests.describes(record):
            digests = RecordDigests(record)
        tokens_sha256, block_sha256 = digests.token_key()
        num_tokens = record.num_prompt_tokens + record.num_generation_tokens
    return StoredCall(
        record.call_id,
        record.created_at,
        record.status.value,
        record.model,
        child if response is not None else None,
        linking.get("request_digest"),
        bool(linking.get("harness_note")),
        record_rows_end(record),
        num_tokens,
        tokens_sha256,
        block_sha256,
        response,
        record.parent_call_id,
        record.retry_of,
        (
            session_key(record.request_received, record.session_headers)
            if session == FROM_RECORD
            else session
        ),
    )


def of_row(
    call_id: str,
    created_at: float,
    status: str,
    schema_version: int,
    meta_text: str,
    tokens_sha256: bytes | None,
    block_sha256: bytes | None,
    retry_of: str | None,
    messages_prefix_len: int | None = None,
    num_messages: int | None = None,
    messages_chain: bytes | None = None,
) -> StoredCall | None:
    """The facts of a stored row (``calls``' columns of those names and ``meta``), or None
    when the row cannot tell them all (not schema v4; an answered call whose record keeps no
    child digest; a complete call with output stored without its block digest; a call that
    continued a prefill stored without ``linking.prefill_message``: the turn it offers merges
    its answer with that message). Its session is None where the field naming it was stored
    apart (see the module docstring). Its history key when the row's message chain holds it
    (``_history_of_row``)."""
    if schema_version != ROW_SCHEMA_VERSION:
        return None
    meta = json.loads(meta_text)
    linking = meta.get("linking") or {}
    response = meta.get("response_message") if status != CallStatus.FAILED.value else None
    if linking.get("prefill"):
        prefill = linking.get("prefill_message")
        if prefill is None:
            return None
        if response is not None:
            response = continued_turn(prefill, response)
    child = linking.get("child_digest")
    if response is not None and child is None:
        return None
    num_tokens = None
    key = _has_token_key(status, int(meta["num_generation_tokens"]))
    if key:
        if not tokens_sha256 or block_sha256 is None:
            return None
        num_tokens = int(meta["num_prompt_tokens"]) + int(meta["num_generation_tokens"])
    received = meta.get("request_received")
    if _SESSION_TOP_FIELDS & (meta.get("request_received_blobs") or {}).keys():
        received = None
    experts = meta.get("routed_experts")
    return StoredCall(
        call_id,
        float(created_at),
        status,
        meta.get("model"),
        child if response is not None else None,
        linking.get("request_digest"),
        bool(linking.get("harness_note")),
        None if experts is None else int(experts["start"]) + int(experts["shape"][0]),
        num_tokens,
        bytes(tokens_sha256) if key and tokens_sha256 else None,
        bytes(block_sha256) if key and block_sha256 is not None else None,
        response,
        meta.get("parent_call_id"),
        retry_of,
        session_key(received, meta.get("session_headers")),
        _history_of_row(linking, messages_prefix_len, num_messages, messages_chain),
    )


def _history_of_row(
    linking: Mapping[str, Any],
    prefix_len: int | None,
    num_messages: int | None,
    chain: bytes | None,
) -> bytes | None:
    """A stored call's own history key (``capture.PreparedRequest.history_keys``): the chain
    digest of its request's messages less a rewritten note or a prefill (the last one), read
    from the row's ``messages_chain`` (the chain digests after each message past its prompt
    parent's ``messages_prefix_len``); None when that position is the prompt parent's."""
    if prefix_len is None or num_messages is None or not chain:
        return None
    position = num_messages - (1 if linking.get("harness_note") or linking.get("prefill") else 0)
    at = (position - prefix_len - 1) * DIGEST_LEN
    if position <= prefix_len or at + DIGEST_LEN > len(chain):
        return None
    return bytes(chain[at : at + DIGEST_LEN])
