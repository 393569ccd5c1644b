"""Tier 1: the choice of engine per rollout (rendezvous hashing with a load cap)."""

from __future__ import annotations

import pytest

from capture_proxy.core.engine_pool import BackendPool, routing_key

URLS = ["http://e0", "http://e1", "http://e2"]


def test_a_key_goes_to_one_backend_and_keys_spread_over_all():
    pool = BackendPool(URLS)
    first = {f"rollout-{i}": pool.choose(f"rollout-{i}").url for i in range(300)}
    assert all(pool.choose(k).url == url for k, url in first.items())
    counts = {u: list(first.values()).count(u) for u in URLS}
    assert sum(counts.values()) == 300
    assert min(counts.values()) >= 70, counts  # about 100 each
    assert pool.moves == 0


def test_an_unhealthy_backend_moves_its_keys_to_their_next_backend_only():
    pool = BackendPool(URLS)
    before = {f"r{i}": pool.choose(f"r{i}").url for i in range(200)}
    pool.mark("http://e1", False)
    after = {k: pool.choose(k).url for k in before}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k, u in before.items() if u == "http://e1"}
    assert all(after[k] == pool.ranking(k)[1].url for k in moved)
    assert pool.moves == len(moved)
    pool.mark("http://e1", True)
    assert {k: pool.choose(k).url for k in before} == before


def test_a_backend_over_the_cap_is_passed_over_and_taken_again_below_it():
    pool = BackendPool(["http://a", "http://b"], balance_factor=1.25)
    key = "hot"
    home = pool.choose(key)
    held = [pool.acquire(key) for _ in range(2)]
    # 2 in flight on home, 0 on the other: cap = ceil(1.25 * 3 / 2) = 2, so the 3rd goes away.
    assert all(b is home for b in held)
    other = pool.acquire(key)
    assert other is not home
    for b in held + [other]:
        pool.release(b)
    assert pool.choose(key) is home
    assert [b.in_flight for b in pool.backends] == [0, 0]


def test_all_unhealthy_still_chooses_the_keys_first_backend():
    pool = BackendPool(URLS)
    for url in URLS:
        pool.mark(url, False)
    assert pool.choose("r").url == pool.ranking("r")[0].url


def test_all_unhealthy_chooses_the_keys_first_backend_that_takes_connections():
    pool = BackendPool(URLS)
    first, second, third = (b.url for b in pool.ranking("r"))
    pool.mark(first, False, reachable=False)  # its port refuses
    pool.mark(second, False)  # answers late or non-2xx: alive
    pool.mark(third, False)
    assert pool.choose("r").url == second
    pool.mark(second, False, reachable=False)
    assert pool.choose("r").url == third
    pool.mark(third, False, reachable=False)  # none takes connections: the key's first
    assert pool.choose("r").url == first
    pool.mark(third, True)  # one is up again: it, whatever its rank
    assert (pool.choose("r").url, pool.by_url[third].reachable) == (third, True)


def test_one_backend_is_always_chosen():
    pool = BackendPool(["http://only"])
    pool.mark("http://only", False)
    assert pool.acquire("r").url == "http://only"


def test_rankings_are_bounded():
    pool = BackendPool(URLS, max_keys=10)
    for i in range(50):
        pool.choose(f"r{i}")
    assert len(pool._rankings) == 10


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


def test_the_running_totals_match_the_backends():
    pool = BackendPool(URLS)
    held = [pool.acquire(f"r{i}") for i in range(7)]
    pool.mark("http://e0", False)
    pool.mark("http://e0", False)
    pool.mark("http://e2", True)
    assert pool._in_flight == sum(b.in_flight for b in pool.backends) == 7
    assert pool._up == sum(b.up for b in pool.backends) == 2
    for b in held:
        pool.release(b)
    pool.mark("http://e0", True)
    assert (pool._in_flight, pool._up) == (0, 3)
