"""Images through the proxy on the scripted engine (backend-template mode).

A session per API (chat completions, Responses, Anthropic Messages), streamed and not: a task
with an image, a tool result with another image, then one with the first image again. The
engine (a Qwen-VL processor's arithmetic) expands each image into its placeholder tokens; the
records must hold the engine's ids, each image's span in them, the processor params that
rebuild the pixel input, one chain, and each image's bytes once in the store.
"""

from __future__ import annotations

import base64
import hashlib
import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from capture_proxy.core.image_spans import image_runs
from capture_proxy.families.vision import (
    IMAGE_PAD_ID,
    QWEN3_VL_PROCESSOR,
    image_placeholder,
    rebuild_pixel_values,
)
from tests.proxy.api_clients import MODEL, capture_url, harness
from tests.proxy.conftest import ON_BOTH_STORES, MakeStack, Stack

SETTINGS: dict[str, Any] = {"image_processors": {MODEL: "qwen3_vl"}}
APIS = ["chat_completions", "responses", "messages"]


def png(height: int, width: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(api: str, data: bytes) -> dict[str, Any]:
    """One image in the API's own content-part form."""
    if api == "chat_completions":
        return {"type": "image_url", "image_url": {"url": data_url(data)}}
    if api == "responses":
        return {"type": "input_image", "image_url": data_url(data), "detail": "auto"}
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


def text_part(api: str, text: str) -> dict[str, Any]:
    return {"type": "input_text" if api == "responses" else "text", "text": text}


def user_with_image(api: str, text: str, data: bytes) -> dict[str, Any]:
    content = [text_part(api, text), image_part(api, data)]
    if api == "responses":
        return {"type": "message", "role": "user", "content": content}
    return {"role": "user", "content": content}


def tool_results_with_image(api: str, calls: list[Any], data: bytes) -> list[dict[str, Any]]:
    """A result per tool call, the first one with ``data`` as an image."""
    out: list[dict[str, Any]] = []
    for i, (tid, _name, _args) in enumerate(calls):
        parts = [text_part(api, f"result {i}")]
        if i == 0:
            parts.append(image_part(api, data))
        if api == "chat_completions":
            out.append({"role": "tool", "tool_call_id": tid, "content": parts})
        elif api == "responses":
            out.append({"type": "function_call_output", "call_id": tid, "output": parts})
        else:
            out.append({"type": "tool_result", "tool_use_id": tid, "content": parts})
    if api == "messages":
        return [{"role": "user", "content": out}]
    return out


A, B = png(100, 100, 1), png(64, 96, 2)
BIG = png(640, 640, 4)  # about 1.2 MB: a remote fetch of many reads


async def run_session(stack: Stack, api: str, rollout: str, stream: bool) -> list[str]:
    """The three-call session; returns the call ids in order."""
    h = harness(api, stack, rollout, stream=stream)
    h.history = [user_with_image(api, "What is in the picture?", A)]
    call_ids = []
    for image in (B, A):
        reply = await h.send()
        assert reply.status == 200, reply.body
        assert reply.tool_calls, reply
        call_ids.append(reply.call_id)
        h.append_turn(reply)
        h.history += tool_results_with_image(api, reply.tool_calls, image)
    reply = await h.send()
    assert reply.status == 200, reply.body
    call_ids.append(reply.call_id)
    return call_ids


async def chain_calls(stack: Stack, rollout: str) -> list[dict[str, Any]]:
    chains = await stack.get_json(f"/captures/rollouts/{rollout}/chains")
    assert len(chains["chains"]) == 1, chains
    return list(chains["chains"][0]["calls"])


@ON_BOTH_STORES
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", APIS)
async def test_a_session_with_images_is_one_chain_with_exact_spans(
    make_stack: MakeStack, api: str, stream: bool
) -> None:
    stack = await make_stack(**SETTINGS)
    rollout = f"img-{api}-{int(stream)}"
    call_ids = await run_session(stack, api, rollout, stream)
    calls = await chain_calls(stack, rollout)
    assert [c["call_id"] for c in calls] == call_ids
    assert [c["parent_call_id"] for c in calls] == [None, *call_ids[:2]]
    assert len(stack.sent) == 3
    expected = [[A], [A, B], [A, B, A]]
    for call, sent, images in zip(calls, stack.sent, expected, strict=True):
        assert call["status"] == "complete" and call["diagnostics"] == []
        # the record's prompt is the engine's, its images expanded by the engine
        assert call["prompt_token_ids"] == sent.prompt_token_ids
        runs = image_runs(np.asarray(sent.prompt_token_ids))
        assert [(e["prompt_start"], e["prompt_end"]) for e in call["images"]] == runs
        assert [e["sha256"] for e in call["images"]] == [sha(d) for d in images]
        for entry, data in zip(call["images"], images, strict=True):
            size = Image.open(io.BytesIO(data)).size
            placeholder = image_placeholder(size[1], size[0], QWEN3_VL_PROCESSOR)
            start, end = entry["prompt_start"], entry["prompt_end"]
            assert end - start == placeholder.num_tokens
            assert set(sent.prompt_token_ids[start:end]) == {IMAGE_PAD_ID}
            assert entry["processor"] == placeholder.processor_params()
            pixels = rebuild_pixel_values(data, entry["processor"], "pil")
            assert pixels.shape[0] == (end - start) * QWEN3_VL_PROCESSOR.merge_size**2
        # the engine was sent the bytes themselves
        sent_urls = [
            p["image_url"]["url"]
            for m in sent.request_body["messages"]
            if isinstance(m.get("content"), list)
            for p in m["content"]
            if p.get("type") == "image_url"
        ]
        assert sent_urls == [data_url(d) for d in images]
    for data in (A, B):
        resp = await stack.client.get(f"/captures/images/{sha(data)}")
        assert resp.status == 200 and resp.content_type == "image/png"
        assert await resp.read() == data


async def test_other_images_of_the_same_size_never_link(make_stack: MakeStack) -> None:
    """The same tokens (an image's placeholders depend on its size only) but another image:
    no digest link, and no token-prefix link either."""
    stack = await make_stack(**SETTINGS)
    other = png(100, 100, 99)  # A's size, other pixels
    for rollout, first in (("same", A), ("swapped", other)):
        h = harness("chat_completions", stack, rollout, stream=False)
        h.history = [user_with_image("chat_completions", "What is it?", A)]
        reply = await h.send()
        h.append_turn(reply)
        h.history[0] = user_with_image("chat_completions", "What is it?", first)
        h.append_tool_results([(tid, "ok") for tid, _, _ in reply.tool_calls])
        second = await h.send()
        assert second.status == 200
        record = await stack.get_json(f"/captures/calls/{second.call_id}")
        if rollout == "same":
            assert record["parent_call_id"] == reply.call_id
        else:
            assert record["parent_call_id"] is None
            assert record["linking"]["verdict"] == "unresolved"
            # the tokens do chain: only the images tell the calls apart
            parent = await stack.get_json(f"/captures/calls/{reply.call_id}")
            head = parent["prompt_token_ids"] + parent["generation_token_ids"]
            assert record["prompt_token_ids"][: len(head)] == head


@pytest.mark.parametrize(
    ("api", "body", "param"),
    [
        (
            "chat_completions",
            {
                "messages": [
                    {"role": "user", "content": [image_part("chat_completions", b"\0" * 9)]}
                ]
            },
            "messages.0.content.0.image_url.url",
        ),
        (
            "chat_completions",
            {"messages": [{"role": "system", "content": [image_part("chat_completions", A)]}]},
            "messages.0.content.0.image_url.url",
        ),
        (
            "responses",
            {
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_image", "file_id": "f"}],
                    }
                ]
            },
            "input.0.content.0.file_id",
        ),
        (
            "messages",
            {
                "max_tokens": 16,
                "messages": [{"role": "user", "content": [image_part("messages", A)] * 3}],
            },
            "messages.0.content.2.source.data",
        ),
    ],
)
async def test_refused_images_are_a_400_naming_the_field(
    make_stack: MakeStack, api: str, body: dict[str, Any], param: str
) -> None:
    stack = await make_stack(**SETTINGS, images_per_call_max=2)
    resp = await stack.client.post(capture_url("refused", api), json={"model": MODEL, **body})
    assert resp.status == 400
    error = await resp.json()
    if api == "messages":
        assert error["type"] == "error" and error["error"]["message"].startswith(param)
    else:
        assert error["error"]["param"] == param
    assert stack.sent == []


