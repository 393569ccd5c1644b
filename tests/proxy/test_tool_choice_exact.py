"""Tier 2: exact-token mode answers and constrains per ``tool_choice`` as vLLM 0.32 does.

The scripted engine writes the same generation (a sentence, two Hermes calls) whatever the
request asks; the proxy's answer must be vLLM's for that text and that request
(``families.tool_choice``), whole and streamed alike, and its tokens-in request must carry the
structural tag vLLM's chat completions would (``families.structural_tags``) for ``required``, a
named function and a single call, and none otherwise. Backend-template mode forwards the
request and records the engine's answer as it came (a named choice ends with ``stop``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from capture_proxy.families.structural_tags import tool_constraint
from capture_proxy.families.tool_choice import tool_choice_of
from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.proxy.conftest import Stack
from tests.proxy.test_capture import TOOLS, USER
from tests.proxy.test_exact_tokens import _assemble_stream

#: what the engine generates (the qwen family's Hermes calls); a request without tools gets the
#: policy's title, the same text written as content
TEXT = (
    "Looking.\n<tool_call>\n"
    '{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>'
)
POLICY = Policy.model_validate(
    {
        "title": TEXT,
        "steps": [
            {
                "content": "Looking.",
                "tool_calls": [
                    {"name": "bash", "arguments": {"command": "ls"}},
                    {"name": "bash", "arguments": {"command": "pwd"}},
                ],
            }
        ],
    }
)
LS = {"name": "bash", "arguments": '{"command": "ls"}'}
PWD = {"name": "bash", "arguments": '{"command": "pwd"}'}
NAMED = {"type": "function", "function": {"name": "bash"}}

#: request fields -> (content, calls, finish_reason) as vLLM 0.32 answers TEXT
CASES: dict[str, tuple[dict[str, Any], tuple[str | None, list[dict[str, str]], str]]] = {
    "no_tools": ({"tools": None}, (TEXT, [], "stop")),
    "none": ({"tool_choice": "none"}, (TEXT, [], "stop")),
    "absent": ({}, ("Looking.\n", [LS, PWD], "tool_calls")),
    "auto": ({"tool_choice": "auto"}, ("Looking.\n", [LS, PWD], "tool_calls")),
    "required": ({"tool_choice": "required"}, ("Looking.\n", [LS, PWD], "tool_calls")),
    "named": ({"tool_choice": NAMED}, ("Looking.\n", [LS, PWD], "stop")),
    "auto_single": (
        {"tool_choice": "auto", "parallel_tool_calls": False},
        ("Looking.\n", [LS], "tool_calls"),
    ),
}
CONSTRAINED = {"required", "named", "auto_single"}


def _request(fields: dict[str, Any], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "scripted-qwen",
        "messages": USER,
        "tools": TOOLS,
        "stream": stream,
        **fields,
    }
    return {k: v for k, v in body.items() if v is not None}


async def _answer(stack: Stack, body: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
    resp = await stack.chat("r1", body)
    assert resp.status == 200, await resp.text()
    call_id = resp.headers["X-Capture-Call-Id"]
    if body["stream"]:
        raw = await resp.read()
        message = _assemble_stream(raw)
        finishes = [
            c["finish_reason"]
            for line in raw.decode().split("\n")
            if line.startswith("data: {")
            for c in json.loads(line[6:])["choices"]
            if c.get("finish_reason")
        ]
        assert len(finishes) == 1
        return message, finishes[0], call_id
    choice = (await resp.json())["choices"][0]
    return choice["message"], choice["finish_reason"], call_id


def _calls(message: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or []
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(CASES))
async def test_exact_answer_and_constraint_per_tool_choice(make_stack, case, stream):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY), prompt_mode="exact_tokens"
    )
    fields, (content, calls, finish) = CASES[case]
    body = _request(fields, stream)
    message, finish_reason, call_id = await _answer(stack, body)
    assert (message.get("content") or None, _calls(message), finish_reason) == (
        content,
        calls,
        finish,
    )
    # the record keeps the answer the harness received
    record = await stack.get_json(f"/captures/calls/{call_id}")
    assert _calls(record["response_message"]) == calls
    assert (record["response_message"].get("content") or None) == content
    assert record["finish_reason"] == finish
    # the engine request: vLLM's structural tag for the constrained choices, nothing else
    (sent,) = stack.sent
    expected = tool_constraint("hermes", body.get("tools"), tool_choice_of(body), body)
    assert (expected is not None) == (case in CONSTRAINED)
    assert sent.request_body.get("structured_outputs") == expected
    assert "response_format" not in sent.request_body
    if case in CONSTRAINED:
        tag = json.loads(expected["structural_tag"])
        assert tag["type"] == "structural_tag"
        assert tag["format"]["tags"][0]["begin"] == '<tool_call>\n{"name": "bash", "arguments": '


async def test_required_replaces_the_requests_own_constraint(make_stack):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY), prompt_mode="exact_tokens"
    )
    body = _request({"tool_choice": "required", "response_format": {"type": "json_object"}}, False)
    await _answer(stack, body)
    (sent,) = stack.sent
    assert "response_format" not in sent.request_body
    assert "structural_tag" in sent.request_body["structured_outputs"]


async def test_sglang_refuses_a_constrained_tool_choice_naming_it(make_stack):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY),
        prompt_mode="exact_tokens",
        tokens_in_dialect="sglang_generate",
    )
    resp = await stack.chat("r1", _request({"tool_choice": "required"}, False))
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "tool_choice"
    assert "SGLang" in error["message"]
    assert stack.sent == []
    # an unconstrained choice is served as before
    resp = await stack.chat("r1", _request({"tool_choice": "auto"}, False))
    assert resp.status == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_backend_mode_records_a_named_choices_calls(make_stack, stream):
    stack = await make_stack(engine_config=ScriptedEngineConfig(policy=POLICY))
    body = _request({"tool_choice": NAMED}, stream)
    message, finish_reason, call_id = await _answer(stack, body)
    assert (_calls(message), finish_reason) == ([LS, PWD], "stop")
    record = await stack.get_json(f"/captures/calls/{call_id}")
    assert _calls(record["response_message"]) == [LS, PWD]
    assert record["finish_reason"] == "stop"
    (sent,) = stack.sent
    assert sent.request_body["tool_choice"] == NAMED


async def test_a_constrained_generation_the_engine_aborts_is_not_continued(make_stack):
    # Its grammar would start again at the continuation's first token (core.flow.resume).
    import asyncio

    from capture_proxy.scripted_engine.weights import WEIGHTS

    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=POLICY, dev_mode=True),
        prompt_mode="exact_tokens",
    )
    weights = stack.engine_app[WEIGHTS]
    weights.hold_at = 4
    call = asyncio.create_task(stack.chat("r1", _request({"tool_choice": "required"}, False)))
    await asyncio.wait_for(weights.held.wait(), 20.0)
    async with stack.client.session.post(stack.engine.make_url("/pause?mode=abort")) as r:
        assert r.status == 200
    resp = await asyncio.wait_for(call, 20.0)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "generation_aborted"
    assert len(stack.sent) == 1  # no continuation was sent
    stored = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    reason = next(d["details"] for d in stored["diagnostics"] if d["kind"] == "generation_aborted")
    assert reason["reason"].startswith("a constrained generation (structured_outputs) cannot")
    async with stack.client.session.post(stack.engine.make_url("/resume")) as r:
        assert r.status == 200
