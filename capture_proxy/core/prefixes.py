"""Prompt parents for storage: which stored call a new record's prompt extends.

Owns the choice a store makes at write time so that a child stores only its new prompt tokens
(see ``codec``, schema v2). The rule is the chain rule of ``chains.find_parents``: among the
rollout's complete calls with a non-empty generation whose prompt + generation ids are a prefix
of the new prompt, the deepest wins; ties go to the earliest ``created_at``, then the smallest
call id. The difference is the means: a store compares SHA-256 digests of the candidates' token
bytes (kept per row) with digests of the new prompt's prefixes, computed in one pass over the
prompt, so choosing costs O(prompt length + candidates) and reads no other call's arrays.

Must not: do I/O. The store selects the candidate rows; this module only decides.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from capture_proxy.core.codec import PromptParent


class StoredPrefix(NamedTuple):
    """What a store keeps per call to be chosen as a prompt parent without reading arrays:
    ``num_tokens`` = prompt + generation length, ``tokens_sha256`` = ``codec.token_digest``.
    A tuple, so that a store builds one per candidate row cheaply (``StoredPrefix._make``: a
    root call of a long rollout may have thousands)."""

    call_id: str
    created_at: float
    num_tokens: int
    tokens_sha256: bytes


def u4_view(tokens: np.ndarray) -> memoryview:
    """The ``<u4`` bytes of ``tokens`` as a flat view (no copy for a contiguous uint32 array):
    hashed in place, where ``tobytes`` would copy."""
    return np.ascontiguousarray(tokens.astype("<u4", copy=False)).data.cast("B")


def _token_hash(
    prompt: np.ndarray, lengths: Iterable[int]
) -> tuple[dict[int, bytes], hashlib._Hash, memoryview, int]:
    """The SHA-256 of ``prompt[:n]`` (as ``<u4`` bytes) for each ``n`` in ``lengths`` that fits,
    in one pass; then the hash state at the last of them, the prompt's bytes and how many of
    them are hashed (so a caller may go on to the whole prompt without hashing its head
    again)."""
    data = u4_view(prompt)
    h = hashlib.sha256()
    out: dict[int, bytes] = {}
    done = 0
    for n in sorted(set(lengths)):
        if n > prompt.shape[0] or n < 0:
            continue
        h.update(data[done : 4 * n])
        done = 4 * n
        out[n] = h.copy().digest()
    return out, h, data, done


def prefix_digests(prompt: np.ndarray, lengths: Iterable[int]) -> dict[int, bytes]:
    """SHA-256 of ``prompt[:n]`` (as ``<u4`` bytes) for each ``n`` in ``lengths`` that fits,
    in one pass over the prompt."""
    return _token_hash(prompt, lengths)[0]


def _fitting(
    prompt: np.ndarray, candidates: Iterable[StoredPrefix], exclude: str | None
) -> list[StoredPrefix]:
    return [c for c in candidates if c.call_id != exclude and 0 < c.num_tokens <= prompt.shape[0]]


def _deepest(fitting: list[StoredPrefix], digests: dict[int, bytes]) -> PromptParent | None:
    """The deepest candidate whose digest matches (ties: earliest, then smallest call id)."""
    matches = [c for c in fitting if digests[c.num_tokens] == c.tokens_sha256]
    if not matches:
        return None
    best = min(matches, key=lambda c: (-c.num_tokens, c.created_at, c.call_id))
    return PromptParent(call_id=best.call_id, prefix_len=best.num_tokens)


def choose_prompt_parent(
    prompt: np.ndarray, candidates: Iterable[StoredPrefix], *, exclude: str | None = None
) -> PromptParent | None:
    """The prompt parent of a record with ``prompt`` among ``candidates`` (the rollout's complete
    calls with a non-empty generation), or None. ``exclude``: the record's own call id."""
    fitting = _fitting(prompt, candidates, exclude)
    if not fitting:
        return None
    return _deepest(fitting, prefix_digests(prompt, (c.num_tokens for c in fitting)))


