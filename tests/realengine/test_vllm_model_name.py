"""Tier 4: a wrong model name gets the same 404 from vLLM 0.32 as from the scripted engine
(``scripted_engine.state.check_model``), on every endpoint the proxy calls that names a
model; and through the proxy, the harness gets the engine's answer."""

from __future__ import annotations

import pytest

from capture_proxy.scripted_engine import ScriptedEngineConfig, build_scripted_engine_app
from tests.realengine.conftest import VLLM_MODEL, RealStack

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
REQUESTS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 4},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
}


@pytest.mark.parametrize("path", list(REQUESTS))
async def test_a_wrong_model_is_the_same_404_from_vllm_and_the_scripted_engine(
    real: RealStack, aiohttp_client, qwen_tokenizer, path
):
    body = {**REQUESTS[path], "model": "gpt-4o"}
    vllm = real.engine.post(path, json=body)
    scripted_app = build_scripted_engine_app(
        ScriptedEngineConfig(model_name=VLLM_MODEL), tokenizer=qwen_tokenizer
    )
    scripted = await (await aiohttp_client(scripted_app)).post(path, json=body)
    assert (vllm.status_code, vllm.json()) == (scripted.status, await scripted.json())
    assert vllm.status_code == 404


async def test_through_the_proxy_a_wrong_model_is_the_engines_404(real: RealStack):
    resp = await real.chat("r1", {**CHAT, "model": "gpt-4o"})
    assert resp.status == 404
    error = (await resp.json())["error"]
    assert error["message"].startswith("The model `gpt-4o` does not exist.")
