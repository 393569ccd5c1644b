"""The composition root (``capture_proxy.app``): what each app it builds serves."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from capture_proxy.app import build_read_only_app
from capture_proxy.config import Settings
from capture_proxy.store.sqlite import SQLiteStore
from tests.conftest import release_served_apps


async def test_the_read_only_app_answers_health_with_no_engine(aiohttp_client, tmp_path: Path):
    """``serve --read-only`` has no engine and no engine probe: ``/health`` says so (engine
    ``null``) instead of failing with a 500."""
    settings = Settings(backend="http://no-backend.invalid", store=str(tmp_path))
    client = await aiohttp_client(build_read_only_app(settings, SQLiteStore(tmp_path)))
    resp = await client.get("/health")
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["status"] == "ok"
    assert body["engine"] is None
    assert body["capture"]["persisted"] == 0


async def test_an_app_served_and_closed_is_let_go(tmp_path: Path):
    """The suite's ``release_served_apps`` (run after every test) lets an app that served a
    request be collected: aiohttp's process-wide middleware cache held every app a test had
    served (some 4 GB over the suite, tokenizers and all)."""
    settings = Settings(backend="http://no-backend.invalid", store=str(tmp_path))
    app = build_read_only_app(settings, SQLiteStore(tmp_path))
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/health")
        assert resp.status == 200, await resp.text()
    served = weakref.ref(app)
    del app, client, resp
    release_served_apps()
    gc.collect()
    assert served() is None, [type(r).__name__ for r in gc.get_referrers(served())]
