"""Tier 2: a Responses answer whose engine deltas interleave kinds (text, a tool call, more
text), through the proxy in front of a small fake vLLM chat engine on a loopback port. The
streamed ``response.completed`` holds exactly the items sent as done; those items (or the whole
answer's), sent back as the next request's input, link to the call."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.api_clients import capture_url

PROMPT = list(range(100, 110))
#: (delta, token id) of the answer: "before", a whole tool call, " after"
DELTAS: list[tuple[dict[str, Any], int]] = [
    ({"content": "before"}, 21),
    (
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_C",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"a": 2}'},
                }
            ]
        },
        22,
    ),
    ({"content": " after"}, 23),
]
GENERATION = [t for _, t in DELTAS]
MESSAGE = {
    "role": "assistant",
    "content": "before after",
    "tool_calls": [
        {"id": "call_C", "type": "function", "function": {"name": "bash", "arguments": '{"a": 2}'}}
    ],
}
TOOLS = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]


def _log_prob(token: int) -> dict[str, Any]:
    return {"token": f"token_id:{token}", "logprob": -0.5, "bytes": None, "top_logprobs": []}


def _fake_engine() -> web.Application:
    """Answers every chat call with ``DELTAS``; the first call's prompt is ``PROMPT``, a later
    one's extends the first call's prompt + generation (the tool output's tokens after it)."""
    calls: list[int] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = PROMPT if not calls else [*PROMPT, *GENERATION, 7, 8]
        calls.append(1)
        head = {"id": "chatcmpl-x", "created": 1, "model": body["model"]}
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(DELTAS),
            "total_tokens": len(prompt) + len(DELTAS),
        }
        if not body.get("stream"):
            choice = {
                "index": 0,
                "message": MESSAGE,
                "finish_reason": "tool_calls",
                "token_ids": GENERATION,
                "logprobs": {"content": [_log_prob(t) for t in GENERATION]},
            }
            return web.json_response(
                {
                    **head,
                    "object": "chat.completion",
                    "prompt_token_ids": prompt,
                    "usage": usage,
                    "choices": [choice],
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(chunk: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        await send({**head, "object": "chat.completion.chunk", "prompt_token_ids": prompt,
                    "choices": [first]})  # fmt: skip
        for i, (delta, token) in enumerate(DELTAS):
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": [_log_prob(token)]},
                "token_ids": [token],
                "finish_reason": "tool_calls" if i == len(DELTAS) - 1 else None,
            }
            await send({**head, "object": "chat.completion.chunk", "choices": [choice]})
        await send({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": 4096}]}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def _text(item: dict[str, Any]) -> str:
    return item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_interleaved_answer_is_one_transcript_and_links(
    aiohttp_server, aiohttp_client, tmp_path, stream
):
    engine = await aiohttp_server(_fake_engine())
    settings = Settings(backend=str(engine.make_url("/")).rstrip("/"), store=tmp_path / "s")
    client = await aiohttp_client(build_proxy_app(settings, SQLiteStore(tmp_path / "s")))
    url = capture_url("r1", "responses")
    user = {"role": "user", "content": "x"}
    body = {"model": "fake", "input": [user], "tools": TOOLS, "stream": stream}
    resp = await client.post(url, json=body)
    assert resp.status == 200
    first = resp.headers["x-capture-call-id"]
    base = first.removeprefix("call-")
    if stream:
        events = _events(await resp.text())
        items = [d["item"] for e, d in events if e == "response.output_item.done"]
        assert events[-1][0] == "response.completed"
        assert events[-1][1]["response"]["output"] == items
        assert [(i["id"], _text(i)) for i in items] == [
            (f"msg_{base}", "before"),
            (f"fc_{base}_0", '{"a": 2}'),
            (f"msg_{base}_2", " after"),
        ]
    else:
        items = (await resp.json())["output"]
        assert [(i["id"], _text(i)) for i in items] == [
            (f"msg_{base}", "before after"),
            (f"fc_{base}_0", '{"a": 2}'),
        ]
    stored = await (await client.get(f"/captures/calls/{first}")).json()
    assert stored["response_message"] == MESSAGE
    # The items sent back as received (as Codex does), then the tool's output.
    output = {"type": "function_call_output", "call_id": "call_C", "output": "ok"}
    body = {"model": "fake", "input": [user, *items, output], "tools": TOOLS}
    resp = await client.post(url, json=body)
    assert resp.status == 200
    second = await (await client.get(f"/captures/calls/{resp.headers['x-capture-call-id']}")).json()
    assert second["request_messages"][1] == MESSAGE
    assert second["linking"]["verdict"] == "resolved"
    assert second["parent_call_id"] == first
