"""The composition root (``capture_proxy.app``): what each app it builds serves."""

from __future__ import annotations

from pathlib import Path

from capture_proxy.app import build_read_only_app
from capture_proxy.config import Settings
from capture_proxy.store.sqlite import SQLiteStore


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
