"""The scripted engine's weight-update endpoints and pause rules answer as vLLM 0.32's (dev
mode): abort ends requests in flight with ``finish_reason: "abort"``, keep freezes them until
the resume, wait lets them finish; ``/inference/v1/generate`` names the version of each token
(``weight_versions`` spans), SGLang's ``meta_info.weight_version`` the version; a prompt that
continues an aborted generation gets the rest of it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from capture_proxy.scripted_engine.app import build_scripted_engine_app
from capture_proxy.scripted_engine.policy import Policy
from capture_proxy.scripted_engine.state import SENT_CALLS, ScriptedEngineConfig
from capture_proxy.scripted_engine.weights import WEIGHTS

WAIT_S = 10.0


def _engine(qwen_tokenizer: Any, **kw: Any) -> Any:
    config = ScriptedEngineConfig(
        dev_mode=True,
        enable_scale_out=True,
        # a request without tools is answered with the title: a long one
        policy=Policy(title="the quick brown fox jumps over the lazy dog " * 4),
        **kw,
    )
    return build_scripted_engine_app(config, qwen_tokenizer)


async def _events(resp: Any) -> list[Any]:
    text = await resp.text()
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_weight_version_and_pause_endpoints(qwen_tokenizer) -> None:
    app = build_scripted_engine_app(ScriptedEngineConfig(dev_mode=True), qwen_tokenizer)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        assert await (await client.get("/weight_info")).json() == {"weight_version": "default"}
        r = await client.post("/update_weight_version", json={"new_version": "v7"})
        assert await r.json() == {"success": True, "new_version": "v7"}
        assert await (await client.get("/weight_info")).json() == {"weight_version": "v7"}
        r = await client.post("/update_weight_version", json={})
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "new_version"
        assert (await client.post("/pause?mode=bogus")).status == 422  # FastAPI's Literal
        r = await client.post("/pause?mode=abort")
        assert await r.json() == {"status": "paused"}
        assert await (await client.get("/is_paused")).json() == {"is_paused": True}
        assert app[WEIGHTS].aborted == 1
        await client.post("/finish_weight_update", json={"weight_version": "v8"})
        assert await (await client.post("/resume")).json() == {"status": "resumed"}
        assert await (await client.get("/is_paused")).json() == {"is_paused": False}
        assert await (await client.get("/weight_info")).json() == {"weight_version": "v8"}
        await client.post("/finish_weight_update", json={})  # no version: kept
        assert await (await client.get("/weight_info")).json() == {"weight_version": "v8"}


async def test_no_weight_endpoints_without_dev_mode(qwen_tokenizer) -> None:
    app = build_scripted_engine_app(ScriptedEngineConfig(), qwen_tokenizer)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        assert (await client.get("/weight_info")).status == 404
        assert (await client.post("/pause?mode=abort")).status == 404


def _generate_body(prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": max_tokens, "logprobs": 0},
        "stream": stream,
    }


async def _prompt(client: TestClient) -> list[int]:
    r = await client.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True},
    )
    return list((await r.json())["tokens"])


async def test_abort_ends_a_generate_stream_and_a_continuation_gets_the_rest(
    qwen_tokenizer,
) -> None:
    app = _engine(qwen_tokenizer)
    weights = app[WEIGHTS]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        prompt = await _prompt(client)
        whole = await (
            await client.post("/inference/v1/generate", json=_generate_body(prompt, 30, False))
        ).json()
        full_ids = whole["choices"][0]["token_ids"]
        assert len(full_ids) == 30
        assert whole["choices"][0]["weight_versions"] == [
            {"version": "default", "start": 0, "end": 30}
        ]
        weights.hold_at = 7
        call = asyncio.create_task(
            client.post("/inference/v1/generate", json=_generate_body(prompt, 30, True))
        )
        await asyncio.wait_for(weights.held.wait(), WAIT_S)
        await client.post("/pause?mode=abort")
        events = await _events(await asyncio.wait_for(call, WAIT_S))
        assert events[-1] == "[DONE]"
        ids = [t for e in events[:-1] for c in e["choices"] for t in c["token_ids"]]
        last = events[-2]["choices"][0]
        assert ids == full_ids[:7]
        assert last["finish_reason"] == "abort"
        assert last["weight_versions"] == [{"version": "default", "start": 0, "end": 7}]
        assert app[SENT_CALLS][-1].finish_reason == "abort"
        # while paused, a new request waits to be scheduled
        waiting = asyncio.create_task(
            client.post("/inference/v1/generate", json=_generate_body(prompt + ids, 23, False))
        )
        await client.post("/update_weight_version", json={"new_version": "2"})
        assert not waiting.done()
        await client.post("/resume")
        rest = await (await asyncio.wait_for(waiting, WAIT_S)).json()
        choice = rest["choices"][0]
        assert ids + choice["token_ids"] == full_ids
        assert choice["finish_reason"] == "length"
        assert choice["weight_versions"] == [{"version": "2", "start": 0, "end": 23}]
        full_lps = [e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == full_lps[7:]


async def test_keep_freezes_a_request_and_its_tokens_span_two_versions(qwen_tokenizer) -> None:
    app = _engine(qwen_tokenizer)
    weights = app[WEIGHTS]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        prompt = await _prompt(client)
        weights.hold_at = 5
        call = asyncio.create_task(
            client.post("/inference/v1/generate", json=_generate_body(prompt, 12, False))
        )
        await asyncio.wait_for(weights.held.wait(), WAIT_S)
        await client.post("/pause?mode=keep")
        await client.post("/update_weight_version", json={"new_version": "v2"})
        assert not call.done()
        await client.post("/resume")
        choice = (await (await asyncio.wait_for(call, WAIT_S)).json())["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["weight_versions"] == [
            {"version": "default", "start": 0, "end": 5},
            {"version": "v2", "start": 5, "end": 12},
        ]


async def test_wait_returns_once_requests_in_flight_finished(qwen_tokenizer) -> None:
    app = _engine(qwen_tokenizer)
    weights = app[WEIGHTS]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        prompt = await _prompt(client)
        weights.hold_at = 3
        call = asyncio.create_task(
            client.post("/inference/v1/generate", json=_generate_body(prompt, 9, True))
        )
        await asyncio.wait_for(weights.held.wait(), WAIT_S)
        paused = await asyncio.wait_for(client.post("/pause?mode=wait"), WAIT_S)
        assert await paused.json() == {"status": "paused"}
        assert call.done()  # the request finished before the pause took effect
        events = await _events(call.result())
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 9


async def test_sglang_names_the_version_and_aborts_as_sglang(qwen_tokenizer) -> None:
    app = _engine(qwen_tokenizer)
    weights = app[WEIGHTS]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        prompt = await _prompt(client)
        await client.post("/update_weight_version", json={"new_version": "11"})
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}}
        whole = await (await client.post("/generate", json=body)).json()
        assert whole["meta_info"]["weight_version"] == "11"
        weights.hold_at = 2
        call = asyncio.create_task(client.post("/generate", json={**body, "stream": True}))
        await asyncio.wait_for(weights.held.wait(), WAIT_S)
        await client.post("/pause?mode=abort")
        events = await _events(await asyncio.wait_for(call, WAIT_S))
        meta = events[-2]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert events[-2]["output_ids"] == whole["output_ids"][:2]


async def test_chat_stream_abort_is_one_last_chunk(qwen_tokenizer) -> None:
    app = _engine(qwen_tokenizer)
    weights = app[WEIGHTS]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        weights.hold_at = 4
        body = {
            "model": "scripted-qwen",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "return_token_ids": True,
            "max_tokens": 20,
        }
        call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        await asyncio.wait_for(weights.held.wait(), WAIT_S)
        await client.post("/pause?mode=abort")
        events = await _events(await asyncio.wait_for(call, WAIT_S))
        ids = [t for e in events[1:-1] for t in e["choices"][0].get("token_ids", [])]
        assert len(ids) == 4
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert events[-1] == "[DONE]"
