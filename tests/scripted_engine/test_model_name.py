"""The scripted engine refuses a model it does not serve, as vLLM 0.32 does (issue 34).

vLLM's ``OpenAIServing._check_model`` (``vllm/entrypoints/serve/engine/serving.py``) answers
chat and text completions, ``/tokenize``, ``/detokenize`` and the tokens-in
``/inference/v1/generate`` with a 404 naming the served names; no ``model`` (or an empty one)
is the served model. So a test that sends a wrong name fails here as it would on vLLM.
"""

from __future__ import annotations

import pytest

from capture_proxy.scripted_engine import ScriptedEngineConfig, build_scripted_engine_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
REQUESTS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 4},
    "/inference/v1/generate": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}},
    "/tokenize": {"prompt": "hi"},
    "/tokenize ": CHAT,  # the chat form (the trailing space only tells the cases apart)
    "/detokenize": {"tokens": [1, 2, 3]},
}


@pytest.fixture
def make_client(aiohttp_client, qwen_tokenizer):
    async def make(**kw):
        config = ScriptedEngineConfig(enable_scale_out=True, **kw)
        return await aiohttp_client(build_scripted_engine_app(config, tokenizer=qwen_tokenizer))

    return make


@pytest.mark.parametrize("path", list(REQUESTS))
async def test_a_model_it_does_not_serve_is_vllms_404(make_client, path):
    client = await make_client()
    resp = await client.post(path.strip(), json={**REQUESTS[path], "model": "gpt-4o"})
    assert resp.status == 404
    assert await resp.json() == {
        "error": {
            "message": "The model `gpt-4o` does not exist. Valid aliases: scripted-qwen.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize("model", [None, "", "scripted-qwen", "qwen-alias"])
@pytest.mark.parametrize("path", list(REQUESTS))
async def test_the_served_names_and_no_name_are_served(make_client, path, model):
    client = await make_client(model_aliases=("qwen-alias",))
    body = dict(REQUESTS[path])
    if model is not None:
        body["model"] = model
    resp = await client.post(path.strip(), json=body)
    assert resp.status == 200, await resp.text()


async def test_every_served_name_is_listed_and_named_in_the_404(make_client):
    client = await make_client(model_name="small", model_aliases=("big",))
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["small", "big"]
    resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "scripted-qwen"})
    assert resp.status == 404
    message = (await resp.json())["error"]["message"]
    assert message == "The model `scripted-qwen` does not exist. Valid aliases: small, big."