def choose_with_digest(
    prompt: np.ndarray,
    generation: np.ndarray,
    candidates: Iterable[StoredPrefix],
    *,
    exclude: str | None = None,
) -> tuple[PromptParent | None, bytes]:
    """``choose_prompt_parent``, and the record's own ``stored_form.token_digest`` (of
    ``prompt`` + ``generation``) from the same pass over the prompt: a store that chooses a
    parent hashes the prompt once, not once to choose and once to encode."""
    fitting = _fitting(prompt, candidates, exclude)
    digests, h, data, done = _token_hash(prompt, (c.num_tokens for c in fitting))
    h.update(data[done:])
    h.update(u4_view(generation))
    return (_deepest(fitting, digests) if fitting else None), h.digest()

    digests = prefix_digests(prompt, (c.num_tokens for c in fitting))
    matches = [c for c in fitting if digests[c.num_tokens] == c.tokens_sha256]
    if not matches:
        return None
    best = min(matches, key=lambda c: (-c.num_tokens, c.created_at, c.call_id))
    return PromptParent(call_id=best.call_id, prefix_len=best.num_tokens)


#: Tokens per block of ``PrefixIndex``: a call is filed under the digest of its first
#: ``(num_tokens // PREFIX_BLOCK) * PREFIX_BLOCK`` tokens.
PREFIX_BLOCK = 256
_EMPTY_SHA256 = hashlib.sha256().digest()


def block_states(prompt: np.ndarray, known: Sequence[Any] = ()) -> list[Any]:
    """The SHA-256 states after ``prompt``'s first j whole blocks of ``PREFIX_BLOCK`` ids
    (``<u4`` bytes), j = 0 .. len // PREFIX_BLOCK, in one pass: what ``block_digests``,
    ``token_digests`` and ``PrefixIndex.deepest_call`` go on from, so that a put hashes its
    prompt once. Each block is hashed in place (a slice of the prompt's ``u4_view``), not
    copied out of the array first. ``known``: the first states, known already (of another
    prompt that begins with the same ids: ``RecordDigests.seed``; at most all of them): taken
    as they are (never updated), the blocks after them hashed."""
    data = u4_view(prompt)
    whole = prompt.shape[0] // PREFIX_BLOCK
    if known and len(known) <= whole + 1:
        states = list(known)
        h = states[-1].copy()
    else:
        h = hashlib.sha256()
        states = [h.copy()]
    step = 4 * PREFIX_BLOCK  # (bytes)
    for start in range((len(states) - 1) * step, whole * step, step):
        h.update(data[start : start + step])
        states.append(h.copy())
    return states


def block_digests(prompt: np.ndarray, states: list[Any] | None = None) -> list[bytes]:
    """SHA-256 of ``prompt[:j * PREFIX_BLOCK]`` for j = 1 .. len // block: the block digests
    under which the calls a prompt may extend are filed (a call of ``n >= PREFIX_BLOCK`` ids
    under ``token_digests``' block digest). ``states``: ``block_states(prompt)``, if known."""
    return [s.digest() for s in (states or block_states(prompt))[1:]]


