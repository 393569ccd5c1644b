"""Tier 2: the proxy in front of two scripted engines (``--backend`` repeated).

Every call of a rollout is served by one engine, rollouts spread over both, every engine
request carries the routing key, and when one engine dies mid-rollout the rollout's later
calls go to the other with its chain still exact.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.core.engine_pool import BackendPool
from capture_proxy.proxy.engines import ROUTES_KEY, create_pin_board, map_pin_board
from capture_proxy.proxy.keys import SESSION_KEY
from capture_proxy.proxy.weight_watch import VERSION_PATHS
from capture_proxy.scripted_engine.app import build_scripted_engine_app
from capture_proxy.scripted_engine.state import SEEN_REQUESTS, SENT_CALLS, ScriptedEngineConfig
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.conftest import CAPTURE, ProxyTestServer
from tests.proxy.test_capture import USER, _body
from tests.proxy.test_chains_rest import _echo


@dataclass
class Session:
    """One agent session of ``rollout``: its messages so far and its call ids."""

    rollout: str
    messages: list[dict[str, Any]] = field(default_factory=lambda: list(USER))
    call_ids: list[str] = field(default_factory=list)

    async def step(self, client: TestClient, status: int = 200) -> Any:
        resp = await client.post(CAPTURE.format(rollout=self.rollout), json=_body(self.messages))
        body = await resp.json()
        assert resp.status == status, body
        if status != 200:
            return body
        self.call_ids.append(resp.headers["X-Capture-Call-Id"])
        message = body["choices"][0]["message"]
        self.messages.append(_echo(message))
        for tc in message.get("tool_calls") or []:
            self.messages.append(
                {"role": "tool", "tool_call_id": tc["id"], "content": f"out {len(self.call_ids)}"}
            )
        return body


def header(headers: dict[str, str], name: str) -> str | None:
    """``name``'s value in ``headers``, any case (the client may respell it)."""
    return {k.lower(): v for k, v in headers.items()}.get(name.lower())


def served_by(engines: list[TestServer], call_id: str) -> list[int]:
    """The indexes of the engines that received a request of ``call_id`` (vLLM's request id
    is the call id)."""
    return [
        i
        for i, e in enumerate(engines)
        if any(header(s.request_headers, "X-Request-Id") == call_id for s in e.app[SENT_CALLS])
    ]


async def assert_exact_chain(client: TestClient, rollout: str, call_ids: list[str]) -> None:
    """The rollout's chain is ``call_ids`` in order, each linked to the one before, each
    child's prompt extending its parent's prompt and generation token for token."""
    resp = await client.get(f"/captures/rollouts/{rollout}/chains")
    chains = await resp.json()
    assert resp.status == 200, chains
    (chain,) = [c for c in chains["chains"] if c["chain_id"] == call_ids[0]]
    calls = chain["calls"]
    assert [(c["call_id"], c["parent_call_id"]) for c in calls] == list(
        zip(call_ids, [None, *call_ids[:-1]], strict=True)
    )
    for parent, child in zip(calls, calls[1:], strict=False):
        prefix = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert child["prompt_token_ids"][: len(prefix)] == prefix


async def two_engines(aiohttp_server, qwen_tokenizer) -> list[TestServer]:
    return [
        await aiohttp_server(build_scripted_engine_app(ScriptedEngineConfig(), qwen_tokenizer))
        for _ in range(2)
    ]


def url(server: TestServer) -> str:
    return str(server.make_url("/")).rstrip("/")


