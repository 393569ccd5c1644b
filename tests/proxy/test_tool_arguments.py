"""Tier 2: tool-call arguments in the history as vLLM 0.32 takes them, through the proxy
against the scripted engine. A streaming SDK assembles ``""`` for a call without argument
deltas, and a harness may send back a model's malformed call: vLLM renders both as ``{}``
(``chat_utils._postprocess_messages``), so the proxy takes them (no 400), keeps the text as
sent, and in exact-token mode renders the prompt the engine would."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.proxy.api_clients import capture_url

MODES = ["backend_template", "exact_tokens"]
USER = {"role": "user", "content": "List the files."}


def _history(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": arguments}}
    return [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    ]


@pytest.mark.parametrize("arguments", ["", "{oops", "[]"], ids=["empty", "malformed", "list"])
@pytest.mark.parametrize("mode", MODES)
async def test_history_arguments_vllm_coerces_are_taken(make_stack, mode, arguments):
    stack = await make_stack(prompt_mode=mode)
    messages = _history(arguments)
    resp = await stack.chat("r1", {"model": "scripted-qwen", "messages": messages})
    assert resp.status == 200, await resp.text()
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["request_messages"][1]["tool_calls"][0]["function"]["arguments"] == arguments
    coerced = _history("{}")
    async with aiohttp.ClientSession() as session:
        url = stack.engine.make_url("/tokenize")
        async with session.post(url, json={"messages": coerced}) as got:
            assert call["prompt_token_ids"] == (await got.json())["tokens"]


@pytest.mark.parametrize("mode", MODES)
async def test_a_responses_function_call_without_arguments_is_taken(make_stack, mode):
    stack = await make_stack(prompt_mode=mode)
    body = {
        "model": "scripted-qwen",
        "input": [
            {"type": "message", "role": "user", "content": USER["content"]},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": ""},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        ],
    }
    resp = await stack.client.post(capture_url("r1", "responses"), json=body)
    assert resp.status == 200, await resp.text()
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    (tool_call,) = call["request_messages"][1]["tool_calls"]
    assert tool_call["function"] == {"name": "ls", "arguments": ""}  # kept as sent
    # rendered as vLLM renders the same chat messages, the arguments as {}
    async with aiohttp.ClientSession() as session:
        url = stack.engine.make_url("/tokenize")
        async with session.post(url, json={"messages": _history("{}")}) as got:
            assert call["prompt_token_ids"] == (await got.json())["tokens"]
