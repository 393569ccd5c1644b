"""The OpenCode runner drives the real CLI against an in-test stub and OpenCode runs the tool.

The stub answers the agent's first request with a streamed ``read`` tool call on a file in the
project dir and any later one with text; the title request (no tools) gets a title. The test
checks that OpenCode executed the tool: its next request carries the file's content.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from capture_proxy.harnesses.opencode import find_opencode, run_opencode

OPENCODE = find_opencode()

pytestmark = [
    pytest.mark.opencode,
    pytest.mark.skipif(
        OPENCODE is None,
        reason="OpenCode CLI not installed (run scripts/install-opencode)",
    ),
]

NOTES_LINES = ["TODO: count the files", "alpha é ✓", "  indented beta"]


def _chunk(cid: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "stub-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(obj)}\n\n".encode()


def _script(body: dict[str, Any], n: int, notes_path: str) -> list[bytes]:
    cid = f"chatcmpl-test-{n}"
    out = [_chunk(cid, {"role": "assistant", "content": ""})]
    has_tool_result = any(m.get("role") == "tool" for m in body["messages"])
    if not body.get("tools"):  # title request
        out += [_chunk(cid, {"content": "Notes check"}), _chunk(cid, {}, "stop")]
    elif not has_tool_result:  # first agent step: read the notes, arguments fragmented
        args = json.dumps({"filePath": notes_path})
        out += [
            _chunk(cid, {"content": "Reading the notes."}),
            _chunk(
                cid,
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_test_read_0",
                            "type": "function",
                            "function": {"name": "read", "arguments": ""},
                        }
                    ]
                },
            ),
            _chunk(cid, {"tool_calls": [{"index": 0, "function": {"arguments": args[:7]}}]}),
            _chunk(cid, {"tool_calls": [{"index": 0, "function": {"arguments": args[7:]}}]}),
            _chunk(cid, {}, "tool_calls"),
        ]
    else:
        out += [_chunk(cid, {"content": "The notes list three lines."}), _chunk(cid, {}, "stop")]
    usage = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "stub-model",
        "choices": [],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }
    out.append(f"data: {json.dumps(usage)}\n\n".encode())
    out.append(b"data: [DONE]\n\n")
    return out


async def test_opencode_executes_read_tool_against_stub(aiohttp_server, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    notes = project / "notes.txt"
    notes.write_text("\n".join(NOTES_LINES) + "\n", encoding="utf-8")
    notes_path = str(notes.resolve())

    requests: list[dict[str, Any]] = []
    unexpected: list[str] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        requests.append(body)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        for chunk in _script(body, len(requests), notes_path):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def other(request: web.Request) -> web.Response:
        unexpected.append(f"{request.method} {request.path}")
        return web.json_response({"error": {"message": "not found"}}, status=404)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_route("*", "/{tail:.*}", other)
    server = await aiohttp_server(app, host="127.0.0.1", port=0)
    base_url = f"http://127.0.0.1:{server.port}/v1"

    assert OPENCODE is not None
    result = await asyncio.wait_for(
        asyncio.to_thread(
            run_opencode,
            OPENCODE,
            base_url,
            project,
            "Read notes.txt and tell me what it says.",
            home_dir=tmp_path / "home",
            timeout_s=120,
        ),
        timeout=150,
    )

    assert result.ok, result.describe()
    assert unexpected == [], unexpected
    agent = [b for b in requests if b.get("tools")]
    assert len(agent) == 2, (len(requests), result.describe())
    assert {"read", "bash"} <= {t["function"]["name"] for t in agent[0]["tools"]}

    second = agent[1]["messages"]
    call_msgs = [m for m in second if m["role"] == "assistant" and m.get("tool_calls")]
    assert len(call_msgs) == 1
    (call,) = call_msgs[0]["tool_calls"]
    assert call["id"] == "call_test_read_0"
    assert call["function"]["name"] == "read"
    assert json.loads(call["function"]["arguments"]) == {"filePath": notes_path}

    tool_msgs = [m for m in second if m["role"] == "tool"]
    assert len(tool_msgs) == 1
    assert tool_msgs[0]["tool_call_id"] == "call_test_read_0"
    numbered = "".join(f"{i}: {line}\n" for i, line in enumerate(NOTES_LINES, start=1))
    expected = (
        f"<path>{notes_path}</path>\n<type>file</type>\n<content>\n{numbered}\n"
        f"(End of file - total {len(NOTES_LINES)} lines)\n</content>"
    )
    assert tool_msgs[0]["content"] == expected
    assert "The notes list three lines." in result.stdout
