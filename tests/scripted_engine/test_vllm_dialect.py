"""Cases where real vLLM 0.32 (tests/realengine, scripts/e2e-vllm) showed the scripted engine's
dialect had to follow it."""

from capture_proxy.scripted_engine import ScriptedEngineConfig, build_scripted_engine_app

THINK_ID = 151667  # <think>


def _history(key: str) -> list[dict]:
    return [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "ok", key: "hmm"},
        {"role": "user", "content": "again"},
    ]


async def test_tokenize_drops_reasoning_content_but_chat_completions_renders_it(
    aiohttp_client, qwen_tokenizer
):
    """vLLM 0.32 renames ``reasoning_content`` to ``reasoning`` in chat completion requests
    only: its chat-form /tokenize ignores ``reasoning_content`` (observed against the real
    server), while ``reasoning`` renders a <think> block in both."""
    app = build_scripted_engine_app(ScriptedEngineConfig(), tokenizer=qwen_tokenizer)
    client = await aiohttp_client(app)

    async def tokenize(key: str) -> list[int]:
        resp = await client.post("/tokenize", json={"messages": _history(key)})
        assert resp.status == 200
        return (await resp.json())["tokens"]

    assert THINK_ID not in await tokenize("reasoning_content")
    with_reasoning = await tokenize("reasoning")
    assert THINK_ID in with_reasoning
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": _history("reasoning_content"), "return_token_ids": True},
    )
    assert resp.status == 200
    assert (await resp.json())["prompt_token_ids"] == with_reasoning
