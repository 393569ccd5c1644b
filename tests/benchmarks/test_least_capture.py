"""The least durable capture (``benchmarks/least_capture.py``), the floor bench's second
floor: in front of the scripted engine on loopback, the harness gets the answer without the
token data it did not ask for, and each call's row holds the engine's exact ids and log
probs, committed before the answer ended."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
from aiohttp.test_utils import TestClient, TestServer

from benchmarks.least_capture import make_app
from capture_proxy.scripted_engine import ScriptedEngineConfig, build_scripted_engine_app

PATH = "/ng-rollout/r1/training-token-capture/v1/chat/completions"
BODY = {
    "model": "scripted-qwen",
    "messages": [{"role": "user", "content": "Say hello."}],
}


def _rows(path) -> list[tuple]:
    db = sqlite3.connect(path)
    try:
        return db.execute(
            "SELECT rollout_id, text, prompt_token_ids, generation_token_ids, log_probs FROM calls"
        ).fetchall()
    finally:
        db.close()


async def _least(aiohttp_server, qwen_tokenizer, tmp_path):
    engine_app = build_scripted_engine_app(ScriptedEngineConfig(), qwen_tokenizer)
    engine = await aiohttp_server(engine_app)
    backend = str(engine.make_url("/")).rstrip("/")
    client = TestClient(TestServer(make_app(backend, str(tmp_path / "least.sqlite3"))))
    await client.start_server()
    return engine, client


async def _direct(engine, body) -> dict:
    """What the engine answers the body the least capture sends it."""
    async with TestClient(engine) as direct:
        sent = {**body, "logprobs": True, "return_token_ids": True}
        resp = await direct.post("/v1/chat/completions", json=sent)
        return await resp.json()


async def test_a_whole_answer_is_stripped_and_its_row_holds_the_exact_ids(
    aiohttp_server, qwen_tokenizer, tmp_path
):
    engine, client = await _least(aiohttp_server, qwen_tokenizer, tmp_path)
    try:
        resp = await client.post(PATH, json=BODY)
        assert resp.status == 200
        answer = await resp.json()
    finally:
        await client.close()
    choice = answer["choices"][0]
    assert "prompt_token_ids" not in answer and "token_ids" not in choice
    assert choice["logprobs"] is None
    expected = await _direct(engine, BODY)  # the scripted engine answers alike each time
    ((rollout, text, prompt, gen, lps),) = _rows(tmp_path / "least.sqlite3")
    assert rollout == "r1"
    assert np.frombuffer(prompt, np.uint32).tolist() == expected["prompt_token_ids"]
    want = expected["choices"][0]
    assert np.frombuffer(gen, np.uint32).tolist() == want["token_ids"]
    sent_lps = [e["logprob"] for e in want["logprobs"]["content"]]
    assert np.frombuffer(lps, np.float32).tolist() == np.array(sent_lps, np.float32).tolist()
    assert json.loads(text) == {"messages": BODY["messages"], "message": want["message"]}


async def test_a_stream_is_relayed_stripped_and_its_row_holds_the_exact_ids(
    aiohttp_server, qwen_tokenizer, tmp_path
):
    engine, client = await _least(aiohttp_server, qwen_tokenizer, tmp_path)
    body = {**BODY, "stream": True}
    try:
        resp = await client.post(PATH, json=body)
        assert resp.status == 200
        raw = await resp.read()
    finally:
        await client.close()
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("prompt_token_ids" not in c for c in chunks)
    assert all("token_ids" not in ch for c in chunks for ch in c["choices"])
    whole = await _direct(engine, BODY)
    ((_, _, prompt, gen, lps),) = _rows(tmp_path / "least.sqlite3")
    assert np.frombuffer(prompt, np.uint32).tolist() == whole["prompt_token_ids"]
    assert np.frombuffer(gen, np.uint32).tolist() == whole["choices"][0]["token_ids"]
    sent_lps = [e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert np.frombuffer(lps, np.float32).tolist() == np.array(sent_lps, np.float32).tolist()
