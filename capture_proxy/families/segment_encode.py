"""Encoding a rendered prompt piece by piece between added tokens, the pieces remembered.

Owns ``SegmentEncoder``: the ids a HF ``tokenizers`` tokenizer gives a text (no special tokens
added), from the ids of the text's pieces between added tokens (``<|im_start|>``,
``<|im_end|>``, ``<tool_call>``, ...), each piece encoded once and remembered (most recently
used first, up to a bound in characters). A prompt's pieces repeat: the system prompt and
tool definitions of every rollout's first call, the role headers and newlines of every turn;
only what is new (a user's task, a tool's output) is encoded.

Why this is the tokenizer's own answer: the tokenizer splits a text at its added tokens before
anything else (``AddedVocabulary::extract_and_normalize``: leftmost-longest matches on the raw
text for tokens that are not normalized), then normalizes, pre-tokenizes and models each piece
on its own, and adds nothing between them when no special tokens are asked for. So the ids of
the text are the ids of its pieces and added tokens, in order. That holds only when every
added token is matched on the raw text as it is: not normalized, no ``lstrip`` / ``rstrip``
(which would eat the pieces' edge whitespace), not ``single_word``, and special tokens not set
to be split (``encode_special_tokens``). ``SegmentEncoder.of`` returns None otherwise. Pure
apart from the tokenizer call; ``tests/families/test_template_render.py`` compares it with
the tokenizer on every fixture template's renders and on hostile texts.
"""

from __future__ import annotations

import re
from array import array
from typing import Any

from capture_proxy.families.locked_lru import LockedLru

#: characters of pieces remembered (ids take 4 bytes each, about a quarter of a piece's size)
CACHE_CHARS = 4_000_000


class SegmentEncoder:
    """A tokenizer's encoding (``backend.encode(text, add_special_tokens=False).ids``) from
    its remembered pieces between added tokens."""

    def __init__(self, backend: Any, added: dict[str, int], cache_chars: int = CACHE_CHARS):
        self._backend = backend
        self._added = added
        # Longest first: at one position the regex takes the first alternative that matches,
        # so this is the tokenizer's leftmost-longest match.
        ordered = sorted(added, key=len, reverse=True)
        self._split = re.compile("|".join(re.escape(t) for t in ordered))
        #: each piece's ids, bounded by the pieces' characters
        self._cache: LockedLru[str, array[int]] = LockedLru(cache_chars, lambda p, _: len(p))

    @classmethod
    def of(cls, backend: Any) -> SegmentEncoder | None:
        """The encoder of a ``tokenizers.Tokenizer``, or None where pieces would not encode as
        the whole text (see the module docstring)."""
        if backend.encode_special_tokens:
            return None
        added: dict[str, int] = {}
        for token_id, token in backend.get_added_tokens_decoder().items():
            flags = (token.normalized, token.lstrip, token.rstrip, token.single_word)
            if any(flags) or not token.content:
                return None
            added[token.content] = token_id
        if not added:
            return None
        return cls(backend, added)

    def _piece(self, piece: str) -> array[int]:
        cache = self._cache
        ids = cache.get(piece)
        if ids is not None:
            return ids
        ids = array("I", self._backend.encode(piece, add_special_tokens=False).ids)
        if len(piece) <= cache.limit // 4:
            cache.put(piece, ids)
        return ids

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, no special tokens added."""
        out: list[int] = []
        at = 0
        added = self._added
        for match in self._split.finditer(text):
            start = match.start()
            if start > at:
                out += self._piece(text[at:start])
            out.append(added[match.group()])
            at = match.end()
        if at < len(text):
            out += self._piece(text[at:])
        return out