async def test_rollouts_stick_to_one_engine_spread_and_move_when_it_dies(
    aiohttp_server, aiohttp_client, qwen_tokenizer, tmp_path
):
    engines = await two_engines(aiohttp_server, qwen_tokenizer)
    settings = Settings(
        backend=url(engines[0]),
        extra_backends=[url(engines[1])],
        store=tmp_path / "store",
        upstream_connect_retries=0,
        backend_health_interval_s=30.0,  # the dead engine is found by the failed call here
    )
    app = build_proxy_app(settings, SQLiteStore(tmp_path / "store"))
    client = await aiohttp_client(ProxyTestServer(app, **settings.server_kwargs))
    sessions = [Session(f"task-{i}-a0") for i in range(32)]
    for _ in range(2):
        for s in sessions:
            await s.step(client)
    homes = {}
    for s in sessions:
        engine_of = {tuple(served_by(engines, c)) for c in s.call_ids}
        assert len(engine_of) == 1 and len(next(iter(engine_of))) == 1, (s.rollout, engine_of)
        homes[s.rollout] = next(iter(engine_of))[0]
    spread = [list(homes.values()).count(i) for i in range(2)]
    assert min(spread) >= 6, spread  # binomial(32, 1/2): below 6 once in 10,000 runs
    # Every engine request carried the routing key: the rollout id, in SMG's header.
    for engine in engines:
        for sent in engine.app[SENT_CALLS]:
            rollout = header(sent.request_headers, "X-NG-Rollout-Id")
            assert header(sent.request_headers, "x-smg-routing-key") == rollout

    dead = homes[sessions[0].rollout]
    urls = [url(e) for e in engines]
    await engines[dead].close()
    moved = [s for s in sessions if homes[s.rollout] == dead]
    # The first call to meet the dead engine fails, retryable, naming it; nothing is linked.
    failed = await moved[0].step(client, status=502)
    assert failed["error"]["code"] == "engine_unreachable"
    assert urls[dead] in failed["error"]["message"]
    routes = app[ROUTES_KEY]
    assert [b.healthy for b in routes.pool.backends] == [dead != 0, dead != 1]
    # Later calls of every rollout are served by the live engine; chains stay exact.
    for s in sessions:
        await s.step(client)
    live = 1 - dead
    for s in sessions:
        assert served_by(engines, s.call_ids[-1]) == [live]
        await assert_exact_chain(client, s.rollout, s.call_ids)
    assert routes.pool.moves == len(moved)
    metrics = await (await client.get("/metrics")).text()
    assert f'capture_proxy_backend_healthy{{backend="{urls[dead]}"}} 0.0' in metrics
    assert f'capture_proxy_backend_healthy{{backend="{urls[live]}"}} 1.0' in metrics
    assert f'capture_proxy_backend_in_flight{{backend="{urls[live]}"}} 0.0' in metrics
    assert f"capture_proxy_backend_key_moves {float(len(moved))}" in metrics


async def test_the_health_probe_moves_rollouts_before_any_call_fails(
    aiohttp_server, aiohttp_client, qwen_tokenizer, tmp_path
):
    engines = await two_engines(aiohttp_server, qwen_tokenizer)
    settings = Settings(
        backend=url(engines[0]),
        extra_backends=[url(engines[1])],
        store=tmp_path / "store",
        backend_health_interval_s=0.05,
        backend_health_timeout_s=1.0,
    )
    app = build_proxy_app(settings, SQLiteStore(tmp_path / "store"))
    client = await aiohttp_client(ProxyTestServer(app, **settings.server_kwargs))
    routes = app[ROUTES_KEY]
    sessions = [Session(f"r{i}") for i in range(6)]
    for s in sessions:
        await s.step(client)
    homes = {s.rollout: served_by(engines, s.call_ids[0]) for s in sessions}
    dead = homes["r0"][0]
    await engines[dead].close()
    for _ in range(40):  # bounded: at most 40 probe rounds of <= 1 s each
        if routes.pool.backends[dead].healthy is False:
            break
        await routes.next_round(timeout_s=5.0)
    assert routes.pool.backends[dead].healthy is False
    for s in sessions:
        await s.step(client)  # none meets the dead engine
        assert served_by(engines, s.call_ids[-1]) == [1 - dead]
        await assert_exact_chain(client, s.rollout, s.call_ids)


