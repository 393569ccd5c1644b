"""Tier 1: the choice of engine per rollout (pins placed by rendezvous hashing with a load cap
on requests in flight, shared by the workers)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.core.engine_pool import (
    Backend,
    BackendPool,
    KeySlots,
    PinBoard,
    pin_board_words,
    routing_key,
)

URLS = ["http://e0", "http://e1", "http://e2"]
T0 = 10_000  # a time (s) of the pins' clock


def _board(engines: int, workers: int) -> memoryview:
    return memoryview(bytearray(4 * pin_board_words(engines, workers))).cast("I")


def test_a_key_goes_to_one_backend_and_keys_spread_over_all():
    pool = BackendPool(URLS)
    first = {f"rollout-{i}": pool.acquire(f"rollout-{i}", T0).url for i in range(300)}
    assert all(pool.acquire(k, T0 + 1).url == url for k, url in first.items())
    counts = {u: list(first.values()).count(u) for u in URLS}
    assert sum(counts.values()) == 300
    assert min(counts.values()) >= 70, counts  # about 100 each
    assert max(counts.values()) <= 110  # ceil(1.1 * 300 / 3): the cap in flight
    assert pool.pins.loads() == [2 * counts[u] for u in URLS]  # two requests each, held
    assert pool.moves == 0


def test_placement_passes_over_an_engine_at_the_cap_in_flight():
    pool = BackendPool(["http://a", "http://b"], balance_factor=1.0)
    keys = [f"r{i}" for i in range(40)]
    chosen = [pool.acquire(k, T0).url for k in keys]
    # each key is placed while the engine's requests in flight are under ceil((n + 1) / 2)
    assert pool.pins.loads() == [20, 20]
    assert sorted(chosen) == ["http://a"] * 20 + ["http://b"] * 20
    assert [pool.choose(k, T0 + 5).url for k in keys] == chosen


def test_a_pinned_key_stays_on_its_engine_whatever_its_requests_in_flight():
    pool = BackendPool(["http://a", "http://b"])
    home = pool.acquire("hot", T0)
    held = [pool.acquire("hot", T0) for _ in range(9)]  # a burst: 10 in flight, 0 elsewhere
    assert all(b is home for b in held)
    assert pool.pins.loads() == [10 * (home.index == 0), 10 * (home.index == 1)]
    for b in [home, *held]:
        pool.release(b, "hot", T0 + 1)
    assert pool.pins.loads() == [0, 0]
    assert [b.in_flight for b in pool.backends] == [0, 0]
    assert pool.moves == 0


def test_an_unhealthy_backend_moves_its_keys_once_and_they_stay_when_it_is_back():
    pool = BackendPool(URLS)
    keys = [f"r{i}" for i in range(200)]
    before = {}
    for k in keys:
        backend = pool.acquire(k, T0)
        before[k] = backend.url
        pool.release(backend, k, T0)  # each call ends before the next starts
    pool.mark("http://e1", False)
    held = [pool.acquire(k, T0 + 1) for k in keys]  # every rollout's next call, in flight
    after = {k: b.url for k, b in zip(keys, held, strict=True)}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k, u in before.items() if u == "http://e1"}
    assert all(after[k] == next(b.url for b in pool.ranking(k) if b.url != "http://e1")
               for k in moved)  # fmt: skip
    assert pool.moves == len(moved)
    assert pool.pins.loads()[1] == 0
    pool.mark("http://e1", True)
    # the moved keys' prefixes are on their new engines now: they stay there
    assert {k: pool.choose(k, T0 + 2).url for k in keys} == after
    # new rollouts go to the engine that came back while the others carry more than their
    # share in flight (cap ceil(1.1 * 201 / 3) = 74, e0 and e2 hold about 100 each)
    fresh = [pool.acquire(f"new{i}", T0 + 2).url for i in range(30)]
    assert fresh == ["http://e1"] * 30
    for k, b in zip(keys, held, strict=True):
        pool.release(b, k, T0 + 3)
    assert pool.pins.loads() == [0, 30, 0]
    assert pool.moves == len(moved)


def test_a_key_idle_past_its_pin_is_placed_again_and_a_move_is_counted():
    pool = BackendPool(["http://a", "http://b"], pin_idle_s=60)
    key = next(f"r{i}" for i in range(100) if pool.ranking(f"r{i}")[0].url == "http://a")
    pool.release(pool.acquire(key, T0), key, T0)
    assert pool.pins.pinned(KeySlots.of(key), T0 + 60 - 60) == 0
    assert pool.pins.pinned(KeySlots.of(key), T0 + 61 - 60) is None  # idle 61 s: no pin
    hot = next(f"h{i}" for i in range(100) if pool.ranking(f"h{i}")[0].url == "http://a")
    burst = [pool.acquire(hot, T0 + 61) for _ in range(3)]  # pinned to a: 3 in flight there
    assert [b.url for b in burst] == ["http://a"] * 3
    # placed again: a is its first choice, but it holds 3 of 3 in flight, over the cap
    # ceil(1.1 * (3 + 1) / 2) = 3: it goes to b, and the move is counted
    assert pool.acquire(key, T0 + 61).url == "http://b"
    assert pool.moves == 1


def test_a_call_longer_than_the_pin_idle_time_keeps_its_rollouts_pin():
    pool = BackendPool(["http://a", "http://b"], balance_factor=1.0, pin_idle_s=60)
    long_call = pool.acquire("r", T0)  # runs 100 s
    # another session's call 90 s in: its engine is over the cap (1 of 1), yet it stays
    assert pool.acquire("r", T0 + 90) is long_call
    pool.release(long_call, "r", T0 + 100)  # its last use: the end of its call
    assert pool.pins.pinned(KeySlots.of("r"), T0 + 100 - 60) == long_call.index
    assert pool.acquire("r", T0 + 155) is long_call  # 55 s after the end: still pinned
    assert pool.moves == 0


def test_the_probe_rounds_renew_the_pins_of_calls_in_flight_for_the_other_workers():
    words = _board(2, 2)
    pools = [
        BackendPool(
            ["http://a", "http://b"],
            balance_factor=1.0,
            pin_idle_s=60,
            pins=PinBoard(words, engines=2, workers=2, index=i),
        )  # fmt: skip
        for i in range(2)
    ]
    long_call = pools[0].acquire("r", T0)
    pools[0].renew(T0 + 50)  # a probe round of worker 0
    # worker 1, 100 s in: the pin is live (renewed at 50 s), though the engine is at the cap
    assert pools[1].acquire("r", T0 + 100).url == long_call.url
    pools[0].release(long_call, "r", T0 + 101)
    assert pools[0]._busy == {}


def test_workers_sharing_a_board_send_a_key_to_one_engine():
    words = _board(2, 2)
    w0 = BackendPool(["http://a", "http://b"], pins=PinBoard(words, engines=2, workers=2, index=0))
    w1 = BackendPool(["http://a", "http://b"], pins=PinBoard(words, engines=2, workers=2, index=1))
    keys = [f"r{i}" for i in range(40)]
    placed = {k: w0.acquire(k, T0).url for k in keys}
    # worker 1 sees worker 0's pins, and worker 0's requests in flight in its cap
    assert {k: w1.acquire(k, T0 + 1).url for k in keys} == placed
    per_engine = [list(placed.values()).count(u) for u in ("http://a", "http://b")]
    assert w1.pins.loads() == w0.pins.loads() == [2 * n for n in per_engine]
    fresh = w1.acquire("fresh", T0 + 1)
    assert w0.acquire("fresh", T0 + 2) is w0.by_url[fresh.url]
    assert w0.moves == w1.moves == 0


def test_a_placement_under_the_lock_takes_a_pin_another_worker_made_meanwhile():
    words = _board(2, 2)
    other = PinBoard(words, engines=2, workers=2, index=1)
    key = "r"
    entered = []

    @contextlib.contextmanager
    def lock():
        entered.append(key)
        other.pin(KeySlots.of(key), second, T0)  # the other worker placed it first
        yield

    pool = BackendPool(["http://a", "http://b"],
                       pins=PinBoard(words, engines=2, workers=2, index=0, lock=lock))  # fmt: skip
    second = pool.ranking(key)[1].index
    assert pool.choose(key, T0).url == pool.ranking(key)[0].url  # a look takes no lock
    assert entered == []
    assert pool.acquire(key, T0) is pool.ranking(key)[1]
    assert pool.acquire(key, T0 + 1) is pool.ranking(key)[1]
    assert entered == [key]  # one placement, then its pin


def test_a_renewal_never_undoes_another_workers_placement():
    board = PinBoard.local(3)
    key = KeySlots.of("r")
    board.pin(key, 0, T0)
    board.pin(key, 2, T0 + 5)  # another worker moved it (its engine went down)
    board.touch(key, 0, T0 + 6)  # a worker that still sent it to engine 0 renews
    assert board.pinned(key, T0 + 5) == 2
    assert board.pinned(key, T0 + 6) is None  # and its time is not renewed either
    board.touch(key, 2, T0 + 7)
    assert board.pinned(key, T0 + 7) == 2


def test_a_replaced_worker_zeroes_its_counts_and_keeps_the_pins():
    words = _board(2, 2)
    w0 = BackendPool(["http://a", "http://b"], pins=PinBoard(words, engines=2, workers=2, index=0))
    placed = {f"r{i}": w0.acquire(f"r{i}", T0).url for i in range(10)}
    again = BackendPool(["http://a", "http://b"],
                        pins=PinBoard(words, engines=2, workers=2, index=0))  # fmt: skip
    assert again.pins.loads() == [0, 0]
    assert {k: again.acquire(k, T0 + 1).url for k in placed} == placed


def test_two_choice_slots_keep_two_colliding_keys_and_give_up_the_older():
    board = PinBoard.local(3)
    one, two, three = (KeySlots(f, (5, 9)) for f in (11, 22, 33))
    board.pin(one, 0, T0)
    board.pin(two, 1, T0 + 1)
    assert (board.pinned(one, T0), board.pinned(two, T0)) == (0, 1)
    board.pin(one, 2, T0 + 2)  # renewed in its own slot
    board.pin(three, 1, T0 + 3)  # takes the slot used least lately: two's
    assert (board.pinned(one, T0), board.pinned(two, T0), board.pinned(three, T0)) == (2, None, 1)
    assert board.pinned(one, T0 + 3) is None  # stale: last used T0 + 2


def test_a_pin_naming_no_engine_of_the_board_is_no_pin():
    board = PinBoard.local(3)
    key = KeySlots(7, (1, 2))
    board.words[3:6] = memoryview(bytes(12)).cast("I")
    board.words[3], board.words[4], board.words[5] = 7, 9, T0  # a torn or foreign write
    assert board.pinned(key, T0) is None


def test_all_unhealthy_pins_nothing():
    pool = BackendPool(URLS)
    for url in URLS:
        pool.mark(url, False)
    assert pool.acquire("r", T0).url == pool.ranking("r")[0].url
    assert pool.pins.pinned(KeySlots.of("r"), 0) is None


def test_all_unhealthy_keeps_a_key_on_its_pinned_engine_while_it_takes_connections():
    pool = BackendPool(URLS)
    first, second, third = pool.ranking("r")
    pool.mark(first.url, False)
    assert pool.acquire("r", T0) is second  # placed on its second choice, pinned there
    pool.mark(first.url, True)
    assert pool.acquire("r", T0 + 1) is second
    for b in URLS:
        pool.mark(b, False)  # every probe late: busy engines, not dead ones
    assert pool.acquire("r", T0 + 2) is second  # not its first choice: it stays
    pool.mark(second.url, False, reachable=False)  # its port refuses: the key's first that takes
    assert pool.acquire("r", T0 + 3) is first
    assert pool.moves == 1
    assert pool.pins.pinned(KeySlots.of("r"), T0) == second.index  # no pin made meanwhile


def test_all_unhealthy_chooses_the_keys_first_backend_that_takes_connections():
    pool = BackendPool(URLS)
    first, second, third = (b.url for b in pool.ranking("r"))
    pool.mark(first, False, reachable=False)  # its port refuses
    pool.mark(second, False)  # answers late or non-2xx: alive
    pool.mark(third, False)
    assert pool.choose("r", T0).url == second
    pool.mark(second, False, reachable=False)
    assert pool.choose("r", T0).url == third
    pool.mark(third, False, reachable=False)  # none takes connections: the key's first
    assert pool.choose("r", T0).url == first
    pool.mark(third, True)  # one is up again: it, whatever its rank
    assert (pool.choose("r", T0).url, pool.by_url[third].reachable) == (third, True)


def test_one_backend_is_always_chosen():
    pool = BackendPool(["http://only"])
    pool.mark("http://only", False)
    assert pool.acquire("r", T0).url == "http://only"


def test_the_keys_kept_are_bounded():
    pool = BackendPool(URLS, max_keys=10)
    held = [pool.acquire(f"r{i}", T0) for i in range(50)]
    assert len(pool._keys) == 50  # none forgotten while a request of it is in flight
    assert sum(pool.pins.loads()) == 50
    for i, b in enumerate(held):
        pool.release(b, f"r{i}", T0)
    assert pool.pins.loads() == [0, 0, 0]
    pool.acquire("r50", T0)  # the least lately used idle keys go, down to 10
    assert list(pool._keys) == [f"r{i}" for i in range(41, 51)]


def test_keyless_requests_go_to_the_least_loaded_healthy_backend():
    pool = BackendPool(URLS)
    held = [pool.acquire(None, T0) for _ in range(6)]
    assert [b.in_flight for b in pool.backends] == [2, 2, 2]
    pool.mark("http://e0", False)
    assert pool.acquire(None, T0).url in {"http://e1", "http://e2"}
    assert held


def test_routing_keys():
    assert routing_key("task-7-a2", "rollout") == "task-7-a2"
    assert routing_key("task-7-a2", "episode") == "task-7"
    assert routing_key("task-7", "episode") == "task-7"
    assert routing_key("task-7-a2", "none") is None
    with pytest.raises(ValueError, match="unknown routing key kind"):
        routing_key("r", "root")


def test_bad_pools_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        BackendPool([])
    with pytest.raises(ValueError, match="repeat"):
        BackendPool(["http://a", "http://a"])
    with pytest.raises(ValueError, match="balance_factor"):
        BackendPool(["http://a"], balance_factor=0.5)
    with pytest.raises(ValueError, match="for 3 engines, not 2"):
        BackendPool(["http://a", "http://b"], pins=PinBoard.local(3))
    with pytest.raises(ValueError, match="pin_board_words"):
        PinBoard(memoryview(bytearray(16)).cast("I"), engines=2)
    with pytest.raises(ValueError, match="not in 0..1"):
        PinBoard(memoryview(bytearray(4 * pin_board_words(2, 2))).cast("I"), engines=2,
                 workers=2, index=2)  # fmt: skip


def test_the_running_totals_match_the_backends():
    pool = BackendPool(URLS)
    held = [(f"r{i}", pool.acquire(f"r{i}", T0)) for i in range(7)]
    pool.mark("http://e0", False)
    pool.mark("http://e0", False)
    pool.mark("http://e2", True)
    assert pool.pins.loads() == [b.in_flight for b in pool.backends]
    assert sum(pool.pins.loads()) == 7
    assert pool._up == sum(b.up for b in pool.backends) == 2
    for k, b in held:
        pool.release(b, k)
    pool.mark("http://e0", True)
    assert (pool.pins.loads(), pool._up) == ([0, 0, 0], 3)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 1),  # worker
            st.integers(0, 11),  # key (or, with the release flag, which lease)
            st.booleans(),  # release a lease held instead
            st.integers(0, 90),  # seconds since the last step
            st.sampled_from([None, (0, True), (0, False), (1, True), (2, False), (2, True)]),
        ),
        max_size=60,
    )
)
def test_two_workers_keep_their_counts_true_and_agree_on_every_key(steps):
    urls = ["http://a", "http://b", "http://c"]
    words = _board(3, 2)
    pools = [
        BackendPool(urls, pin_idle_s=120, pins=PinBoard(words, engines=3, workers=2, index=i))
        for i in range(2)
    ]
    held: list[tuple[BackendPool, str, Backend]] = []
    now = T0
    for worker, key, release, dt, health in steps:
        now += dt
        if health is not None:
            for pool in pools:  # both workers' probes agree
                pool.mark(urls[health[0]], health[1])
        if release and held:
            pool, held_key, backend = held.pop(key % len(held))
            pool.release(backend, held_key, now)
        else:
            pool, other = pools[worker], pools[1 - worker]
            backend = pool.acquire(f"r{key}", now)
            held.append((pool, f"r{key}", backend))
            if any(b.up for b in pool.backends):
                assert backend.up
                assert other.choose(f"r{key}", now) is other.by_url[backend.url]
        for p in pools:  # each worker's row is its requests in flight, and its keys' counts
            assert list(words[p.pins._row : p.pins._row + 3]) == [b.in_flight for b in p.backends]
            assert sum(state.in_flight for state in p._busy.values()) == sum(
                b.in_flight for b in p.backends
            )
        assert (
            pools[0].pins.loads()
            == pools[1].pins.loads()
            == [sum(b.url == u for _, _, b in held) for u in urls]
        )
