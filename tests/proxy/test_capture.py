"""Tier 2: captured calls through the proxy against the scripted engine, exact token ids."""

from __future__ import annotations

import json

import pytest

from capture_proxy.core.sse import SSEStreamDecoder
from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from tests.proxy.conftest import Stack

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def _body(messages, *, stream=False, **extra):
    return {
        "model": "scripted-qwen",
        "messages": messages,
        "tools": TOOLS,
        "stream": stream,
        **extra,
    }


USER = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files."},
]


async def _read_stream(resp) -> tuple[list[dict], bool]:
    decoder = SSEStreamDecoder()
    events = []
    async for data in resp.content.iter_any():
        events += decoder.feed(data)
    events += decoder.close()
    done = bool(events) and events[-1].data == "[DONE]"
    return [json.loads(e.data) for e in events if e.data != "[DONE]"], done


def _assemble(chunks: list[dict]) -> dict:
    content, tool_calls = [], {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or []:
                slot = tool_calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.get("id") or slot["id"]
                slot["name"] += tc.get("function", {}).get("name") or ""
                slot["arguments"] += tc.get("function", {}).get("arguments") or ""
    return {"content": "".join(content), "tool_calls": [tool_calls[i] for i in sorted(tool_calls)]}


async def test_non_streaming_capture_is_exact_and_additive(stack: Stack):
    resp = await stack.chat("r1", _body(USER))
    assert resp.status == 200
    body = await resp.json()
    # The harness sees what it would have seen without the proxy: no token data.
    assert "prompt_token_ids" not in body
    assert set(body["choices"][0]) == {
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
    }
    call_id = resp.headers["X-Capture-Call-Id"]

    sent = stack.sent[0]
    # The proxy asked the engine for token data the harness did not ask for.
    assert sent.request_body["return_token_ids"] is True
    assert sent.request_body["logprobs"] is True and sent.request_body["top_logprobs"] == 0

    call = await stack.get_json(f"/captures/calls/{call_id}")
    assert call["prompt_token_ids"] == sent.prompt_token_ids
    assert call["generation_token_ids"] == sent.generation_token_ids
    assert call["generation_token_ids"][-1] == 151645  # <|im_end|>
    assert call["generation_log_probs"] == pytest.approx(sent.generation_log_probs, rel=0, abs=1e-6)
    assert call["response_message"] == body["choices"][0]["message"]
    assert call["request_messages"] == USER
    assert call["request_tools"] == TOOLS
    assert call["finish_reason"] == "tool_calls"
    assert call["status"] == "complete" and call["diagnostics"] == []
    assert call["usage"] == body["usage"]


@pytest.mark.parametrize("fragment", [None, 1, 7])
async def test_streaming_capture_is_exact_with_events_split_across_chunks(make_stack, fragment):
    stack = await make_stack(engine_config=ScriptedEngineConfig(sse_fragment_bytes=fragment))
    resp = await stack.chat("r1", _body(USER, stream=True))
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    chunks, done = await _read_stream(resp)
    assert done
    # Stripped: no token ids, log probs null, no usage chunk (the harness did not ask).
    assert all("prompt_token_ids" not in c for c in chunks)
    assert all(
        "token_ids" not in ch and ch["logprobs"] is None for c in chunks for ch in c["choices"]
    )
    assert all(c["choices"] for c in chunks)

    sent = stack.sent[0]
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["prompt_token_ids"] == sent.prompt_token_ids
    assert call["generation_token_ids"] == sent.generation_token_ids
    assert len(call["generation_log_probs"]) == len(sent.generation_token_ids)
    assert call["generation_log_probs"] == pytest.approx(sent.generation_log_probs, rel=0, abs=1e-6)
    assembled = _assemble(chunks)
    assert call["response_message"]["tool_calls"] == [
        {
            "id": t["id"],
            "type": "function",
            "function": {"name": t["name"], "arguments": t["arguments"]},
        }
        for t in assembled["tool_calls"]
    ]
    assert call["response_message"]["tool_calls"][0]["function"] == {
        "name": "bash",
        "arguments": '{"command": "ls", "description": "List files"}',
    }
    assert call["stream"] is True and call["status"] == "complete"
    assert call["usage"]["completion_tokens"] == len(sent.generation_token_ids)


async def test_harness_that_asks_for_token_data_gets_it(stack: Stack):
    resp = await stack.chat(
        "r1",
        _body(
            USER,
            stream=True,
            return_token_ids=True,
            logprobs=True,
            stream_options={"include_usage": True},
        ),
    )
    chunks, done = await _read_stream(resp)
    assert done
    assert chunks[0]["prompt_token_ids"] == stack.sent[0].prompt_token_ids
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert ids == stack.sent[0].generation_token_ids
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


async def test_huge_integers_in_extra_fields_are_forwarded_as_sent(stack: Stack):
    # (not ``seed``: a seed past 64 bits is refused, as vLLM refuses it)
    resp = await stack.chat("r1", _body(USER, request_tag=2**70))
    assert resp.status == 200
    assert stack.sent[0].request_body["request_tag"] == 2**70
