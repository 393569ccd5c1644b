"""The digests of one captured record that verification and indexing both need, made once.

Owns ``RecordDigests``: the SHA-256 block states of the record's prompt
(``prefixes.block_states``) and the canonical form of the turn it offers its children (its
answer, merged after its prefill when it continued one: ``prefill.offered_turn``;
``digests.canonical_turn`` and its ``turn_payload``), each made the first time it is asked
for. Verification asks for them (a candidate's token digest, the child digest) and indexing
asks again (the token key, the answer's digests alone): handed from one to the other, the
prompt is hashed once, not once to verify and once to index, and the answer is canonicalised
once. The store's put takes them too (``token_states``: the block states choose the prompt
parent, the token key is the row's ``tokens_sha256`` and block digest): the prompt is hashed
once per call, not once more on the writer thread. The values are those of
``digests.extends_by_digest``, ``prefixes.token_digests``, ``digests.turn_payload`` and
``digests.turn_digests``: only where they are computed differs.

It keeps the very arrays and answer it was made from, and answers for a record only when that
record carries the same objects (``describes``, ``same_tokens``: by identity, never by value,
which would cost what it saves); the records of one call (``CallRecord.replace``) share them.
Like a record's, its arrays are read-only. What it fills in is the same whoever fills it
first (the proxy's thread or the store's writer, one at a time: the put is awaited between
verification and indexing). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from capture_proxy.core.linking.digests import (
    canonical_digests,
    canonical_json,
    canonical_turn,
    extends_by_digest,
)
from capture_proxy.core.linking.prefill import continued_turn, record_prefill
from capture_proxy.core.prefixes import PREFIX_BLOCK, block_states, token_digests, u4_view
from capture_proxy.core.records import CallRecord


class RecordDigests:
    """The prompt's block states and the offered turn's canonical form of one record, made
    lazily. ``prefill``: the prefill the call continued, when the record does not say so yet
    (verification's, before ``linking`` is set); else the record's own (``record_prefill``).
    ``turn``: the turn it offers (its answer, merged after its prefill:
    ``prefill.continued_turn``; None: no answer)."""

    __slots__ = (
        "prompt",
        "generation",
        "response",
        "turn",
        "_states",
        "_seed",
        "_key",
        "_canonical",
        "_payload",
    )

    def __init__(self, record: CallRecord, prefill: Mapping[str, Any] | None = None) -> None:
        self.prompt = record.prompt_token_ids
        self.generation = record.generation_token_ids
        self.response = record.response_message
        if prefill is None:
            prefill = record_prefill(record)
        turn: Mapping[str, Any] | None = self.response
        if turn is not None and prefill is not None:
            turn = continued_turn(prefill, turn)
        self.turn = turn
        self._states: list[Any] | None = None
        self._seed: list[Any] = []
        self._key: tuple[bytes, bytes] | None = None
        self._canonical: dict[str, Any] | None = None
        self._payload: str | None = None

    def describes(self, record: CallRecord) -> bool:
        """True when ``record`` carries the arrays and the answer these digests are of."""
        return self.same_tokens(record) and record.response_message is self.response

    def same_tokens(self, record: CallRecord) -> bool:
        """True when ``record`` carries the very token arrays these digests are of (what
        ``block_states`` and ``token_key`` depend on)."""
        prompt, generation = record.prompt_token_ids, record.generation_token_ids
        return prompt is self.prompt and generation is self.generation

    def block_states(self) -> list[Any]:
        """``prefixes.block_states(prompt)`` (SHA-256 states; never updated: copy one to go
        on)."""
        if self._states is None:
            self._states = block_states(self.prompt, self._seed)
            self._seed = []
        return self._states

    @property
    def num_states(self) -> int:
        """The block states made (0: not yet)."""
        return len(self._states) if self._states is not None else 0

    def seed(self, earlier: RecordDigests) -> int:
        """Take ``earlier``'s block states (a parent's, kept in memory) for the whole blocks
        its prompt shares with this one, id for id (compared: the states are then this
        prompt's own), so that only the blocks after them are hashed: an agent's next prompt
        begins with its parent's. Nothing when the states are made already, or ``earlier``'s
        are not. Returns the blocks taken."""
        states = earlier._states
        if self._states is not None or not states:
            return 0
        mine, theirs = self.prompt, earlier.prompt
        whole = min(mine.shape[0], theirs.shape[0], (len(states) - 1) * PREFIX_BLOCK)
        differ = np.flatnonzero(mine[:whole] != theirs[:whole])
        shared = (int(differ[0]) if differ.size else whole) // PREFIX_BLOCK
        self._seed = states[: shared + 1] if shared else []
        return shared

    def extends(self, num_tokens: int, tokens_sha256: bytes) -> bool:
        """``digests.extends_by_digest(prompt, num_tokens, tokens_sha256)``: the prompt begins
        with the ``num_tokens`` ids whose ``<u4`` bytes hash to ``tokens_sha256``; from the
        block states, so only the ids after the last whole block below ``num_tokens`` are
        hashed here."""
        prompt = self.prompt
        if num_tokens < 0:  # (never a length; as extends_by_digest takes it)
            return extends_by_digest(prompt, num_tokens, tokens_sha256)
        if prompt.shape[0] < num_tokens:
            return False
        j = num_tokens // PREFIX_BLOCK
        h = self.block_states()[j].copy()
        h.update(u4_view(prompt[j * PREFIX_BLOCK : num_tokens]))
        return h.digest() == tokens_sha256

    def token_key(self) -> tuple[bytes, bytes]:
        """``prefixes.token_digests(prompt, generation)``: ``(tokens_sha256, block_sha256)``,
        32 bytes each."""
        if self._key is None:
            self._key = token_digests(self.prompt, self.generation, self.block_states())
        return self._key

    def _canonical_answer(self) -> tuple[dict[str, Any], str]:
        if self._canonical is None or self._payload is None:
            assert self.turn is not None
            canonical = canonical_turn(self.turn)
            self._payload = canonical_json(canonical)
            self._canonical = canonical
        return self._canonical, self._payload

    def answer_payload(self) -> str:
        """``digests.turn_payload`` of the offered turn (the answer must not be None)."""
        return self._canonical_answer()[1]

    def answer_digests(self) -> tuple[str, str]:
        """``digests.turn_digests`` of the offered turn (the answer must not be None)."""
        return canonical_digests(*self._canonical_answer())


def token_states(
    record: CallRecord, digests: RecordDigests | None = None
) -> tuple[list[Any], bytes, bytes]:
    """What a store's put hashes of ``record``'s tokens: ``prefixes.block_states`` of its
    prompt, and its ``prefixes.token_digests`` ``(tokens_sha256, block_sha256)``. From
    ``digests`` (the proxy's, made for verification and indexing) when they are of the very
    arrays ``record`` carries (``same_tokens``), else computed here."""
    if digests is not None and digests.same_tokens(record):
        return digests.block_states(), *digests.token_key()
    states = block_states(record.prompt_token_ids)
    return states, *token_digests(record.prompt_token_ids, record.generation_token_ids, states)
