"""``capture-proxy serve`` (``--workers 1`` and ``2``) as a child process, stopped by SIGTERM
while a streamed call is in flight (the scripted engine holds it at a token) and harnesses
hold kept-alive connections: new connections are refused at once; a request sent on a
kept-alive connection gets a whole 503 ``stopping`` answer in its API's shape (``Retry-After``,
``Connection: close``) and reaches no engine; the call in flight ends whole and its record is
read after a restart; idle connections are closed with a FIN, never reset; the process exits 0.

Connections are raw HTTP/1.1 (asyncio streams), so a request goes on exactly the connection
the test chose and a reset is told from a clean close. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from capture_proxy.scripted_engine.app import build_scripted_engine_app
from capture_proxy.scripted_engine.state import SEEN_REQUESTS, ScriptedEngineConfig
from capture_proxy.scripted_engine.weights import WEIGHTS
from tests.proxy.conftest import CAPTURE
from tests.proxy.test_capture import USER, _body
from tests.proxy.test_many_engines import url
from tests.support.listening import until_refused

#: The bound of every wait (start-up, a read, the stop).
DEADLINE_S = 60.0
#: The token at which the engine holds the streamed call until the test releases it.
HOLD_AT = 2
MESSAGES = "/ng-rollout/{rollout}/training-token-capture/v1/messages"


async def _serve(tmp_path: Path, backend: str, workers: int) -> tuple[Any, int]:
    """``serve --workers N --port 0``: the process and its port, once it says it serves."""
    with (tmp_path / "serve.log").open("ab") as log:  # the child keeps its own descriptor
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "capture_proxy.cli", "serve", "--backend", backend,
            "--port", "0", "--store", str(tmp_path / "store"), "--workers", str(workers),
            "--log-level", "INFO",
            stdout=asyncio.subprocess.PIPE, stderr=log,
        )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), DEADLINE_S)).decode()
    assert "serving on" in line, (line, (tmp_path / "serve.log").read_text())
    return proc, int(line.split("127.0.0.1:", 1)[1].split(" ", 1)[0])


@dataclass
class Connection:
    """One kept-alive connection to the proxy, and the worker that took it (None: one
    process)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    worker: int | None


def _request(method: str, path: str, port: int, body: dict[str, Any] | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    return (head + "\r\n").encode() + data


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and the headers (names in lower case) of the next response."""
    async with asyncio.timeout(DEADLINE_S):
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := (await reader.readline()).decode().strip()) != "":
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """The body of a response whose head was read (``Content-Length`` or chunked)."""
    async with asyncio.timeout(DEADLINE_S):
        if "content-length" in headers:
            return await reader.readexactly(int(headers["content-length"]))
        assert headers.get("transfer-encoding") == "chunked", headers
        body = b""
        while size := int((await reader.readline()).strip(), 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readexactly(2)  # the end of the last (empty) chunk
        return body


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status, headers = await _read_head(reader)
    return status, headers, await _read_body(reader, headers)


async def _connect(port: int) -> Connection:
    """A new connection with one ``GET /health`` answered on it (kept alive)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request("GET", "/health", port))
    status, headers, body = await _response(reader)
    assert status == 200 and headers.get("connection", "keep-alive") != "close", body
    worker = json.loads(body).get("worker")
    return Connection(reader, writer, worker["index"] if worker is not None else None)


async def _connections(
    port: int, workers: int, opened: list[Connection]
) -> tuple[list[Connection], Connection | None]:
    """Three kept-alive connections taken by one worker, and with two workers one taken by
    the other (the kernel deals new connections to the workers: open them until it has);
    every connection opened is added to ``opened`` (to close at the end)."""
    by_worker: dict[int | None, list[Connection]] = defaultdict(list)
    async with asyncio.timeout(DEADLINE_S):
        while True:
            conn = await _connect(port)
            opened.append(conn)
            by_worker[conn.worker].append(conn)
            full = [w for w, conns in by_worker.items() if len(conns) >= 3]
            if full and len(by_worker) == workers:
                break
    three = by_worker[full[0]][:3]
    others = [c for w, conns in by_worker.items() if w != full[0] for c in conns]
    for conn in by_worker[full[0]][3:] + others[1:]:
        conn.writer.close()
    return three, others[0] if others else None


