"""Tier 2: the Anthropic Messages front's stop sequences and stream usage, through the proxy
against the scripted engine in exact-token mode (whose tokens-in endpoint applies ``stop`` and
says which one matched, as vLLM's ``stop_reason`` does)."""

from __future__ import annotations

import json
from typing import Any

from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.proxy.conftest import MakeStack

#: a call without tools is answered with the policy's title
ANSWER = Policy.model_validate({"title": "Here are the files you asked for.", "final": "x"})
URL = "/ng-rollout/{rollout}/training-token-capture/v1/messages"


def _body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "scripted-qwen",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "List the files"}],
        **fields,
    }


def _events(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")
    ]


async def test_a_stop_sequence_hit_is_named(make_stack: MakeStack) -> None:
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=ANSWER), prompt_mode="exact_tokens"
    )
    url = URL.format(rollout="r-stop")
    resp = await stack.client.post(url, json=_body(stop_sequences=["END", " files"]))
    body = await resp.json()
    assert resp.status == 200, body
    assert body["content"] == [{"type": "text", "text": "Here are the"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", " files")

    resp = await stack.client.post(url, json=_body(stop_sequences=["END", " files"], stream=True))
    events = _events(await resp.text())
    delta = [e for e in events if e["type"] == "message_delta"]
    assert [d["delta"] for d in delta] == [
        {"stop_reason": "stop_sequence", "stop_sequence": " files"}
    ]
    # the prompt's count is known before the first event (the proxy built the prompt)
    start = events[0]["message"]["usage"]["input_tokens"]
    assert start == delta[0]["usage"]["input_tokens"] == body["usage"]["input_tokens"] > 0

    # no stop sequence matched: the model's own end
    resp = await stack.client.post(url, json=_body(stop_sequences=["END"]))
    body = await resp.json()
    assert body["content"] == [{"type": "text", "text": "Here are the files you asked for."}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
