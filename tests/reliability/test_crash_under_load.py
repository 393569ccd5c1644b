"""Crash safety end to end (issue 7 item 6): SIGKILL the proxy under streaming load, restart it
on the same store, and read back every call whose response the harness saw complete.

The proxy runs as a child process (``capture-proxy serve`` on a temporary store) in front of a
scripted engine served in this process, so the engine's own record (``SENT_CALLS``) is at hand.
64 rollouts run three-step streaming sessions at once; the harness asks for token ids and log
probs, and counts a call as completed when it saw ``data: [DONE]`` and ``X-Capture-Call-Id``.
After a fixed number of completed calls (not a sleep) the proxy is killed with SIGKILL; the
store contract (persist before ``[DONE]``) then says each completed call is readable after a
restart, with exactly the ids and log probs the engine sent. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio

from benchmarks.services import proxy_service
from benchmarks.sessions import CallResult, Target, client_session, run_session
from benchmarks.verification import Verification, by_rollout, verify_calls, verify_chains
from capture_proxy.scripted_engine.app import (
    SENT_CALLS,
    ScriptedEngineConfig,
    build_scripted_engine_app,
)

ROLLOUTS = 64
STEPS = 3
KILL_AFTER = 70  # completed calls: past every session's first step, well before the end
LOAD_DEADLINE_S = 120.0
HEALTH_DEADLINE_S = 60.0


async def test_sigkill_under_load_loses_no_completed_call(aiohttp_server, qwen_tokenizer, tmp_path):
    engine_app = build_scripted_engine_app(ScriptedEngineConfig(), qwen_tokenizer)
    engine = await aiohttp_server(engine_app)
    backend = str(engine.make_url("/")).rstrip("/")
    proxy = proxy_service(tmp_path, backend, tmp_path / "store", log_level="WARNING")
    proxy.start()
    try:
        async with client_session(ROLLOUTS + 8, read_timeout_s=LOAD_DEADLINE_S) as session:
            await proxy.wait_healthy(session, HEALTH_DEADLINE_S)
            target = Target("proxy", proxy.url, capture=True, ask_tokens=True)
            results: list[CallResult] = []
            completed: list[CallResult] = []
            killed_after: list[int] = []

            def on_call(result: CallResult) -> None:
                results.append(result)
                if result.done:
                    # [DONE] reached the harness, so the proxy had persisted the call: this holds
                    # for calls read after the kill too (their bytes were sent before it).
                    completed.append(result)
                if not killed_after and len(completed) >= KILL_AFTER:
                    proxy.kill()
                    killed_after.append(len(completed))

            rollouts = [f"crash-{i:03d}" for i in range(ROLLOUTS)]
            await asyncio.wait_for(
                asyncio.gather(
                    *(run_session(session, target, r, STEPS, on_call) for r in rollouts)
                ),
                LOAD_DEADLINE_S,
            )
            assert killed_after == [KILL_AFTER]
            cut = [r for r in results if not r.ok]
            assert cut, "the kill cut no call: it was not under load"
            assert len(completed) < ROLLOUTS * STEPS
            assert all(
                r.call_id and r.prompt_token_ids and r.generation_token_ids for r in completed
            )

            proxy.start()
            await proxy.wait_healthy(session, HEALTH_DEADLINE_S)

            # Every completed call reads back complete, with the ids and log probs received.
            v = Verification()
            await verify_calls(session, proxy.url, completed, v)
            assert v.problems == []
            assert v.calls_checked == len(completed)
            # ... which are the engine's own: each (prompt, generation) is one the engine sent.
            sent = {
                (tuple(s.prompt_token_ids), tuple(s.generation_token_ids))
                for s in engine_app[SENT_CALLS]
            }
            for r in completed:
                assert r.prompt_token_ids is not None
                assert (tuple(r.prompt_token_ids), tuple(r.generation_token_ids)) in sent

            # Rollouts that finished before the kill are one complete chain each.
            sessions = by_rollout(results)
            finished = {
                k: c for k, c in sessions.items() if len(c) == STEPS and all(x.ok for x in c)
            }
            await verify_chains(session, proxy.url, finished, STEPS, v)
            assert v.problems == []
            assert v.rollouts_checked == len(finished)

            # The restarted proxy serves on: new sessions form complete chains.
            fresh: list[CallResult] = []
            after = [f"after-{i}" for i in range(4)]
            await asyncio.wait_for(
                asyncio.gather(
                    *(run_session(session, target, r, STEPS, fresh.append) for r in after)
                ),
                LOAD_DEADLINE_S,
            )
            assert all(r.ok for r in fresh) and len(fresh) == 4 * STEPS
            await verify_calls(session, proxy.url, fresh, v)
            await verify_chains(session, proxy.url, by_rollout(fresh), STEPS, v)
            assert v.problems == []
    finally:
        proxy.kill()
