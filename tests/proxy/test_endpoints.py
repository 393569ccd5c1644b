"""Tier 2: what happens to each endpoint under a capture path (captured, counted, refused,
forwarded), and the error shape each API's caller gets."""

from __future__ import annotations

import pytest

from tests.proxy.conftest import Stack

BASE = "/ng-rollout/r1/training-token-capture"


async def _rollout_calls(stack: Stack) -> int:
    resp = await stack.client.get("/captures/rollouts/r1")
    if resp.status == 404:
        return 0
    return int((await resp.json())["num_calls"])


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "/completions",
        "/generate",
        "/inference/v1/generate",
        "/v1/responses/compact",
    ],
)
async def test_generation_endpoints_it_cannot_capture_are_refused_not_forwarded(
    stack: Stack, path: str
):
    resp = await stack.client.post(BASE + path, json={"model": "scripted-qwen", "prompt": "hi"})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == "endpoint_not_captured"
    assert error["param"] == "path"
    assert path in error["message"]
    assert stack.sent == []  # nothing reached the engine
    assert await _rollout_calls(stack) == 0


async def test_model_listing_and_tokenize_are_forwarded_uncaptured(stack: Stack):
    resp = await stack.client.get(BASE + "/v1/models")
    assert resp.status == 200
    assert (await resp.json())["data"][0]["id"]
    resp = await stack.client.post(BASE + "/tokenize", json={"prompt": "hello"})
    assert resp.status == 200
    assert (await resp.json())["tokens"]
    assert await _rollout_calls(stack) == 0


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/responses", "openai"),
        ("/v1/messages", "anthropic"),
        ("/v1/messages/count_tokens", "anthropic"),  # answered by the proxy, never forwarded
    ],
)
async def test_get_on_a_captured_path_is_a_405_in_the_apis_shape(
    stack: Stack, path: str, shape: str
):
    resp = await stack.client.get(BASE + path)
    assert resp.status == 405
    assert stack.sent == []
    assert resp.headers["Allow"] == "POST"
    body = await resp.json()
    if shape == "anthropic":
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert "GET" in body["error"]["message"]
    else:
        assert body["error"]["code"] == "method_not_allowed"


async def test_bad_json_on_messages_is_an_anthropic_shaped_400(stack: Stack):
    resp = await stack.client.post(
        BASE + "/v1/messages", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    body = await resp.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in body["error"]["message"]


async def test_count_tokens_is_answered_from_the_template_render(stack: Stack, qwen_tokenizer):
    body = {
        "model": "scripted-qwen",
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "Count me."}],
    }
    resp = await stack.client.post(BASE + "/v1/messages/count_tokens", json=body)
    assert resp.status == 200, await resp.text()
    # The scripted engine's /tokenize renders the same ChatML template.
    expected = qwen_tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Count me."},
        ],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    assert await resp.json() == {"input_tokens": len(expected)}
    assert await _rollout_calls(stack) == 0


async def test_count_tokens_names_a_bad_field(stack: Stack):
    body = {"model": "scripted-qwen", "messages": "not a list"}
    resp = await stack.client.post(BASE + "/v1/messages/count_tokens", json=body)
    assert resp.status == 400
    body = await resp.json()
    assert body["type"] == "error"
    assert "messages" in body["error"]["message"]


