"""A small thread-safe cache of the renderer's: most recently used kept, bounded by cost.

Owns ``LockedLru``, the memory of ``segment_encode.SegmentEncoder`` (a piece's ids, bounded by
the pieces' characters) and ``template_render.MemoTojson`` (a value's JSON text, bounded by
the number of texts). Renders run on the event loop and, when large, on worker threads: the
read-then-reorder and the running cost change under one lock. Pure.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LockedLru(Generic[K, V]):
    """Entries kept while the sum of their ``cost(key, value)`` is at most ``limit``, the
    least recently used dropped first."""

    def __init__(self, limit: int, cost: Callable[[K, V], int]) -> None:
        self.limit = limit
        self._cost = cost
        self._entries: OrderedDict[K, V] = OrderedDict()
        #: the summed cost of the entries kept
        self.total = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """The keys kept, least recently used first (a copy: safe while others put)."""
        with self._lock:
            return iter(list(self._entries))

    def get(self, key: K) -> V | None:
        """The value kept for ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` for ``key`` (a key kept already keeps its value: two threads may
        have made it), then drop the oldest entries past ``limit``."""
        with self._lock:
            entries = self._entries
            if key in entries:
                return
            entries[key] = value
            self.total += self._cost(key, value)
            while self.total > self.limit:
                old_key, old_value = entries.popitem(last=False)
                self.total -= self._cost(old_key, old_value)