async def test_one_backend_sends_the_routing_key_in_the_configured_header(make_stack):
    stack = await make_stack(routing_key="episode", routing_key_header="X-Session-ID")
    resp = await stack.chat("task-3-a2", _body(list(USER)))
    assert resp.status == 200
    assert header(stack.sent[0].request_headers, "X-Session-ID") == "task-3"
    assert "x-smg-routing-key" not in {k.lower() for k in stack.sent[0].request_headers}


async def test_routing_key_none_sends_no_header(make_stack):
    stack = await make_stack(routing_key="none")
    resp = await stack.chat("task-3-a2", _body(list(USER)))
    assert resp.status == 200
    assert "x-smg-routing-key" not in {k.lower() for k in stack.sent[0].request_headers}


@pytest.mark.parametrize("dialect", ["vllm_completions", "sglang_generate"])
async def test_exact_tokens_tokenize_and_tokens_in_go_to_the_rollouts_engine_with_its_key(
    aiohttp_server, aiohttp_client, qwen_tokenizer, tmp_path, dialect
):
    """Exact-token mode without a local tokenizer: the engine's /v1/models, /tokenize and
    tokens-in endpoint of a rollout's calls all go to the rollout's engine, with its key."""
    engines = await two_engines(aiohttp_server, qwen_tokenizer)
    settings = Settings(
        backend=url(engines[0]),
        extra_backends=[url(engines[1])],
        store=tmp_path / "store",
        prompt_mode="exact_tokens",
        tokens_in_dialect=dialect,
        backend_health_interval_s=30.0,
    )
    app = build_proxy_app(settings, SQLiteStore(tmp_path / "store"))
    client = await aiohttp_client(ProxyTestServer(app, **settings.server_kwargs))
    sessions = [Session(f"x{i}") for i in range(16)]
    for _ in range(3):
        for s in sessions:
            await s.step(client)
    paths: dict[str, set[str]] = {s.rollout: set() for s in sessions}
    engine_of: dict[str, set[int]] = {s.rollout: set() for s in sessions}
    for i, engine in enumerate(engines):
        for method, path, headers in engine.app[SEEN_REQUESTS]:
            if path == "/health" or path in VERSION_PATHS:
                # the health probe's and the weight-version reader's: no rollout
                assert header(headers, "x-smg-routing-key") is None
                continue
            key = header(headers, "x-smg-routing-key")
            assert key in paths, (method, path, headers)
            paths[key].add(path)
            engine_of[key].add(i)
    generate = "/v1/completions" if dialect == "vllm_completions" else "/generate"
    assert all(len(e) == 1 for e in engine_of.values()), engine_of
    assert {p for ps in paths.values() for p in ps} >= {"/tokenize", generate}
    assert len({next(iter(e)) for e in engine_of.values()}) == 2  # both used (16 rollouts)
    for s in sessions:
        await assert_exact_chain(client, s.rollout, s.call_ids)


def test_a_lease_names_its_rollouts_pinned_engine_and_ends_in_flight():
    from capture_proxy.proxy.engines import EngineRoutes

    routes = EngineRoutes(
        ["http://e0", "http://e1"],
        key_kind="episode",
        balance_factor=1.1,
        health_interval_s=1.0,
        health_timeout_s=1.0,
    )
    lease = routes.enter("r7-a1")
    try:
        assert lease.route.key == "r7"
        assert routes.pool.pins.loads()[lease.backend_state.index] == 1
        again = routes.enter("r7-a2")  # a retried episode: same key, same engine
        assert again.backend == lease.backend
        again.close()
    finally:
        lease.close()
    assert [b.in_flight for b in routes.pool.backends] == [0, 0]
    assert routes.pool.pins.loads() == [0, 0]


