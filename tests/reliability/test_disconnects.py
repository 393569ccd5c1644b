"""A harness that leaves before the engine's first byte, against the proxy as it runs in
production (``capture-proxy serve``: handlers are not cancelled when a client leaves, unlike
the test server's): the proxy finds it gone while it waits, cuts the engine's request, records
the call, and serves on."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from benchmarks.services import proxy_service
from benchmarks.sessions import client_session
from capture_proxy.scripted_engine import Faults, ScriptedEngineConfig
from capture_proxy.scripted_engine.app import build_scripted_engine_app
from tests.proxy.test_capture import USER, _body

DEADLINE_S = 60.0


async def test_a_harness_leaving_before_the_first_byte_is_recorded(
    aiohttp_server, qwen_tokenizer, tmp_path
):
    # The engine would answer long after the deadline: only the proxy's cut ends the call.
    config = ScriptedEngineConfig(faults=Faults(first_byte_delay_s=2 * DEADLINE_S))
    engine = await aiohttp_server(build_scripted_engine_app(config, qwen_tokenizer))
    proxy = proxy_service(
        tmp_path, str(engine.make_url("/")).rstrip("/"), tmp_path / "store", log_level="INFO"
    )
    proxy.start()
    try:
        async with client_session(8, read_timeout_s=DEADLINE_S) as session:
            await proxy.wait_healthy(session, DEADLINE_S)
            url = proxy.url + "/ng-rollout/gone/training-token-capture/v1/chat/completions"
            with pytest.raises(asyncio.TimeoutError):
                await session.post(
                    url,
                    json=_body(USER, stream=True),
                    timeout=aiohttp.ClientTimeout(total=0.1),
                )
            async with asyncio.timeout(DEADLINE_S):
                while True:
                    async with session.get(proxy.url + "/captures/rollouts/gone/chains") as r:
                        if r.status == 200:
                            chains = await r.json()
                            break
                    await asyncio.sleep(0.05)
            [call] = chains["unlinked_calls"]
            assert call["status"] == "incomplete"
            [diag] = [d for d in call["diagnostics"] if d["kind"] == "capture_incomplete"]
            assert diag["details"]["reasons"] == ["client disconnected before the engine answered"]
            async with session.get(proxy.url + "/health") as r:
                assert (await r.json())["status"] == "ok"
        assert "unhandled error" not in proxy.tail(20_000)
    finally:
        proxy.stop()
