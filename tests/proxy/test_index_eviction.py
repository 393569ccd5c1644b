"""A rollout's index is not evicted while it has calls in flight (``RolloutIndexes._evict``): its
in-flight entries, each counted as the child of the candidate it was resolved to, are not in
the store, so an index reloaded from the store would give a concurrent continuation the
candidate already taken. Twin sessions (one task, token-identical answers) continued at once
would then both link to the first twin: a branch, the other twin left without a child."""

from __future__ import annotations

import asyncio

from capture_proxy.proxy.cache_bounds import CacheBounds
from capture_proxy.proxy.linker import Linker
from capture_proxy.store.sqlite import SQLiteStore
from tests.support.twin_calls import NEXT, TASK, resolve_call, twin_call


async def test_an_index_with_calls_in_flight_is_kept_and_twins_keep_their_chains(tmp_path):
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        linker = Linker(store, max_rollouts=1)
        assert await twin_call(linker, store, "r1", "x1", 1.0, TASK) is None
        assert await twin_call(linker, store, "r1", "y1", 2.0, TASK) is None
        # twin x's continuation is resolved (in flight): it takes x1, the earliest childless
        x2 = await resolve_call(linker, "r1", "x2", 3.0, NEXT)
        assert x2.resolution.parent_call_id == "x1"
        # another rollout's call loads its index: one over the bound, but r1 has a call in
        # flight, so r2's stays beside it
        assert await twin_call(linker, store, "r2", "z1", 4.0, TASK) is None
        assert list(linker.indexes) == ["r1", "r2"]
        # twin y's continuation: x1 is taken by x2 (in flight), so y1 is its candidate
        y2 = await resolve_call(linker, "r1", "y2", 5.0, NEXT)
        assert y2.resolution.parent_call_id == "y1"
        assert await x2.finish(linker, store) == "x1"
        assert await y2.finish(linker, store) == "y1"
        # nothing in flight: the next rollout loaded evicts the least recently used ones
        assert await twin_call(linker, store, "r3", "w1", 6.0, TASK) is None
        assert list(linker.indexes) == ["r3"]
        assert linker.indexes.in_flight == {} and linker.indexes.in_flight_calls == {}
        chains = {c.call_id: c.parent_call_id for c in await store.get_rollout_calls("r1")}
        assert chains == {"x1": None, "y1": None, "x2": "x1", "y2": "y1"}
    finally:
        await store.close()


async def test_the_index_just_loaded_is_kept_when_every_other_has_calls_in_flight(tmp_path):
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        linker = Linker(store, max_rollouts=1)
        a1 = await resolve_call(linker, "ra", "a1", 1.0, TASK)
        b1 = await resolve_call(linker, "rb", "b1", 2.0, TASK)
        assert list(linker.indexes) == ["ra", "rb"]
        assert linker.indexes.in_flight == {"ra": 1, "rb": 1}
        assert await a1.finish(linker, store) is None
        assert await b1.finish(linker, store) is None
        assert linker.indexes.in_flight == {}
    finally:
        await store.close()


def _cached_calls(linker: Linker) -> int:
    """What ``linker`` counts its cached indexes to hold, checked against them."""
    held = sum(len(index.entries) for index in linker.indexes.values())
    assert linker.indexes.calls == held
    return held


async def test_the_indexes_in_memory_are_bounded_by_calls_as_well_as_by_rollouts(tmp_path):
    """``max_calls``: a rollout's index grows with its calls, so a bound on rollouts alone
    lets memory grow with the work; past either bound the least recently used go."""
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        linker = Linker(store, max_rollouts=100, bounds=CacheBounds.of(index_calls=3))
        assert await twin_call(linker, store, "r1", "x1", 1.0, TASK) is None
        assert await twin_call(linker, store, "r1", "y1", 2.0, TASK) is None
        assert _cached_calls(linker) == 2
        assert await twin_call(linker, store, "r2", "z1", 3.0, TASK) is None
        assert _cached_calls(linker) == 3 and list(linker.indexes) == ["r1", "r2"]
        # a fourth call: r1 (least recently used, nothing in flight) goes
        assert await twin_call(linker, store, "r2", "z2", 4.0, TASK) is None
        assert list(linker.indexes) == ["r2"] and _cached_calls(linker) == 2
        # r1 comes back from the store whole when its session goes on, and links exactly
        assert await twin_call(linker, store, "r1", "x2", 5.0, NEXT) == "x1"
        assert list(linker.indexes) == ["r1"] and _cached_calls(linker) == 3
        # a rollout with calls in flight stays, over the bound, until they end
        x3 = await resolve_call(linker, "r1", "x3", 6.0, TASK)
        w1 = await resolve_call(linker, "r3", "w1", 7.0, TASK)
        assert list(linker.indexes) == ["r1", "r3"] and _cached_calls(linker) == 5
        assert await x3.finish(linker, store) is None
        assert list(linker.indexes) == ["r3", "r1"]  # x3 was in flight until its release
        assert await w1.finish(linker, store) is None
        assert list(linker.indexes) == ["r3"] and _cached_calls(linker) == 1
        linker.forget("r3")
        assert list(linker.indexes) == [] and _cached_calls(linker) == 0
    finally:
        await store.close()