@pytest.mark.parametrize("token", [None, "t" * 32])
async def test_health_is_ok_while_one_engine_serves_and_names_every_engines_state(
    aiohttp_server, aiohttp_client, tmp_path, token
):
    """With several backends ``/health`` is 200 ``ok`` while at least one engine can take
    calls, whichever is down (the first too), and 503 ``engine_unreachable`` only when none
    can; its body names each engine's state, without the engine credential. With a token set
    (``/health`` is open to anyone) without where the engines are and how they fail: the
    token's ``/metrics`` and the log say."""
    answers = [200, 200]

    def engine_app(i: int) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.Response(status=answers[i])

        app = web.Application()
        app.router.add_get("/health", health)
        return app

    engines = [await aiohttp_server(engine_app(i)) for i in range(2)]
    urls = [url(e) for e in engines]
    settings = Settings(
        backend=urls[0].replace("http://", "http://user:s3cret@"),
        extra_backends=[urls[1]],
        store=tmp_path / "store",
        backend_health_interval_s=3600.0,  # rounds driven by the test below
        captures_token=token,
    )
    app = build_proxy_app(settings, SQLiteStore(tmp_path / "store"))
    client = await aiohttp_client(ProxyTestServer(app, **settings.server_kwargs))
    routes = app[ROUTES_KEY]
    if routes.probe_rounds == 0:  # the start-up round
        await routes.next_round(timeout_s=5.0)

    async def health_after_probe(status: int) -> dict[str, Any]:
        await routes.probe_all(app[SESSION_KEY])
        resp = await client.get("/health")
        text = await resp.text()
        assert resp.status == status, text
        assert "s3cret" not in text
        body = json.loads(text)
        return {"status": body["status"], "engine": body["engine"]}

    def state(i: int, error: str | None) -> dict[str, Any]:
        if token is not None:
            return {"healthy": error is None, "in_flight": 0}
        return {"url": urls[i], "healthy": error is None, "error": error, "in_flight": 0}

    both = {"ok": True, "up": 2, "count": 2, "engines": [state(0, None), state(1, None)]}
    assert await health_after_probe(200) == {"status": "ok", "engine": both}
    answers[0] = 503  # the first engine down: the other serves, the proxy is in service
    assert await health_after_probe(200) == {
        "status": "ok",
        "engine": {"ok": True, "up": 1, "count": 2,
                   "engines": [state(0, "HTTP 503"), state(1, None)]},
    }  # fmt: skip
    answers[:] = [200, 503]  # another engine than the first down: named too
    assert await health_after_probe(200) == {
        "status": "ok",
        "engine": {"ok": True, "up": 1, "count": 2,
                   "engines": [state(0, None), state(1, "HTTP 503")]},
    }  # fmt: skip
    answers[:] = [503, 503]  # none can take calls
    assert await health_after_probe(503) == {
        "status": "engine_unreachable",
        "engine": {"ok": False, "up": 0, "count": 2,
                   "engines": [state(0, "HTTP 503"), state(1, "HTTP 503")]},
    }  # fmt: skip


