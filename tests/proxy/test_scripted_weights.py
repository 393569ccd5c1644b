"""The scripted engine's weight-update endpoints answer as vLLM 0.32's (dev mode)."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from capture_proxy.scripted_engine.app import build_scripted_engine_app
from capture_proxy.scripted_engine.state import ScriptedEngineConfig
from capture_proxy.scripted_engine.weights import WEIGHTS


async def test_weight_version_and_pause_endpoints(qwen_tokenizer) -> None:
    app = build_scripted_engine_app(ScriptedEngineConfig(dev_mode=True), qwen_tokenizer)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        assert await (await client.get("/weight_info")).json() == {"weight_version": "default"}
        r = await client.post("/update_weight_version", json={"new_version": "v7"})
        assert r.status == 200
        assert await (await client.get("/weight_info")).json() == {"weight_version": "v7"}
        r = await client.post("/update_weight_version", json={})
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "new_version"
        assert (await client.post("/pause?mode=bogus")).status == 400
        assert (await client.post("/pause?mode=abort")).status == 200
        assert await (await client.get("/is_paused")).json() == {"is_paused": True}
        assert app[WEIGHTS].aborted == 1 and not app[WEIGHTS].resumed.is_set()
        await client.post("/finish_weight_update", json={"weight_version": "v8"})
        assert (await client.post("/resume")).status == 200
        assert await (await client.get("/is_paused")).json() == {"is_paused": False}
        assert await (await client.get("/weight_info")).json() == {"weight_version": "v8"}


async def test_no_weight_endpoints_without_dev_mode(qwen_tokenizer) -> None:
    app = build_scripted_engine_app(ScriptedEngineConfig(), qwen_tokenizer)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        assert (await client.get("/weight_info")).status == 404
        assert (await client.post("/pause?mode=abort")).status == 404
