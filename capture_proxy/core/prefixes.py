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

import hashlib
from collections.abc import Iterable
from typing import NamedTuple

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


def _u4_view(tokens: np.ndarray) -> memoryview:
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
    data = _u4_view(prompt)
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
    h.update(_u4_view(generation))
    return (_deepest(fitting, digests) if fitting else None), h.digest()
