"""Tier 2: the graceful stop (``proxy.stopping``): a call on a hung engine is waited for at
most ``shutdown_timeout_s``, named in the log when the stop begins and when it is cut, and
stored incomplete, never lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from aiohttp import web
from aiohttp.test_utils import TestClient

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.conftest import CAPTURE, ProxyTestServer
from tests.proxy.test_capture import USER, _body


async def test_a_stop_cuts_a_call_on_a_hung_engine_at_its_bound_and_stores_it(
    aiohttp_server, tmp_path, caplog
):
    arrived = asyncio.Event()
    never = asyncio.Event()

    async def hung(request: web.Request) -> web.Response:
        arrived.set()
        await never.wait()  # alive, never answering (a SIGSTOPped engine)
        return web.Response()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    engine_app = web.Application()
    engine_app.router.add_post("/v1/chat/completions", hung)
    engine_app.router.add_get("/health", health)
    engine = await aiohttp_server(engine_app)
    settings = Settings(
        backend=str(engine.make_url("/")).rstrip("/"),
        store=tmp_path / "store",
        shutdown_timeout_s=0.5,
    )
    server = ProxyTestServer(build_proxy_app(settings, SQLiteStore(tmp_path / "store")))
    await server.start_server(**settings.server_kwargs)  # the runner's, as ``serve`` sets them
    client = TestClient(server)
    caplog.set_level(logging.INFO, logger="capture_proxy")
    call = asyncio.create_task(
        client.post(CAPTURE.format(rollout="r1"), json=_body(list(USER), stream=True))
    )
    try:
        async with asyncio.timeout(10):
            await arrived.wait()
        async with asyncio.timeout(10):  # 0.5 s, then the cut call's record; not 60 s
            await server.close()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(call, 10)
        await client.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping:")]
    lines = [re.sub(r"call-[0-9a-f]+", "call-ID", re.sub(r"\d+\.\d s\)", "T s)", m)) for m in lines]
    assert lines == [
        "stopping: finishing 1 calls in flight, at most 0.5 s (shutdown_timeout_s): "
        "call-ID (rollout r1, T s)",
        "stopping: 1 calls still in flight after 0.5 s (shutdown_timeout_s): cut, stored "
        "incomplete: call-ID (rollout r1, T s)",
    ]
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        records = await store.get_rollout_calls("r1")
    finally:
        await store.close()
    assert [(r.status.value, [d.kind for d in r.diagnostics]) for r in records] == [
        ("incomplete", ["capture_incomplete"])
    ]