async def _closed_cleanly(reader: asyncio.StreamReader) -> bytes:
    """What is left on the connection until the proxy closes it; a reset raises."""
    async with asyncio.timeout(DEADLINE_S):
        return await reader.read()


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_stop_answers_kept_alive_connections_refuses_new_ones_and_ends_the_call_in_flight(
    tmp_path, aiohttp_server, qwen_tokenizer, workers
):
    engine_app = build_scripted_engine_app(ScriptedEngineConfig(dev_mode=True), qwen_tokenizer)
    weights = engine_app[WEIGHTS]
    weights.hold_at = HOLD_AT
    engine = await aiohttp_server(engine_app)
    proc, port = await _serve(tmp_path, url(engine), workers)
    opened: list[Connection] = []
    try:
        (stream, openai, anthropic), other = await _connections(port, workers, opened)
        stream.writer.write(
            _request("POST", CAPTURE.format(rollout="r1"), port, _body(list(USER), stream=True))
        )
        async with asyncio.timeout(DEADLINE_S):
            await weights.held.wait()
        status, stream_headers = await _read_head(stream.reader)
        assert status == 200
        call_id = stream_headers["x-capture-call-id"]

        proc.send_signal(signal.SIGTERM)
        await until_refused(port, DEADLINE_S)

        openai.writer.write(_request("POST", CAPTURE.format(rollout="r2"), port, _body(list(USER))))
        status, headers, body = await _response(openai.reader)
        assert (status, headers["retry-after"], headers["connection"]) == (503, "5", "close")
        error = json.loads(body)["error"]
        assert (error["type"], error["code"]) == ("server_error", "stopping"), error
        assert await _closed_cleanly(openai.reader) == b""

        messages = {"model": "scripted-qwen", "max_tokens": 64, "messages": USER[1:]}
        anthropic.writer.write(_request("POST", MESSAGES.format(rollout="r3"), port, messages))
        status, headers, body = await _response(anthropic.reader)
        assert (status, headers["retry-after"], headers["connection"]) == (503, "5", "close")
        answer = json.loads(body)
        assert (answer["type"], answer["error"]["type"]) == ("error", "overloaded_error"), answer
        assert await _closed_cleanly(anthropic.reader) == b""

        if other is not None:  # the other worker had no call in flight: closed at once
            assert await _closed_cleanly(other.reader) == b""
        # Only the held call reached the engine; the proxy still waits for it.
        assert [p for m, p, _ in engine_app[SEEN_REQUESTS] if m == "POST"] == [
            "/v1/chat/completions"
        ]
        assert proc.returncode is None

        await weights.release()
        events = await _read_body(stream.reader, stream_headers)
        assert events.rstrip().endswith(b"data: [DONE]"), events[-200:]
        # Idle once its call ended: closed once the calls in flight are done.
        assert await _closed_cleanly(stream.reader) == b""
        assert await asyncio.wait_for(proc.wait(), DEADLINE_S) == 0
    finally:
        for conn in opened:
            conn.writer.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    log = (tmp_path / "serve.log").read_text()
    assert "-> 503 (stopping, <" in log, log

    proc, port = await _serve(tmp_path, url(engine), workers)
    try:
        async with aiohttp.ClientSession() as client:
            resp = await client.get(f"http://127.0.0.1:{port}/captures/calls/{call_id}")
            record = await resp.json()
        assert resp.status == 200, record
        assert (record["call_id"], record["status"]) == (call_id, "complete"), record
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), DEADLINE_S)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
