"""Tier 2: one contract, three wire APIs (chat completions, Responses, Anthropic Messages), both
prompt modes, streamed or not. Each API is driven by a small client of its own shape
(``api_clients``); the proxy sits in front of the scripted engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from capture_proxy.core.fronts.base import open_reasoning, seal_reasoning
from capture_proxy.scripted_engine import Faults, Policy, ScriptedEngineConfig
from capture_proxy.scripted_engine.tokens_in import wire as tokens_in_wire
from tests.factories import answered_content
from tests.proxy.api_clients import (
    MODEL,
    SYSTEM,
    TASK,
    Harness,
    Reply,
    capture_url,
    harness,
)
from tests.proxy.conftest import Stack

APIS = ["chat_completions", "responses", "messages"]
MODES = ["backend_template", "exact_tokens"]

STEPS: list[dict[str, Any]] = [
    {
        "reasoning": "I should list the files first.",
        "content": "Listing the files.",
        "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}],
    },
    {
        "reasoning": "Now the notes.",
        "tool_calls": [{"name": "read", "arguments": {"filePath": "notes.txt"}}],
    },
    {"reasoning": "Both are done.", "content": "Done: two files, and the notes say hi."},
]
POLICY = Policy.model_validate({"steps": STEPS})
# The same session, every turn sampled one character at a time (ids the tokenizer would
# never produce for that text).
SPLIT_POLICY = Policy.model_validate({"steps": [{**s, "token_split": "characters"} for s in STEPS]})
#: what the harness should read from each answer in exact-token mode: (content, reasoning,
#: [(tool, arguments)]); the content is what vLLM's hermes parser answers (the text before the
#: first <tool_call>, its separating newline included)
EXPECTED = [
    (
        answered_content(s.get("content", ""), s.get("tool_calls")),
        s["reasoning"],
        [(t["name"], t["arguments"]) for t in s.get("tool_calls", [])],
    )
    for s in STEPS
]
#: the same from the scripted engine in backend-template mode: the policy's message itself
#: (the scripted engine does not reproduce the hermes parser's newline)
BACKEND_EXPECTED = [
    (s.get("content", ""), *rest) for s, (_, *rest) in zip(STEPS, EXPECTED, strict=True)
]
FINISH = ["tool_calls", "tool_calls", "stop"]


async def _stack(make_stack, mode: str, **engine: Any) -> Stack:
    engine.setdefault("policy", POLICY)
    return await make_stack(engine_config=ScriptedEngineConfig(**engine), prompt_mode=mode)


async def _chains(stack: Stack, rollout: str = "r1") -> dict:
    return await stack.get_json(f"/captures/rollouts/{rollout}/chains")


async def _call(stack: Stack, call_id: str) -> dict:
    return await stack.get_json(f"/captures/calls/{call_id}")


def _hex(call_id: str) -> str:
    assert call_id.startswith("call-")
    return call_id.removeprefix("call-")


def _answer_id(api: str, reply: Reply) -> str | None:
    """The API's own id of the answer, as the harness sees it."""
    if api == "chat_completions":
        if reply.events:
            return reply.events[0].data["id"]
        return reply.body["id"]
    if api == "responses":
        return reply.body["id"]  # the completed response (stream) or the whole one
    if reply.events:
        return reply.events[0].data["message"]["id"]
    return reply.body["id"]


