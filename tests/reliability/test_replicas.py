"""Two proxy replicas on one PostgreSQL store (issue 14 item 3), in this process: any replica
answers the read API for any rollout, a rollout whose calls alternate between the replicas
(the worst a load balancer could do) is still one chain, and nothing is lost or falsely linked.

Each session sends step i to replica i % 2 (or the reverse), so each replica's link index of
the rollout is stale at every other call: the other replica wrote the parent after this one
cached the rollout. Only the refresh on a digest miss (the stored calls under the request's
parent digest) links those calls.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.sessions import CallResult, Target, client_session, request_body, stream_call
from benchmarks.verification import Verification, verify_calls, verify_chains
from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.scripted_engine.app import ScriptedEngineConfig, build_scripted_engine_app
from capture_proxy.store.postgres import PostgresStore

pytestmark = pytest.mark.postgres

ROLLOUTS = 12
STEPS = 4
DEADLINE_S = 120.0


async def alternating_session(
    session, replicas: list[str], rollout_id: str, first: int
) -> list[CallResult]:
    """A ``STEPS``-call agent session whose call i goes to replica (first + i) % 2."""
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"Task {rollout_id}."},
    ]
    results = []
    for step in range(STEPS):
        target = Target("r", replicas[(first + step) % 2], capture=True, ask_tokens=True)
        result = await stream_call(
            session,
            target.url(rollout_id),
            request_body(target, list(messages)),
            CallResult(rollout_id, step),
        )
        results.append(result)
        assert result.ok, (rollout_id, step, result.error)
        assert result.message is not None
        messages.append(result.message)
        for tc in result.message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": f"out {step}"})
        if not result.message.get("tool_calls"):
            messages.append({"role": "user", "content": "Continue."})
    return results


async def test_calls_alternating_between_replicas_form_one_chain(
    aiohttp_server, qwen_tokenizer, postgres_server, tmp_path
):
    engine = await aiohttp_server(build_scripted_engine_app(ScriptedEngineConfig(), qwen_tokenizer))
    backend = str(engine.make_url("/")).rstrip("/")
    url = postgres_server.create_database()
    stores = [PostgresStore(url, pool_size=4) for _ in range(2)]
    replicas = []
    for i, store in enumerate(stores):
        settings = Settings(backend=backend, store=url)
        server = await aiohttp_server(build_proxy_app(settings, store))
        replicas.append(str(server.make_url("/")).rstrip("/"))
        assert (await store.health())["kind"] == "postgresql", i
    loads = [0, 0]
    refreshes: list[list[tuple[str, int]]] = [[], []]
    for i, store in enumerate(stores):
        original = store.get_rollout_calls
        by_digest = store.get_calls_by_child_digest

        async def counting(rollout_id: str, i: int = i, original=original):  # type: ignore[no-untyped-def]
            loads[i] += 1
            return await original(rollout_id)

        async def refresh(rollout_id: str, digest: str, i: int = i, by_digest=by_digest):  # type: ignore[no-untyped-def]
            found = await by_digest(rollout_id, digest)
            refreshes[i].append((rollout_id, len(found)))
            return found

        store.get_rollout_calls = counting  # type: ignore[method-assign]
        store.get_calls_by_child_digest = refresh  # type: ignore[method-assign]

    async with client_session(ROLLOUTS * 2, read_timeout_s=DEADLINE_S) as session:
        rollout_ids = [f"alt-{i:02d}" for i in range(ROLLOUTS)]
        sessions = await asyncio.wait_for(
            asyncio.gather(
                *(
                    alternating_session(session, replicas, rid, i % 2)
                    for i, rid in enumerate(rollout_ids)
                )
            ),
            DEADLINE_S,
        )
        # Each replica saw each rollout first with no calls cached (a load), then at its later
        # call a parent written by the other one: a digest miss reads the calls under the
        # parent digest, the parent alone, not the rollout's calls.
        assert loads == [ROLLOUTS, ROLLOUTS]
        for got in refreshes:
            assert sorted(got) == [(rid, 1) for rid in rollout_ids]
        results = [r for s in sessions for r in s]
        for base in replicas:  # any replica answers for any rollout
            v = Verification()
            await verify_calls(session, base, results, v)
            await verify_chains(
                session, base, {s[0].rollout_id: s for s in sessions}, STEPS, v
            )
            assert v.problems == []
            assert (v.calls_checked, v.rollouts_checked) == (ROLLOUTS * STEPS, ROLLOUTS)
    assert sum(i.num_calls for i in await stores[0].list_rollouts()) == ROLLOUTS * STEPS