async def test_an_image_url_that_is_a_string_is_a_400_naming_it(make_stack: MakeStack) -> None:
    stack = await make_stack(**SETTINGS)
    url = image_part("chat_completions", A)["image_url"]["url"]
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": url}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    resp = await stack.chat("string-url", body)
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": "'messages.0.content.1.image_url': must be an object with a \"url\" "
        '({"url": "data:image/png;base64,..."}), got a string',
        "type": "invalid_request_error",
        "param": "messages.0.content.1.image_url",
        "code": "invalid_request",
    }
    assert stack.sent == []


async def test_a_model_without_image_processor_refuses_images(make_stack: MakeStack) -> None:
    stack = await make_stack()
    body = {"model": MODEL, "messages": [user_with_image("chat_completions", "x", A)]}
    resp = await stack.chat("no-processor", body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "image_processors" in error["message"]
    assert error["param"] == "messages.0.content.1.image_url.url"
    small = await make_stack(**SETTINGS, image_max_bytes=1000)
    resp = await small.chat("too-big", body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "image_max_bytes" in error["message"]


async def test_remote_images_are_fetched_only_when_allowed(make_stack, aiohttp_server) -> None:
    from aiohttp import web

    async def serve(request: web.Request) -> web.Response:
        if request.match_info["name"] == "b.png":
            return web.Response(body=B, content_type="image/png")
        if request.match_info["name"] == "big.png":
            return web.Response(body=BIG, content_type="image/png")
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/{name}", serve)
    server = await aiohttp_server(app)
    stack = await make_stack(
        **SETTINGS, image_fetch_remote=True, image_url_schemes=["data", "http"]
    )
    url = str(server.make_url("/b.png"))
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    resp = await stack.chat("remote", body)
    assert resp.status == 200, await resp.text()
    record = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert [e["sha256"] for e in record["images"]] == [sha(B)]
    assert record["request_messages"][0]["content"][1]["sha256"] == sha(B)
    sent = stack.sent[0].request_body["messages"][0]["content"][1]
    assert sent == {"type": "image_url", "image_url": {"url": data_url(B)}}
    # an image of many reads (1.3 MB) arrives whole
    content[1] = {"type": "image_url", "image_url": {"url": str(server.make_url("/big.png"))}}
    resp = await stack.chat("remote", body)
    assert resp.status == 200, await resp.text()
    record = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert [e["sha256"] for e in record["images"]] == [sha(BIG)]
    for name, message in (("gone.png", "answered 404"), ("big.png", "image_max_bytes")):
        small = await make_stack(
            **SETTINGS,
            image_fetch_remote=True,
            image_url_schemes=["http"],
            image_max_bytes=len(BIG) - 1,
        )
        content[1] = {"type": "image_url", "image_url": {"url": str(server.make_url(f"/{name}"))}}
        resp = await small.chat("remote", body)
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "messages.0.content.1.image_url.url"
        assert message in error["message"]


async def test_previous_response_id_history_gets_its_images_from_the_store(
    make_stack: MakeStack,
) -> None:
    stack = await make_stack(**SETTINGS)
    first = {"model": MODEL, "input": [user_with_image("responses", "look", A)], "store": True}
    resp = await stack.client.post(capture_url("prev", "responses"), json=first)
    assert resp.status == 200
    response_id = (await resp.json())["id"]
    second = {"model": MODEL, "previous_response_id": response_id, "input": "and now?"}
    resp = await stack.client.post(capture_url("prev", "responses"), json=second)
    assert resp.status == 200, await resp.text()
    record = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert [e["sha256"] for e in record["images"]] == [sha(A)]
    assert record["parent_call_id"] is not None
    sent = stack.sent[1].request_body["messages"]
    assert any(
        p.get("image_url", {}).get("url") == data_url(A)
        for m in sent
        if isinstance(m.get("content"), list)
        for p in m["content"]
    )


async def test_count_tokens_counts_the_image_tokens(make_stack: MakeStack) -> None:
    stack = await make_stack(**SETTINGS)
    body = {"model": MODEL, "max_tokens": 16, "messages": [user_with_image("messages", "x", B)]}
    base = "/ng-rollout/count/training-token-capture/v1/messages"
    counted = await stack.client.post(base + "/count_tokens", json=body)
    assert counted.status == 200, await counted.text()
    resp = await stack.client.post(base, json=body)
    assert resp.status == 200
    record = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert (await counted.json())["input_tokens"] == record["num_prompt_tokens"]
    assert record["num_prompt_tokens"] > image_placeholder(64, 96, QWEN3_VL_PROCESSOR).num_tokens