async def test_a_call_is_counted_in_flight_while_its_resolution_awaits_the_store(tmp_path):
    """With replicas on a shared store (``refresh_on_miss``) a history the cached index does
    not know reads its candidates from the store (``ReadParentCandidates``) before the call is
    filed in flight: meanwhile another rollout's index may be loaded, and the call's must not
    be evicted then (the call is filed in the index it resolved against; one reloaded from the
    store without it would give the twin's continuation the candidate it took)."""
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        linker = Linker(store, max_rollouts=1, refresh_on_miss=True)
        await linker._index("r1")  # cached before the twins' first calls were stored
        other = Linker(store)  # the replica that served them
        assert await twin_call(other, store, "r1", "x1", 1.0, TASK) is None
        assert await twin_call(other, store, "r1", "y1", 2.0, TASK) is None
        reading, go = asyncio.Event(), asyncio.Event()
        read = store.get_calls_by_child_digest

        async def gated(rollout_id: str, parent_digest: str):
            reading.set()
            await go.wait()
            return await read(rollout_id, parent_digest)

        store.get_calls_by_child_digest = gated  # type: ignore[method-assign]
        x2 = asyncio.create_task(resolve_call(linker, "r1", "x2", 3.0, NEXT))
        await reading.wait()  # x2's resolution reads the candidates r1's index lacked
        assert linker.indexes.in_flight == {"r1": 1}
        assert await twin_call(linker, store, "r2", "z1", 4.0, TASK) is None  # loads r2's index
        assert list(linker.indexes) == ["r1", "r2"]
        go.set()
        flight = await x2
        store.get_calls_by_child_digest = read  # type: ignore[method-assign]
        assert flight.resolution.parent_call_id == "x1"
        y2 = await resolve_call(linker, "r1", "y2", 5.0, NEXT)
        assert y2.resolution.parent_call_id == "y1", "y2 took x1, which x2 (in flight) took"
        assert await flight.finish(linker, store) == "x1"
        assert await y2.finish(linker, store) == "y1"
        assert linker.indexes.in_flight == {} and linker.indexes.in_flight_calls == {}
    finally:
        await store.close()


async def test_a_failed_resolution_counts_nothing_and_a_call_never_resolved_releases_nothing(
    tmp_path,
):
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        linker = Linker(store, max_rollouts=1)
        read = store.rollout_index_facts

        async def broken(rollout_id: str):
            raise OSError("disk gone")

        store.rollout_index_facts = broken  # type: ignore[method-assign]
        try:
            await resolve_call(linker, "r1", "x1", 1.0, TASK)
        except OSError:
            pass
        else:
            raise AssertionError("the index load did not fail")
        store.rollout_index_facts = read  # type: ignore[method-assign]
        assert linker.indexes.in_flight == {} and linker.indexes.in_flight_calls == {}
        linker.release("r1", "x1")  # the flow releases a call whose resolution failed
        linker.release("r1", "never-resolved", unstored=True)
        assert linker.indexes.in_flight == {} and linker.indexes.in_flight_calls == {}
        # nothing keeps an index: the next rollout loaded evicts the others
        assert await twin_call(linker, store, "r1", "x1", 2.0, TASK) is None
        assert await twin_call(linker, store, "r2", "z1", 3.0, TASK) is None
        assert list(linker.indexes) == ["r2"]
    finally:
        await store.close()


async def test_a_rollout_forgotten_with_calls_in_flight_is_counted_until_they_end(tmp_path):
    """``forget`` (the rollout deleted) drops its index, not the count of its calls in flight
    (they end later, released as any): the index loaded meanwhile for the rollout stays until
    then, and nothing is left counted after."""
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        linker = Linker(store, max_rollouts=1)
        assert await twin_call(linker, store, "r1", "x1", 1.0, TASK) is None
        x2 = await resolve_call(linker, "r1", "x2", 2.0, NEXT)
        linker.forget("r1")
        assert "r1" not in linker.indexes
        assert linker.indexes.in_flight == {"r1": 1} and linker.indexes.in_flight_calls == {
            "x2": "r1"
        }
        await linker._index("r1")
        assert await twin_call(linker, store, "r2", "z1", 3.0, TASK) is None
        assert list(linker.indexes) == ["r1", "r2"]
        linker.release("r1", "x2", unstored=True)  # its put refused (the rollout is gone)
        assert linker.indexes.in_flight == {} and linker.indexes.in_flight_calls == {}
        assert x2.resolution.parent_call_id == "x1"
        assert await twin_call(linker, store, "r3", "w1", 4.0, TASK) is None
        assert list(linker.indexes) == ["r3"]
    finally:
        await store.close()