ANSWER_ID_PREFIX = {"chat_completions": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


def _check_clean_end(api: str, reply: Reply) -> None:
    names = [
        e.name or (e.data.get("type") if isinstance(e.data, dict) else e.data) for e in reply.events
    ]
    if api == "chat_completions":
        assert reply.events[-1].data == "[DONE]"
    elif api == "responses":
        assert names[0] == "response.created"
        assert names[-1] == "response.completed"
        assert "error" not in names and "response.failed" not in names
    else:
        assert names[0] == "message_start"
        assert names[-2:] == ["message_delta", "message_stop"]


async def _session(h: Harness) -> list[Reply]:
    return [await h.step() for _ in range(3)]


async def _check_one_chain(stack: Stack, api: str, replies: list[Reply]) -> list[dict]:
    ids = [r.call_id for r in replies]
    chains = await _chains(stack)
    assert chains["incomplete"] is False
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [ids]
    assert chains["unlinked_calls"] == []
    calls = chains["chains"][0]["calls"]
    assert [c["parent_call_id"] for c in calls] == [None, ids[0], ids[1]]
    assert [c["linking"]["verdict"] for c in calls] == ["root", "resolved", "resolved"]
    for parent, child in zip(calls, calls[1:], strict=False):
        prefix = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert child["prompt_token_ids"][: len(prefix)] == prefix
        assert len(child["prompt_token_ids"]) > len(prefix)
    # Stored ids are exactly what the engine saw and sampled.
    assert len(stack.sent) == 3
    assert [c["prompt_token_ids"] for c in calls] == [s.prompt_token_ids for s in stack.sent]
    assert [c["generation_token_ids"] for c in calls] == [
        s.generation_token_ids for s in stack.sent
    ]
    for call_id in ids:
        detail = await _call(stack, call_id)
        assert detail["api"] == api
        assert detail["status"] == "complete"
    assert [c["finish_reason"] for c in calls] == FINISH
    return calls


def _check_answers(api: str, mode: str, replies: list[Reply]) -> None:
    expected = BACKEND_EXPECTED if mode == "backend_template" else EXPECTED
    for reply, (content, reasoning, tools) in zip(replies, expected, strict=True):
        assert reply.status == 200
        assert reply.call_id is not None
        answer_id = _answer_id(api, reply)
        if api == "chat_completions" and mode == "backend_template":
            # the engine's own answer, relayed (capture is additive): the engine's id
            assert answer_id.startswith("chatcmpl-")
            assert _hex(reply.call_id) not in answer_id
        elif api == "chat_completions":
            assert answer_id == "chatcmpl-" + reply.call_id
        else:
            assert answer_id == ANSWER_ID_PREFIX[api] + _hex(reply.call_id)
        assert reply.content == content
        assert reply.reasoning == reasoning
        assert [(name, args) for _, name, args in reply.tool_calls] == tools
        if reply.events:
            _check_clean_end(api, reply)
    assert len({r.call_id for r in replies}) == 3


# -- 1. a three-step tool-using session with reasoning -----------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
async def test_tool_session_is_one_exact_chain(make_stack, api, mode, stream):
    stack = await _stack(make_stack, mode)
    replies = await _session(harness(api, stack, "r1", stream=stream))
    _check_answers(api, mode, replies)
    calls = await _check_one_chain(stack, api, replies)
    # What the engine got: the canonical conversation of the API's request.
    if mode == "backend_template":
        first = stack.sent[0].request_body["messages"]
        assert first[:2] == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TASK},
        ]
        assert [t["function"]["name"] for t in stack.sent[0].request_body["tools"]] == [
            "bash",
            "read",
        ]
    else:
        assert all("messages" not in s.request_body for s in stack.sent)
    assert [c["response_message"].get("reasoning_content") for c in calls] == [
        s["reasoning"] for s in STEPS
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", APIS)
async def test_non_canonical_token_split_is_one_chain_in_exact_mode(
    make_stack, qwen_tokenizer, api, stream
):
    stack = await _stack(make_stack, "exact_tokens", policy=SPLIT_POLICY)
    replies = await _session(harness(api, stack, "r1", stream=stream))
    _check_answers(api, "exact_tokens", replies)
    await _check_one_chain(stack, api, replies)
    # The split really is not the tokenizer's: the content's own encoding is not in the ids.
    canonical = qwen_tokenizer.encode(STEPS[0]["content"], add_special_tokens=False)
    generated = stack.sent[0].generation_token_ids
    assert len(canonical) > 1
    assert not any(generated[i : i + len(canonical)] == canonical for i in range(len(generated)))


# -- 2. engine errors ------------------------------------------------------------------------


def _check_error_shape(api: str, body: Any, status: int) -> str:
    """The API's error shape; returns the message."""
    if api == "messages":
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
        expected_type = {400: "invalid_request_error", 500: "api_error", 502: "api_error"}
        assert body["error"]["type"] == expected_type[status]
        return body["error"]["message"]
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["message"]


async def _stored_calls(stack: Stack, rollout: str = "r1") -> list[dict]:
    chains = await _chains(stack, rollout)
    listed = [c for ch in chains["chains"] for c in ch["calls"]] + chains["unlinked_calls"]
    return [await _call(stack, c["call_id"]) for c in listed]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fault", ["engine_400", "engine_500", "backend_down"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
async def test_engine_errors_come_in_the_api_error_shape(make_stack, api, mode, fault, stream):
    if fault == "backend_down":
        stack = await _stack(make_stack, mode)
        await stack.engine.close()
        status = 502
    else:
        status = int(fault.removeprefix("engine_"))
        stack = await _stack(make_stack, mode, fail_status=status)
    h = harness(api, stack, "r1", stream=stream)
    reply = await h.send()
    assert reply.status == status
    assert reply.events == []  # the error comes before any stream: a JSON body
    message = _check_error_shape(api, reply.body, status)
    if fault == "backend_down":
        assert message.startswith("engine at ") and "is unreachable" in message
    elif api == "chat_completions":
        # the engine's own OpenAI-shaped error, as it sent it
        kind = "invalid_request_error" if status < 500 else "server_error"
        assert reply.body == {
            "error": {"message": "scripted failure", "type": kind, "param": None, "code": status}
        }
    elif api == "responses":
        kind = "invalid_request_error" if status < 500 else "upstream_error"
        assert reply.body == {
            "error": {
                "message": f"engine returned {status}: scripted failure",
                "type": kind,
                "param": None,
                "code": None,
            }
        }
    else:
        kind = "invalid_request_error" if status < 500 else "api_error"
        assert reply.body == {
            "type": "error",
            "error": {"type": kind, "message": f"engine returned {status}: scripted failure"},
        }
    if fault != "backend_down":
        assert reply.call_id is not None
    [call] = await _stored_calls(stack)
    assert call["status"] == "failed"
    assert call["api"] == api
    if reply.call_id is not None:
        assert call["call_id"] == reply.call_id
    assert stack.sent == []


# -- 3. bad input ----------------------------------------------------------------------------

_IMAGE_URL = "https://example.com/cat.png"
_HI = {"role": "user", "content": "hi"}
BAD_BODIES: dict[str, list[tuple[str, dict[str, Any], str]]] = {
    # (case, body, the field the error names)
    "chat_completions": [
        ("missing_messages", {"model": MODEL}, "messages"),
        ("messages_not_a_list", {"model": MODEL, "messages": "hi"}, "messages"),
        (
            "remote_image_not_fetched",  # (image_fetch_remote is off by default)
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": _IMAGE_URL}}],
                    }
                ],
            },
            "messages.0.content.0.image_url.url",
        ),
        ("n_2", {"model": MODEL, "n": 2, "messages": [{"role": "user", "content": "hi"}]}, "n"),
        *(
            (f"{field}_{case}", {"model": MODEL, field: value, "messages": [_HI]}, param)
            for field, case, value, param in [
                ("temperature", "a_string", "hot", "temperature"),
                ("temperature", "past_2", 2.5, "temperature"),
                ("top_p", "a_list", [], "top_p"),
                ("stop", "a_number", 5, "stop"),
                ("seed", "a_string", "x", "seed"),
                ("logit_bias", "a_list", [1], "logit_bias"),
                ("logit_bias", "a_word_key", {"hello": 1}, "logit_bias"),
                ("top_k", "a_float", 1.5, "top_k"),
                (
                    "tools",
                    "a_nameless_function",
                    [{"type": "function", "function": {}}],
                    "tools.0.function.name",
                ),
                ("tool_choice", "a_number", 5, "tool_choice"),
            ]
        ),
    ],
    "responses": [
        ("missing_model", {"input": "hi"}, "model"),
        ("missing_input", {"model": MODEL}, "input"),
        ("input_not_a_list", {"model": MODEL, "input": 5}, "input"),
        (
            "remote_image_not_fetched",
            {
                "model": MODEL,
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": _IMAGE_URL}],
                    }
                ],
            },
            "input.0.content.0.image_url",
        ),
        (
            "unknown_previous_response",
            {"model": MODEL, "input": "hi", "previous_response_id": "resp_" + "0" * 32},
            "previous_response_id",
        ),
        ("temperature_past_2", {"model": MODEL, "input": "hi", "temperature": 3}, "temperature"),
        # answered in the request, kept for no poll: refused rather than answered as completed
        ("background", {"model": MODEL, "input": "hi", "background": True}, "background"),
        ("top_p_0", {"model": MODEL, "input": "hi", "top_p": 0}, "top_p"),
    ],
    "messages": [
        (
            "missing_max_tokens",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            "max_tokens",
        ),
        ("missing_messages", {"model": MODEL, "max_tokens": 64}, "messages"),
        (
            "max_tokens_not_an_integer",
            {"model": MODEL, "max_tokens": "64", "messages": [{"role": "user", "content": "hi"}]},
            "max_tokens",
        ),
        (
            "remote_image_not_fetched",
            {
                "model": MODEL,
                "max_tokens": 64,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": _IMAGE_URL}}
                        ],
                    }
                ],
            },
            "messages.0.content.0.source.url",
        ),
        (
            "tool_role_in_messages",
            {"model": MODEL, "max_tokens": 64, "messages": [{"role": "tool", "content": "x"}]},
            "messages.0.role",
        ),
        *(
            (f"{field}_{case}", {"model": MODEL, "max_tokens": 64, field: v, "messages": [_HI]}, p)
            for field, case, v, p in [
                ("temperature", "past_1", 1.5, "temperature"),
                ("top_p", "a_string", "0.9", "top_p"),
                ("top_k", "negative", -1, "top_k"),
                ("stop_sequences", "an_empty_one", ["END", ""], "stop_sequences.1"),
            ]
        ),
    ],
}
BAD_CASES = [(api, *case) for api, cases in BAD_BODIES.items() for case in cases]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("api", "case", "body", "param"), BAD_CASES, ids=[f"{a}-{c}" for a, c, _, _ in BAD_CASES]
)
async def test_bad_input_is_a_400_naming_the_field(make_stack, api, case, body, param, mode):
    stack = await _stack(make_stack, mode)
    resp = await stack.client.post(capture_url("r1", api), json=body)
    assert resp.status == 400
    assert "X-Capture-Call-Id" not in resp.headers
    error = await resp.json()
    message = _check_error_shape(api, error, 400)
    if api == "messages":
        assert message.startswith(f"{param}: ")
    else:
        assert error["error"]["param"] == param
        assert error["error"]["type"] == "invalid_request_error"
        assert f"'{param}'" in message or param in message
    assert stack.sent == []
    await stack.get_json("/captures/rollouts/r1", status=404)
    assert (await stack.get_json("/captures/rollouts"))["rollouts"] == []


