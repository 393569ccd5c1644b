"""Tier 2: ``serve --record-dir`` writes the replay format, and a recording of each API replays
through a fresh proxy."""

from __future__ import annotations

import json
from pathlib import Path

from capture_proxy.core.fronts.answers import answer_message
from capture_proxy.core.fronts.base import Api
from capture_proxy.harnesses.recorded import load_recording, replay, replay_engine_config
from tests.proxy.conftest import MakeStack

BASE = "/ng-rollout/{rollout}/training-token-capture"

TOOLS_ANTHROPIC = [
    {
        "name": "bash",
        "description": "run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]


def _messages_body(messages: list, stream: bool) -> dict:
    return {
        "model": "scripted-qwen",
        "max_tokens": 256,
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {}}],
        "messages": messages,
        "tools": TOOLS_ANTHROPIC,
        "stream": stream,
    }


async def test_recorded_messages_session_has_the_replay_format_and_replays(
    make_stack: MakeStack, tmp_path: Path
):
    record_dir = tmp_path / "rec"
    stack = await make_stack(record_dir=record_dir, proxy_token="sk-test")
    auth = {"Authorization": "Bearer sk-test", "anthropic-version": "2023-06-01"}
    url = BASE.format(rollout="rec1") + "/v1/messages?beta=true"
    messages: list = [{"role": "user", "content": [{"type": "text", "text": "List files."}]}]
    answers = []
    for step in range(2):
        resp = await stack.client.post(url, json=_messages_body(messages, True), headers=auth)
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
        answers.append(raw)
        message = answer_message(Api.MESSAGES, raw, resp.headers["Content-Type"])
        blocks = []
        if message.get("content"):
            blocks.append({"type": "text", "text": message["content"]})
        for tc in message.get("tool_calls") or []:
            blocks.append(
                {
                    "type": "tool_use",
                    "id": tc["id"],
                    "name": tc["function"]["name"],
                    "input": json.loads(tc["function"]["arguments"]),
                }
            )
        messages.append({"role": "assistant", "content": blocks})
        results = [
            {"type": "tool_result", "tool_use_id": b["id"], "content": f"out {step}"}
            for b in blocks
            if b["type"] == "tool_use"
        ]
        messages.append({"role": "user", "content": results or "Thanks."})
    counted = await stack.client.post(
        BASE.format(rollout="rec1") + "/v1/messages/count_tokens",
        json={"model": "scripted-qwen", "messages": messages[:1]},
        headers=auth,
    )
    assert counted.status == 200

    lines = [json.loads(x) for x in (record_dir / "rec1.jsonl").read_text().splitlines()]
    assert [x["seq"] for x in lines] == [1, 2, 3]
    assert [x["classification"] for x in lines] == ["captured", "captured", "counted"]
    assert [x["path"] for x in lines] == [url, url, BASE.format(rollout="rec1")
                                          + "/v1/messages/count_tokens"]
    assert lines[0]["response_raw"].encode() == answers[0]  # exactly what the harness got
    assert lines[1]["response_raw"].encode() == answers[1]
    headers = dict((k.lower(), v) for k, v in lines[0]["headers"])
    assert headers["authorization"] == "<redacted>"
    assert headers["anthropic-version"] == "2023-06-01"
    assert json.loads(lines[0]["body_raw"]) == lines[0]["body"]
    assert lines[0]["call_id"] and lines[0]["status"] == 200

    recording = load_recording(record_dir / "rec1.jsonl")
    assert [r.api for r in recording] == [Api.MESSAGES, Api.MESSAGES]  # count_tokens skipped
    assert recording[0].query == "beta=true"
    assert recording[0].response_message["tool_calls"][0]["function"]["name"] == "bash"

    # Replay through a fresh proxy whose engine answers what the recording answered.
    fresh = await make_stack(engine_config=replay_engine_config(recording))
    base_url = str(fresh.client.make_url(BASE.format(rollout="replayed") + "/v1"))
    calls = await replay(recording, base_url)
    assert [c.status for c in calls] == [200, 200]
    chains = await fresh.get_json("/captures/rollouts/replayed/chains")
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [
        [calls[0].call_id, calls[1].call_id]
    ]
    assert {c["api"] for ch in chains["chains"] for c in ch["calls"]} == {"messages"}


async def test_a_refused_request_is_recorded_as_an_error(make_stack: MakeStack, tmp_path: Path):
    stack = await make_stack(record_dir=tmp_path / "rec")
    resp = await stack.client.post(
        BASE.format(rollout="bad") + "/v1/responses", json={"model": "m", "input": 7}
    )
    assert resp.status == 400
    (line,) = [json.loads(x) for x in (tmp_path / "rec" / "bad.jsonl").read_text().splitlines()]
    assert line["classification"] == "error"
    assert line["status"] == 400
    assert json.loads(line["response_raw"])["error"]["param"] == "input"