async def test_unknown_previous_response_id_is_a_400_naming_it(stack: Stack):
    body = {"model": "scripted-qwen", "input": "hi", "previous_response_id": "resp_" + "0" * 32}
    resp = await stack.client.post(BASE + "/v1/responses", json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "previous_response_id"
    assert stack.sent == []


async def test_metrics_count_calls_by_api_and_time_the_engine(stack: Stack):
    chat = {"model": "scripted-qwen", "messages": [{"role": "user", "content": "hi"}]}
    assert (await stack.client.post(BASE + "/v1/chat/completions", json=chat)).status == 200
    responses = {"model": "scripted-qwen", "input": "hi"}
    assert (await stack.client.post(BASE + "/v1/responses", json=responses)).status == 200
    messages = {
        "model": "scripted-qwen",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert (await stack.client.post(BASE + "/v1/messages", json=messages)).status == 200
    text = await (await stack.client.get("/metrics")).text()
    for api in ("chat_completions", "responses", "messages"):
        line = (
            f'capture_proxy_calls_total{{api="{api}",prompt_mode="backend_template",'
            'status="complete"} 1.0'
        )
        assert line in text
    assert "capture_proxy_upstream_first_byte_seconds_count 3.0" in text
    assert "capture_proxy_upstream_seconds_count 3.0" in text
    assert "capture_proxy_calls_in_flight 0.0" in text


async def test_errors_before_any_handler_take_the_apis_shape(make_stack):
    stack = await make_stack(proxy_token="sk-right")
    resp = await stack.client.post(
        BASE + "/v1/messages", json={}, headers={"x-api-key": "sk-wrong"}
    )
    assert resp.status == 401
    body = await resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    resp = await stack.client.post(BASE + "/v1/responses", json={})
    assert resp.status == 401 and set((await resp.json())["error"]) >= {"message", "type"}


async def test_a_trailing_slash_on_a_captured_path_is_refused(stack: Stack):
    chat = {"model": "scripted-qwen", "messages": [{"role": "user", "content": "hi"}]}
    resp = await stack.client.post(BASE + "/v1/chat/completions/", json=chat)
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "endpoint_not_captured"
    assert stack.sent == []


async def test_count_tokens_with_the_engine_down_is_a_502(make_stack, unused_tcp_port):
    from capture_proxy.app import build_proxy_app
    from capture_proxy.config import Settings
    from capture_proxy.store.sqlite import SQLiteStore

    stack = await make_stack()
    settings = Settings(backend=f"http://127.0.0.1:{unused_tcp_port}", store=stack.store_dir)
    app = build_proxy_app(settings, SQLiteStore(stack.store_dir / "down"))
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(app)) as client:
        body = {"model": "scripted-qwen", "messages": [{"role": "user", "content": "hi"}]}
        resp = await client.post(BASE + "/v1/messages/count_tokens", json=body)
        assert resp.status == 502
        assert (await resp.json())["type"] == "error"


async def _raw_post(stack: Stack, raw_path: str, body: bytes) -> tuple[int, dict]:
    """POST ``raw_path`` byte for byte (an HTTP client would normalise dot segments)."""
    import asyncio
    import json

    server = stack.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(
        f"POST {raw_path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


@pytest.mark.parametrize(
    "tail",
    [
        "/v1/chat%2Fcompletions",
        "/v1/chat/completion%73",
        "/v1//chat/completions",
        "/v1/./chat/completions",
        "/v1/x/../chat/completions",
        "/v1/chat/completions/.",
        "/invocations",
    ],
)
async def test_a_generation_path_the_engine_could_read_otherwise_is_refused(
    stack: Stack, tail: str
):
    # Starlette (vLLM, SGLang) routes the decoded path: /v1/chat%2Fcompletions would generate
    # there, uncaptured.
    chat = b'{"model": "scripted-qwen", "messages": [{"role": "user", "content": "hi"}]}'
    status, body = await _raw_post(stack, BASE + tail, chat)
    assert status == 400
    expected = "endpoint_not_captured" if tail == "/invocations" else "path_not_normal"
    assert body["error"]["code"] == expected and body["error"]["param"] == "path"
    assert stack.sent == []
    assert await _rollout_calls(stack) == 0


PREFILL = {
    "model": "scripted-qwen",
    "max_tokens": 32,
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Sure, "},
    ],
}
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.mark.parametrize("mode", ["backend_template", "exact_tokens"])
async def test_an_anthropic_prefill_is_continued_not_answered_as_a_new_turn(
    make_stack, qwen_tokenizer, mode
):
    stack = await make_stack(prompt_mode=mode)
    resp = await stack.client.post(BASE + "/v1/messages", json=PREFILL, headers=ANTHROPIC)
    assert resp.status == 200, await resp.text()
    (sent,) = stack.sent
    if mode == "backend_template":
        assert sent.request_body["continue_final_message"] is True
        assert sent.request_body["add_generation_prompt"] is False
    # the prefill left open (transformers' continue_final_message)
    text = qwen_tokenizer.decode(sent.prompt_token_ids)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure, ")
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["prompt_token_ids"] == sent.prompt_token_ids
    kinds = {d["kind"]: d.get("details") for d in call["diagnostics"]}
    if mode == "exact_tokens":
        assert kinds["exact_prompt_full_render"] == {"reason": "continue_final_message"}


async def test_the_prompt_of_a_prefill_is_the_same_in_both_modes(make_stack, qwen_tokenizer):
    prompts = []
    for mode in ("backend_template", "exact_tokens"):
        stack = await make_stack(prompt_mode=mode)
        resp = await stack.client.post(BASE + "/v1/messages", json=PREFILL, headers=ANTHROPIC)
        assert resp.status == 200
        prompts.append(stack.sent[-1].prompt_token_ids)
    assert prompts[0] == prompts[1]