def token_digests(
    prompt: np.ndarray, generation: np.ndarray, states: list[Any] | None = None
) -> tuple[bytes, bytes]:
    """``(tokens_sha256, block_sha256)`` of prompt + generation: the SHA-256 of all their
    ``<u4`` bytes (``stored_form.token_digest``) and of their first
    ``(n // PREFIX_BLOCK) * PREFIX_BLOCK`` ids (what ``PrefixIndex`` files the call under).
    ``states``: ``block_states(prompt)``, if known (then only the prompt's last partial block
    and the generation are hashed)."""
    states = states or block_states(prompt)
    start = (len(states) - 1) * PREFIX_BLOCK
    num_prompt = prompt.shape[0]
    cut = ((num_prompt + generation.shape[0]) // PREFIX_BLOCK) * PREFIX_BLOCK
    # prompt[start:] + generation hashed in place, in pieces split at ``cut`` (no copy made)
    head, gen = u4_view(prompt[start:]), u4_view(generation)
    h = states[-1].copy()
    if cut <= num_prompt:
        h.update(head[: 4 * (cut - start)])
        block = h.digest()
        h.update(head[4 * (cut - start) :])
        h.update(gen)
    else:
        h.update(head)
        h.update(gen[: 4 * (cut - num_prompt)])
        block = h.digest()
        h.update(gen[4 * (cut - num_prompt) :])
    return h.digest(), block


@dataclass
class _Node:
    """The calls filed under one (model, block count, block digest): by length, by digest."""

    lengths: list[int] = field(default_factory=list)  # sorted, distinct
    calls: dict[int, dict[bytes, dict[str, StoredPrefix]]] = field(default_factory=dict)


class PrefixIndex:
    """Complete calls by the digests of their token prefixes, to find the deepest one whose
    prompt + generation begins a prompt (``choose_prompt_parent``'s rule, same answer) without
    looking at the others: the prompt's block digests (one pass) name the few calls that
    share its blocks, and only their lengths' prefix digests are computed. O(prompt length +
    lengths in the visited blocks, at most ``PREFIX_BLOCK`` each), whatever the number of
    calls. Pure; not thread-safe."""

    def __init__(self) -> None:
        self._nodes: dict[tuple[str | None, int, bytes], _Node] = {}
        self._where: dict[str, tuple[tuple[str | None, int, bytes], int, bytes]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def add(self, model: str | None, call: StoredPrefix, block_sha256: bytes | None) -> None:
        """File ``call`` (again: its old filing goes). ``block_sha256``: the digest of its
        first ``(num_tokens // PREFIX_BLOCK) * PREFIX_BLOCK`` ids (``token_digests``); None is
        accepted below one block (the empty prefix's digest), else ValueError."""
        self.remove(call.call_id)
        blocks = call.num_tokens // PREFIX_BLOCK
        if block_sha256 is None:
            if blocks:
                raise ValueError(f"{call.call_id}: block_sha256 is required past one block")
            block_sha256 = _EMPTY_SHA256
        key = (model, blocks, block_sha256)
        node = self._nodes.setdefault(key, _Node())
        by_length = node.calls.get(call.num_tokens)
        if by_length is None:
            by_length = node.calls[call.num_tokens] = {}
            bisect.insort(node.lengths, call.num_tokens)
        by_length.setdefault(call.tokens_sha256, {})[call.call_id] = call
        self._where[call.call_id] = (key, call.num_tokens, call.tokens_sha256)

    def remove(self, call_id: str) -> None:
        where = self._where.pop(call_id, None)
        if where is None:
            return
        key, length, sha = where
        node = self._nodes[key]
        by_length = node.calls[length]
        del by_length[sha][call_id]
        if not by_length[sha]:
            del by_length[sha]
        if not by_length:
            del node.calls[length]
            node.lengths.remove(length)
        if not node.calls:
            del self._nodes[key]

    def deepest(
        self, prompt: np.ndarray, *, model: str | None, exclude: str | None = None
    ) -> PromptParent | None:
        """The deepest filed call of ``model`` (ties: earliest ``created_at``, then smallest
        call id) whose prompt + generation ids begin ``prompt``, other than ``exclude``."""
        call = self.deepest_call(prompt, model=model, exclude=exclude)
        return None if call is None else PromptParent(call.call_id, call.num_tokens)

    def deepest_call(
        self,
        prompt: np.ndarray,
        *,
        model: str | None,
        exclude: str | None = None,
        states: list[Any] | None = None,
    ) -> StoredPrefix | None:
        """``deepest``, as the call was filed. ``states``: ``block_states(prompt)``, if
        known."""
        data = prompt.astype("<u4", copy=False)
        n = data.shape[0]
        states = states or block_states(prompt)
        for j in range(len(states) - 1, -1, -1):
            node = self._nodes.get((model, j, states[j].digest()))
            if node is None:
                continue
            fitting = node.lengths[: bisect.bisect_right(node.lengths, n)]
            digests = _digests_from(states[j].copy(), data, j * PREFIX_BLOCK, fitting)
            for length in reversed(fitting):
                calls = node.calls[length].get(digests[length], {})
                found = [c for c in calls.values() if c.call_id != exclude]
                if found:
                    return min(found, key=lambda c: (c.created_at, c.call_id))
        return None


def _digests_from(h: Any, data: np.ndarray, start: int, lengths: list[int]) -> dict[int, bytes]:
    """SHA-256 of ``data[:n]`` for each ``n`` in sorted ``lengths``, from ``h`` (the state
    after ``data[:start]``)."""
    out: dict[int, bytes] = {}
    done = start
    for length in lengths:
        h.update(data[done:length].tobytes())
        done = length
        out[length] = h.copy().digest()
    return out