async def test_a_late_probe_is_no_verdict_until_several_in_a_row_and_a_dead_port_ranks_last(
    aiohttp_server, aiohttp_client, tmp_path
):
    """Under load a live engine's ``/health`` answers late now and then (trial 12: 1 s probes
    of busy engines flapped, every engine was marked down at once, and the calls went to the
    key's first engine, the dead one, for 75 s). A probe without an answer in time is a
    verdict only as the ``SLOW_PROBES``-th in a row; a refused connection is one at once; and
    with every engine down a call goes to the key's first engine that still takes
    connections, not to one whose port refuses."""
    from capture_proxy.proxy.engines import SLOW_PROBES

    late = [False, False]
    never = asyncio.Event()  # never set: a late engine's /health does not answer

    def engine_app(i: int) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            if late[i]:
                await never.wait()
            return web.Response(status=200)

        app = web.Application()
        app.router.add_get("/health", health)
        return app

    engines = [await aiohttp_server(engine_app(i)) for i in range(2)]
    urls = [url(e) for e in engines]
    settings = Settings(
        backend=urls[0],
        extra_backends=[urls[1]],
        store=tmp_path / "store",
        backend_health_interval_s=3600.0,  # rounds driven by the test below
        backend_health_timeout_s=0.05,
    )
    app = build_proxy_app(settings, SQLiteStore(tmp_path / "store"))
    await aiohttp_client(ProxyTestServer(app, **settings.server_kwargs))
    routes = app[ROUTES_KEY]
    if routes.probe_rounds == 0:  # the start-up round
        await routes.next_round(timeout_s=5.0)
    session = app[SESSION_KEY]
    pool = routes.pool

    late[:] = [True, True]
    for _ in range(SLOW_PROBES - 1):
        await routes.probe_all(session)
        assert [b.healthy for b in pool.backends] == [True, True]  # late: no verdict yet
    await routes.probe_all(session)
    assert [b.healthy for b in pool.backends] == [False, False]
    assert routes.health()["engines"][0]["error"] == "no answer within 0.05 s"
    late[:] = [False, False]
    await routes.probe_all(session)
    assert [b.healthy for b in pool.backends] == [True, True]

    # an engine that answers calls between the rounds is busy, not hung: its late probes are
    # no verdict (engine 1 answers none: down at the SLOW_PROBES-th)
    late[:] = [True, True]
    for _ in range(SLOW_PROBES + 1):
        routes.mark_answered(urls[0])
        await routes.probe_all(session)
    assert [b.healthy for b in pool.backends] == [True, False]
    late[:] = [False, False]
    await routes.probe_all(session)
    assert [b.healthy for b in pool.backends] == [True, True]

    # engine 0 dies (its port refuses): down at the first probe; engine 1 answers late
    await engines[0].close()
    late[1] = True
    await routes.probe_all(session)
    assert [(b.healthy, b.reachable) for b in pool.backends] == [(False, False), (True, True)]
    for _ in range(SLOW_PROBES - 1):
        await routes.probe_all(session)
    assert [(b.healthy, b.reachable) for b in pool.backends] == [(False, False), (False, True)]
    # every engine down: each rollout goes to the one that takes connections, whatever its rank
    keys = [f"r{i}" for i in range(20)]
    assert {pool.ranking(k)[0].url for k in keys} == set(urls)
    assert {pool.choose(k, 0).url for k in keys} == {urls[1]}


async def test_a_call_an_engine_answers_counts_as_a_sign_of_life(
    aiohttp_server, aiohttp_client, qwen_tokenizer, tmp_path
):
    """The executor tells the pool which engine answered a call's head (``mark_answered``):
    a late health probe of that engine is then no evidence against it."""
    engines = await two_engines(aiohttp_server, qwen_tokenizer)
    settings = Settings(
        backend=url(engines[0]),
        extra_backends=[url(engines[1])],
        store=tmp_path / "store",
        backend_health_interval_s=3600.0,  # no round clears the set during the test
    )
    app = build_proxy_app(settings, SQLiteStore(tmp_path / "store"))
    client = await aiohttp_client(ProxyTestServer(app, **settings.server_kwargs))
    routes = app[ROUTES_KEY]
    if routes.probe_rounds == 0:  # the start-up round
        await routes.next_round(timeout_s=5.0)
    assert routes.answered == set()
    session = Session("r0")
    await session.step(client)
    (home,) = served_by(engines, session.call_ids[0])
    assert routes.answered == {url(engines[home])}


def test_the_pins_file_is_shared_by_the_workers_that_map_it(tmp_path):
    path = tmp_path / "engine-pins"
    create_pin_board(path, engines=3, workers=2)
    urls = ["http://e0", "http://e1", "http://e2"]
    boards = [map_pin_board(path, engines=3, workers=2, index=i) for i in range(2)]
    pools = [BackendPool(urls, pins=board) for board in boards]
    placed = {f"r{i}": pools[0].acquire(f"r{i}", 100).url for i in range(30)}
    assert {k: pools[1].acquire(k, 101).url for k in placed} == placed
    assert boards[0].loads() == boards[1].loads() == [2 * list(placed.values()).count(u)
                                                      for u in urls]  # fmt: skip
    with pytest.raises(ValueError, match="not a pin board of 2 engines, 2 workers"):
        map_pin_board(path, engines=2, workers=2, index=0)
    with pytest.raises(FileNotFoundError):
        map_pin_board(tmp_path / "missing", engines=3, workers=2, index=0)
