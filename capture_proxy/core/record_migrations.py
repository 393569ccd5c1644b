"""The steps between stored record versions, one per version (``MIGRATIONS``: version v ->
v + 1), ``migrate`` that applies them, and ``rebase_messages`` for a store that re-splits
migrated whole messages against their prompt parents'.

Pure: no I/O; a store reads the old rows and writes back what these return. Must not change a
current record: ``migrate`` of a record at ``SCHEMA_VERSION`` is the record itself.

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
  v1 -> v2 (``migrate_1_to_2``): the prompt stays whole (no prompt parent), the digest and the
  token counts are computed from the stored bytes.
- 3: the request's JSON grows linearly with a chain too. ``request_messages`` are
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
  v2 -> v3 (``migrate_2_to_3``): the messages stay whole (k = 0) and the tools (and large
  system messages) move to ``json_blobs``; a store may rebase the messages afterwards
  (``rebase_messages``).
- 4 (current): the metadata adds ``prompt_mode``, ``weight_versions``,
  ``weight_version_source`` and ``images``. v3 -> v4 (``migrate_3_to_4``): None, unknown.
  A v4 record may also carry ``session_headers`` (the request headers naming the harness's
  session), written only when the request sent one (``META_OPTIONAL_KEYS``): additive, so a
  record without it keeps its stored text, older v4 readers ignore it, and the version is
  unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from capture_proxy.core.records import SCHEMA_VERSION
from capture_proxy.core.stored_form import (
    EncodedRecord,
    MessageDigests,
    UnsupportedSchemaVersion,
    delta_items,
    meta_text,
    token_digest,
    tools_ref,
)


def migrate_1_to_2(encoded: EncodedRecord) -> EncodedRecord:
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


def migrate_2_to_3(encoded: EncodedRecord) -> EncodedRecord:
    """v2 kept the whole messages and tools in the metadata: the messages stay whole (k = 0),
    the tools (and large system messages) become content-addressed."""
    old = json.loads(encoded.meta)
    messages = old.get("request_messages") or []
    blobs: dict[str, str] = {}
    old["request_tools_sha256"] = tools_ref(old.get("request_tools"), blobs)
    digests = MessageDigests.of(messages)
    return dataclasses.replace(
        encoded,
        schema_version=3,
        meta=meta_text(old),
        messages_delta=delta_items(messages, digests, 0, blobs),
        messages_prefix_len=0,
        num_messages=len(messages),
        messages_sha256=digests.chain[-1],
        messages_chain=b"".join(digests.chain[1:]),
        json_blobs=blobs,
    )


def migrate_3_to_4(encoded: EncodedRecord) -> EncodedRecord:
    """v4 added ``prompt_mode``, ``weight_versions``, ``weight_version_source`` and
    ``images`` to the metadata: a v3 record did not know them (None)."""
    old = json.loads(encoded.meta)
    for key in ("prompt_mode", "weight_versions", "weight_version_source", "images"):
        old.setdefault(key, None)
    return dataclasses.replace(encoded, schema_version=4, meta=meta_text(old))


#: One step per version: ``MIGRATIONS[v]`` turns a version-v record into version v + 1.
MIGRATIONS: dict[int, Callable[[EncodedRecord], EncodedRecord]] = {
    1: migrate_1_to_2,
    2: migrate_2_to_3,
    3: migrate_3_to_4,
}


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
        messages_delta=delta_items(messages, digests, k, blobs),
        messages_prefix_len=k,
        messages_chain=b"".join(digests.chain[k + 1 :]),
        json_blobs=blobs | _tools_blob(encoded),
    )


def _tools_blob(encoded: EncodedRecord) -> dict[str, str]:
    sha = json.loads(encoded.meta).get("request_tools_sha256")
    return {sha: encoded.json_blobs[sha]} if sha is not None else {}
