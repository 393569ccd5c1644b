"""The rollouts' link indexes one process keeps in memory (``Linker``'s cache).

A rollout's ``LinkIndex`` is made from the store the first time the process sees the rollout
(and again after it was dropped), then kept: at most ``max_rollouts`` of them, holding at most
``max_calls`` calls in all (an index grows with its rollout's calls, about 3.5 KB each:
``benchmarks/index_memory.py``), the least recently used dropped first. Never one with calls
in flight here (``pin`` to ``unpin``): its in-flight entries, each counted as the child of the
candidate it was resolved to, are not in the store, so an index made again would give a
concurrent continuation the candidate already taken (twins: a branch, the other twin left
without a child). Pure bookkeeping: no I/O, not thread-safe; O(1) per call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, ValuesView

from capture_proxy.core.linking.index import LinkIndex

#: The most indexes with calls in flight one eviction passes over (the next calls look at the
#: next ones): O(1) per call even when every index has calls in flight.
EVICT_SKIPS = 64


class RolloutIndexes:
    """The cache. ``on_evict(rollout_id)``: told of each index dropped for the bounds (the
    owner drops what it keeps beside it)."""

    def __init__(
        self, max_rollouts: int, max_calls: int, on_evict: Callable[[str], None] | None = None
    ) -> None:
        self.max_rollouts = max_rollouts
        self.max_calls = max_calls
        self._on_evict = on_evict
        #: least recently used first
        self._indexes: OrderedDict[str, LinkIndex] = OrderedDict()
        #: per index, the calls it held when last counted (``count``), and their sum
        self._sizes: dict[str, int] = {}
        self.calls = 0
        #: per call in flight (``pin``), its rollout; per rollout, how many
        self.in_flight_calls: dict[str, str] = {}
        self.in_flight: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._indexes)

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._indexes

    def __iter__(self) -> Iterator[str]:
        """The rollouts held, least recently used first."""
        return iter(self._indexes)

    def values(self) -> ValuesView[LinkIndex]:
        return self._indexes.values()

    def get(self, rollout_id: str) -> LinkIndex | None:
        """The rollout's index when held, marked most recently used."""
        index = self._indexes.get(rollout_id)
        if index is not None:
            self._indexes.move_to_end(rollout_id)
        return index

    def peek(self, rollout_id: str) -> LinkIndex | None:
        """The rollout's index when held (its place in the order unchanged)."""
        return self._indexes.get(rollout_id)

    def put(self, rollout_id: str, index: LinkIndex) -> None:
        """Hold ``index`` (just made) as the rollout's, most recently used."""
        self._indexes[rollout_id] = index
        self._indexes.move_to_end(rollout_id)
        self.count(rollout_id, index)

    def count(self, rollout_id: str, index: LinkIndex) -> None:
        """Count the calls ``index`` holds now (wherever it may have grown: made, refreshed, a
        call filed or stored), then drop indexes past the bounds, never ``rollout_id``'s.
        Nothing when ``index`` is not the one held for the rollout."""
        if self._indexes.get(rollout_id) is not index:
            return
        size = len(index.entries)
        self.calls += size - self._sizes.get(rollout_id, 0)
        self._sizes[rollout_id] = size
        if self.calls > self.max_calls or len(self._indexes) > self.max_rollouts:
            self._evict(keep=rollout_id)

    def drop(self, rollout_id: str) -> None:
        """Drop the rollout's index (deleted, or to be made again)."""
        if self._indexes.pop(rollout_id, None) is not None:
            self.calls -= self._sizes.pop(rollout_id, 0)

    def pin(self, call_id: str, rollout_id: str) -> bool:
        """``call_id`` of the rollout is in flight here until ``unpin``: its index is not
        dropped for the bounds. False when it was pinned already."""
        if call_id in self.in_flight_calls:
            return False
        self.in_flight_calls[call_id] = rollout_id
        self.in_flight[rollout_id] = self.in_flight.get(rollout_id, 0) + 1
        return True

    def unpin(self, call_id: str) -> None:
        """``call_id`` is no longer in flight here (nothing when it was not pinned)."""
        rollout_id = self.in_flight_calls.pop(call_id, None)
        if rollout_id is not None:
            left = self.in_flight[rollout_id] - 1
            if left:
                self.in_flight[rollout_id] = left
            else:
                del self.in_flight[rollout_id]

    def _evict(self, keep: str) -> None:
        """Drop the least recently used indexes past ``max_rollouts`` or ``max_calls``, but not
        ``keep`` (the one a call is being filed in) nor one with calls in flight (module
        docstring): those are marked recently used instead, so the bounds are exceeded by at
        most the rollouts with calls in flight; at most ``EVICT_SKIPS`` are passed over."""
        indexes = self._indexes
        skipped, most = 0, min(len(indexes), EVICT_SKIPS)
        while skipped < most and (len(indexes) > self.max_rollouts or self.calls > self.max_calls):
            old = next(iter(indexes))
            if old == keep or self.in_flight.get(old):
                indexes.move_to_end(old)
                skipped += 1
                continue
            self.drop(old)
            if self._on_evict is not None:
                self._on_evict(old)
