"""The bookkeeping of the indexes a process keeps (``proxy.rollout_indexes``), without a store
or an event loop: both bounds, the calls in flight that keep an index, the cap on how many one
eviction passes over."""

from __future__ import annotations

from capture_proxy.core.linking.index import LinkIndex
from capture_proxy.proxy.rollout_indexes import EVICT_SKIPS, RolloutIndexes


def _index(calls: int) -> LinkIndex:
    index = LinkIndex()
    for i in range(calls):
        index.add(f"c{i}", float(i), child_digest=f"d{i}", request_digest=f"q{i}")
    return index


def test_both_bounds_and_what_the_owner_is_told():
    evicted: list[str] = []
    held = RolloutIndexes(max_rollouts=3, max_calls=5, on_evict=evicted.append)
    held.put("a", _index(2))
    held.put("b", _index(2))
    assert (list(held), held.calls, evicted) == (["a", "b"], 4, [])
    held.put("c", _index(2))  # 6 calls: "a" goes
    assert (list(held), held.calls, evicted) == (["b", "c"], 4, ["a"])
    grown = held.get("b")  # "b" most recently used, then grows
    assert grown is not None
    grown.add("c9", 9.0, child_digest="d9", request_digest="q9")
    held.count("b", grown)  # 5 calls: within the bound
    assert (list(held), held.calls) == (["c", "b"], 5)
    held.count("b", _index(1))  # not the index held for "b": nothing
    assert held.calls == 5
    held.drop("b")  # the owner's own drop: not an eviction
    assert (list(held), held.calls, evicted) == (["c"], 2, ["a"])


def test_an_index_with_calls_in_flight_stays_until_they_end():
    held = RolloutIndexes(max_rollouts=1, max_calls=100)
    held.put("a", _index(1))
    assert held.pin("x", "a") and not held.pin("x", "a")  # counted once
    held.put("b", _index(1))
    assert list(held) == ["a", "b"] and held.in_flight == {"a": 1}
    held.unpin("x")
    held.unpin("never-pinned")
    assert held.in_flight == {} and held.in_flight_calls == {}
    held.put("c", _index(1))
    assert list(held) == ["c"]


def test_one_eviction_passes_over_at_most_evict_skips_indexes_in_flight():
    held = RolloutIndexes(max_rollouts=10**6, max_calls=10**6)
    pinned = [f"p{i}" for i in range(EVICT_SKIPS + 6)]
    for i, rollout_id in enumerate(pinned):
        held.put(rollout_id, _index(0))
        held.pin(f"call{i}", rollout_id)
    held.put("free", _index(0))  # no call in flight
    held.max_rollouts = 1
    new = _index(0)
    held.put("new", new)
    # the first EVICT_SKIPS looked at have calls in flight: marked recently used, and the
    # eviction stops there, the bound exceeded ("free" not reached)
    skipped, rest = pinned[:EVICT_SKIPS], pinned[EVICT_SKIPS:]
    assert list(held) == [*rest, "free", "new", *skipped]
    # the next call goes on from there: the rest pass, "free" goes, "new" is kept, and
    # passing over the first of the others fills the EVICT_SKIPS again
    held.count("new", new)
    passed = EVICT_SKIPS - len(rest) - 1
    assert list(held) == [*skipped[passed:], *rest, "new", *skipped[:passed]]
    for i in range(len(pinned)):  # the calls end: every index but the one counted goes
        held.unpin(f"call{i}")
    held.count("new", new)
    assert list(held) == ["new"] and held.calls == 0
