"""Tier 2: ``serve --record-dir`` writes the replay format, and a recording of each API replays
through a fresh proxy."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from capture_proxy.core.fronts.answers import answer_message
from capture_proxy.core.fronts.base import Api
from capture_proxy.harnesses.recorded import load_recording, replay, replay_engine_config
from capture_proxy.proxy.traffic_tap import TrafficRecorder, append_numbered
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


def _recorded(recorder: TrafficRecorder, rollout: str, n: int) -> None:
    """Record ``n`` requests of ``rollout`` with ``recorder``, as one worker would."""
    for i in range(n):
        request = make_mocked_request(
            "POST", BASE.format(rollout=rollout) + f"/v1/chat/completions?i={i}"
        )
        tap = recorder.start(request)[1]
        tap.raw_body = b'{"model": "m"}'
        tap.add(b'{"choices": [{"message": {"role": "assistant", "content": "ok"}}]}')
        recorder.write(request, rollout, web.Response(status=200), 0.0, tap)


def test_two_workers_recorders_number_one_file_in_line_order(tmp_path: Path):
    # Each worker of serve --workers N has its own TrafficRecorder on the same directory;
    # before, each counted its own requests: [1, 2, 3, 3, 4, 4, ...] (#8).
    first, second = TrafficRecorder(tmp_path), TrafficRecorder(tmp_path)
    start = threading.Barrier(4)

    def worker(recorder: TrafficRecorder) -> None:
        start.wait(timeout=10)
        _recorded(recorder, "shared", 50)

    threads = [threading.Thread(target=worker, args=(r,)) for r in (first, second) * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    lines = [json.loads(x) for x in (tmp_path / "shared.jsonl").read_text().splitlines()]
    assert [x["seq"] for x in lines] == list(range(1, 201))
    # every request's line is whole
    assert sorted(x["path"].rsplit("=", 1)[1] for x in lines) == sorted(
        str(i) for i in range(50) for _ in range(4)
    )
    assert [r.seq for r in load_recording(tmp_path / "shared.jsonl")] == list(range(1, 201))


def test_a_recording_continues_where_the_file_ends(tmp_path: Path):
    # a restarted proxy (or another worker) goes on from the file's last seq
    _recorded(TrafficRecorder(tmp_path), "again", 2)
    _recorded(TrafficRecorder(tmp_path), "again", 1)
    path = tmp_path / "again.jsonl"
    assert [json.loads(x)["seq"] for x in path.read_text().splitlines()] == [1, 2, 3]
    # a last line cut short by a crash is ended first; the new line stays whole
    with open(path, "a") as fh:
        fh.write('{"seq": 4, "rollout_id": "ag')
    assert append_numbered(path, '{"x": 1}') == 5
    assert path.read_text().splitlines()[-2:] == [
        '{"seq": 4, "rollout_id": "ag',
        '{"seq": 5, "x": 1}',
    ]
    # a file whose last line has no seq: numbered after its non-blank lines
    other = tmp_path / "hand.jsonl"
    other.write_text('{"a": 1}\n\n{"b": 2}\n')
    assert append_numbered(other, '{"c": 3}') == 3
    assert append_numbered(other, "{}") == 4
    assert other.read_text() == '{"a": 1}\n\n{"b": 2}\n{"seq": 3, "c": 3}\n{"seq": 4}\n'