# -- 4. a broken engine stream ---------------------------------------------------------------


def _faulty_tokens_in_sse(faults: Faults):
    """The tokens-in endpoints' SSE writer with ``faults`` applied (the scripted engine
    injects stream faults into chat completions only)."""

    async def sse(request: web.Request, events: list[Any], gate: Any = None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k, event in enumerate(events):
            obj = event() if callable(event) else event
            if faults.disconnect_after_chunks is not None and k >= faults.disconnect_after_chunks:
                assert request.transport is not None
                request.transport.close()
                return resp
            if faults.malformed_chunk_at == k:
                await resp.write(b"data: {not json\n\n")
                continue
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return sse


STREAM_FAULTS = {
    "disconnect": (Faults(disconnect_after_chunks=3), "engine stream broke"),
    "malformed": (Faults(malformed_chunk_at=2), "engine sent a malformed stream event"),
}


@pytest.mark.parametrize("fault", list(STREAM_FAULTS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
async def test_broken_engine_stream_ends_with_an_in_band_error(
    make_stack, monkeypatch, api, mode, fault
):
    faults, reason = STREAM_FAULTS[fault]
    monkeypatch.setattr(tokens_in_wire, "sse", _faulty_tokens_in_sse(faults))
    stack = await _stack(make_stack, mode, faults=faults)
    reply = await harness(api, stack, "r1", stream=True).send()
    assert reply.status == 200  # the headers went out before the fault
    names = [e.name for e in reply.events]
    last = reply.events[-1].data
    if api == "chat_completions":
        assert "[DONE]" not in [e.data for e in reply.events]
        assert set(last) == {"error"}
        assert last["error"]["type"] == "upstream_error"
        message = last["error"]["message"]
    elif api == "responses":
        assert names[0] == "response.created"
        assert "response.completed" not in names
        assert names[-2:] == ["error", "response.failed"]
        assert reply.events[-1].data["response"]["status"] == "failed"
        message = reply.events[-2].data["message"]
        assert reply.events[-1].data["response"]["error"] == {
            "code": "server_error",
            "message": message,
        }
    else:
        assert names[0] == "message_start"
        assert "message_stop" not in names and "message_delta" not in names
        assert names[-1] == "error"
        assert set(last) == {"type", "error"} and last["type"] == "error"
        assert last["error"]["type"] == "api_error"
        message = last["error"]["message"]
    assert message.startswith(reason)
    [call] = await _stored_calls(stack)
    assert call["call_id"] == reply.call_id
    assert call["status"] == "incomplete"
    assert call["api"] == api
    [diag] = [d for d in call["diagnostics"] if d["kind"] == "capture_incomplete"]
    assert any(r.startswith(reason) for r in diag["details"]["reasons"])
    chains = await _chains(stack)
    assert chains["incomplete"] is True and chains["chains"] == []


# -- 5. Responses previous_response_id -------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", MODES)
async def test_previous_response_id_gives_the_prompt_of_the_whole_input(make_stack, mode, stream):
    stack = await _stack(make_stack, mode)
    # r1: each request after the first sends only its new items and the previous answer's id.
    by_reference = harness("responses", stack, "r1", stream=stream)
    replies = [await by_reference.step()]
    for _ in range(2):
        sent_before = len(by_reference.history)
        by_reference.extra["previous_response_id"] = replies[-1].body["id"]
        by_reference.history = by_reference.history[sent_before - 1 :]  # the tool output only
        assert [i["type"] for i in by_reference.history] == ["function_call_output"]
        replies.append(await by_reference.step())
    # r2: the same session resending the whole input each time.
    whole = harness("responses", stack, "r2", stream=stream)
    whole_replies = await _session(whole)
    _check_answers("responses", mode, replies)
    _check_answers("responses", mode, whole_replies)
    for rollout, rs in (("r1", replies), ("r2", whole_replies)):
        chains = await _chains(stack, rollout)
        assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [
            [r.call_id for r in rs]
        ]
    r1 = (await _chains(stack, "r1"))["chains"][0]["calls"]
    r2 = (await _chains(stack, "r2"))["chains"][0]["calls"]
    assert [c["prompt_token_ids"] for c in r1] == [c["prompt_token_ids"] for c in r2]
    assert [c["prompt_token_ids"] for c in r1] == [s.prompt_token_ids for s in stack.sent[:3]]
    assert replies[1].body["previous_response_id"] == replies[0].body["id"]
    assert replies[2].body["previous_response_id"] == replies[1].body["id"]


# -- 6. opaque reasoning values round trip ---------------------------------------------------


def _tamper(value: str) -> str:
    """A value in the proxy's form whose check no longer matches (the text is forged)."""
    opened = open_reasoning(value)
    assert opened is not None
    forged = seal_reasoning(opened[0], "Forged reasoning.")
    head, _, check = forged.rpartition(".")
    return head + "." + ("0" if check[0] != "0" else "1") + check[1:]


def _hide_reasoning(h: Harness, tamper: bool) -> None:
    """Leave the reasoning of the last assistant turn only in the opaque value the proxy
    issued (Responses ``encrypted_content``; Messages ``signature`` with the text omitted)."""
    if h.api == "responses":
        for item in h.history:
            if item["type"] == "reasoning":
                item.pop("content", None)
                item["summary"] = []
                if tamper:
                    item["encrypted_content"] = _tamper(item["encrypted_content"])
    else:
        for message in h.history:
            for block in message["content"] if message["role"] == "assistant" else []:
                if block["type"] == "thinking":
                    assert block["thinking"] == ""  # display: omitted
                    if tamper:
                        block["signature"] = _tamper(block["signature"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tamper", [False, True], ids=["intact", "tampered"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_opaque_reasoning_comes_back(make_stack, api, mode, tamper, stream):
    stack = await _stack(make_stack, mode)
    h = harness(api, stack, "r1", stream=stream)
    if api == "messages":
        h.extra["thinking"] = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    first = await h.step()
    # The value the proxy issued holds the call id and the reasoning text.
    if api == "responses":
        [item] = [i for i in first.turn if i["type"] == "reasoning"]
        value = item["encrypted_content"]
        assert first.reasoning == STEPS[0]["reasoning"]
    else:
        [block] = [b for b in first.turn if b["type"] == "thinking"]
        value = block["signature"]
        assert first.reasoning == ""  # omitted from view
    assert open_reasoning(value) == (first.call_id, STEPS[0]["reasoning"])
    _hide_reasoning(h, tamper)
    second = await h.step()
    call = await _call(stack, second.call_id)
    [assistant] = [m for m in call["request_messages"] if m["role"] == "assistant"]
    chains = await _chains(stack)
    ids = [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]]
    if not tamper:
        assert assistant["reasoning_content"] == STEPS[0]["reasoning"]
        assert ids == [[first.call_id, second.call_id]]
        return
    # A tampered value is ignored: the turn comes without reasoning (never the forged text).
    assert "reasoning_content" not in assistant
    assert "Forged" not in json.dumps(call["request_messages"])
    if mode == "exact_tokens":
        # The turn still digests to the first call, whose own tokens make the prompt.
        assert ids == [[first.call_id, second.call_id]]
        assert call["linking"]["verdict"] == "resolved"
        parent = await _call(stack, first.call_id)
        prefix = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert call["prompt_token_ids"][: len(prefix)] == prefix
    else:
        # The engine renders the turn without its reasoning: the link is refused.
        assert ids == [[first.call_id], [second.call_id]]
        assert call["linking"]["verdict"] == "refused"
        [diag] = [d for d in call["diagnostics"] if d["kind"] == "parent_digest_mismatch"]
        assert diag["details"]["class"] == "template_rerendered"


# -- 7. tools the engine cannot render -------------------------------------------------------

#: per API: a tool the engine cannot render, and how the diagnostic names it
HOSTED_TOOLS = {
    "responses": ({"type": "web_search"}, {"type": "web_search"}),
    "messages": (
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        {"type": "web_search_20250305", "name": "web_search"},
    ),
}


@pytest.mark.parametrize("fault", [None, "backend_down"], ids=["answered", "backend_down"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", list(HOSTED_TOOLS))
async def test_tools_left_out_are_named_on_the_record(make_stack, api, mode, stream, fault):
    stack = await _stack(make_stack, mode)
    if fault == "backend_down":
        await stack.engine.close()
    h = harness(api, stack, "r1", stream=stream)
    sent, named = HOSTED_TOOLS[api]
    h.extra["tools"] = [*h.tools(), sent]
    reply = await h.send()
    assert reply.status == (502 if fault else 200)
    [call] = await _stored_calls(stack)
    assert call["status"] == ("failed" if fault else "complete")
    # the harness's own tools reach the engine; the hosted one does not, and the record says so
    assert [t["function"]["name"] for t in call["request_tools"]] == [
        t["function"]["name"]
        for t in harness("chat_completions", stack, "r1", stream=False).tools()
    ]
    [diag] = [d for d in call["diagnostics"] if d["kind"] == "tools_not_rendered"]
    assert diag["details"] == {"tools": [named]}


@pytest.mark.parametrize("mode", MODES)
async def test_a_call_whose_tools_all_render_has_no_such_diagnostic(make_stack, mode):
    stack = await _stack(make_stack, mode)
    reply = await harness("messages", stack, "r1", stream=False).send()
    call = await _call(stack, reply.call_id)
    assert call["request_tools"]
    assert "tools_not_rendered" not in [d["kind"] for d in call["diagnostics"]]
