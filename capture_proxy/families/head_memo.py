"""What the head of a tail render looked like, remembered by its inputs.

Owns ``HeadMemo``. A tail render (``families.hf_template``) renders the head (the leading
system message and the last user message before the continued turn) only to learn where the
turn starts in the small render. The head repeats: in an agent's tool loop every call of a
rollout has the same system message and task, and rollouts share their system prompt. So the
memo keeps, per head (a digest of its messages, tools and template keyword arguments as JSON),
the head text's length and digest: not the text, so a thousand rollouts with 30 KB system
prompts cost a few hundred KB.

A remembered head is taken only where the small render starts with a text of that digest; a
template whose head changes between renders (a date read with ``strftime_now``) fails that
check and renders its head again. Pure.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

try:  # not in every interpreter that imports ``families`` (vLLM's own, for its image checks)
    import orjson
except ImportError:  # pragma: no cover - the proxy's venv has it
    orjson = None  # type: ignore[assignment]

#: heads remembered (each about 100 bytes)
MAX_HEADS = 8192


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class HeadMemo:
    """Head texts by their inputs: (length, digest), most recently used kept."""

    def __init__(self, max_heads: int = MAX_HEADS) -> None:
        self._heads: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._max = max_heads
        self._lock = threading.Lock()  # a render may run in a worker thread

    @staticmethod
    def key(
        head: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any] | None,
    ) -> bytes | None:
        """The memo key of a head's inputs; None when they are not plain JSON."""
        try:
            if orjson is None:
                data = json.dumps([head, tools, kwargs], allow_nan=False).encode()
            else:
                data = orjson.dumps([head, tools, kwargs])
        except (TypeError, ValueError):
            return None
        return hashlib.blake2b(data, digest_size=16).digest()

    def head_length(self, key: bytes, small: str) -> int | None:
        """The remembered head's length when ``small`` starts with it, else None."""
        found = self._heads.get(key)
        if found is None:
            return None
        length, digest = found
        if len(small) < length or _digest(small[:length]) != digest:
            return None
        with self._lock:
            if key in self._heads:
                self._heads.move_to_end(key)
        return length

    def remember(self, key: bytes, head_text: str) -> None:
        entry = (len(head_text), _digest(head_text))
        with self._lock:
            self._heads[key] = entry
            self._heads.move_to_end(key)
            while len(self._heads) > self._max:
                self._heads.popitem(last=False)
