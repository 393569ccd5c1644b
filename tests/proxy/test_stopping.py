"""Tier 2: the graceful stop (``proxy.stopping``, ``proxy.server``): a call on a hung engine is
waited for at most ``shutdown_timeout_s``, named in the log when the stop begins and when it is
cut, and stored incomplete, never lost; a request that comes during the stop on a connection
still open is answered 503 ``stopping`` in its API's shape, and a whole answer finished during
the stop closes its connection. (``tests/test_serve_stop.py``: the same as ``serve`` runs it,
with ``--workers``.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.proxy.errors import Stopping
from capture_proxy.scripted_engine.state import SEEN_REQUESTS, ScriptedEngineConfig
from capture_proxy.scripted_engine.weights import WEIGHTS
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.conftest import CAPTURE, MakeStack, ProxyTestServer
from tests.proxy.test_capture import USER, _body
from tests.support.listening import until_refused


async def test_a_stop_cuts_a_call_on_a_hung_engine_at_its_bound_and_stores_it(
    aiohttp_server, tmp_path, caplog
):
    arrived = asyncio.Event()
    never = asyncio.Event()

    async def hung(request: web.Request) -> web.Response:
        arrived.set()
        await never.wait()  # alive, never answering (a SIGSTOPped engine)
        return web.Response()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    engine_app = web.Application()
    engine_app.router.add_post("/v1/chat/completions", hung)
    engine_app.router.add_get("/health", health)
    engine = await aiohttp_server(engine_app)
    settings = Settings(
        backend=str(engine.make_url("/")).rstrip("/"),
        store=tmp_path / "store",
        shutdown_timeout_s=0.5,
    )
    server = ProxyTestServer(build_proxy_app(settings, SQLiteStore(tmp_path / "store")))
    await server.start_server(**settings.server_kwargs)  # the runner's, as ``serve`` sets them
    client = TestClient(server)
    caplog.set_level(logging.INFO, logger="capture_proxy")
    call = asyncio.create_task(
        client.post(CAPTURE.format(rollout="r1"), json=_body(list(USER), stream=True))
    )
    try:
        async with asyncio.timeout(10):
            await arrived.wait()
        async with asyncio.timeout(10):  # 0.5 s, then the cut call's record; not 60 s
            await server.close()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(call, 10)
        await client.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping:")]
    lines = [re.sub(r"call-[0-9a-f]+", "call-ID", re.sub(r"\d+\.\d s\)", "T s)", m)) for m in lines]
    assert lines == [
        "stopping: finishing 1 calls in flight, at most 0.5 s (shutdown_timeout_s): "
        "call-ID (rollout r1, T s)",
        "stopping: 1 calls still in flight after 0.5 s (shutdown_timeout_s): cut, stored "
        "incomplete: call-ID (rollout r1, T s)",
    ]
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        records = await store.get_rollout_calls("r1")
    finally:
        await store.close()
    assert [(r.status.value, [d.kind for d in r.diagnostics]) for r in records] == [
        ("incomplete", ["capture_incomplete"])
    ]


def _http(method: str, path: str, body: dict[str, object] | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    return (head + "\r\n").encode() + data


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any, bytes]:
    """The status, headers (lower-case names) and JSON body of the next answer, and what the
    connection carries after it until the proxy closes it (a reset raises)."""
    async with asyncio.timeout(10):
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := (await reader.readline()).decode().strip()) != "":
            name, _, value = line.partition(":")
            headers[name.lower()] = value.strip()
        body = json.loads(await reader.readexactly(int(headers["content-length"])))
        rest = await reader.read()
    return status, headers, body, rest


async def test_during_a_stop_new_requests_get_503_in_their_apis_shape_and_an_answer_closes(
    make_stack: MakeStack, caplog
):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(dev_mode=True), cancel_handlers=False
    )
    weights = stack.engine_app[WEIGHTS]
    weights.hold_at = 1
    server = stack.client.server
    assert server.port is not None
    caplog.set_level(logging.INFO, logger="capture_proxy")
    conns = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(4)]
    closing = None
    try:
        call, messages, health, responses = conns
        call[1].write(_http("POST", CAPTURE.format(rollout="r1"), _body(list(USER))))
        async with asyncio.timeout(10):
            await weights.held.wait()  # the whole answer is under way, held at the engine
        closing = asyncio.create_task(server.close())
        await until_refused(server.port, 10)  # the stop has begun once the socket refuses

        # A forwarded (uncaptured) Anthropic path: Anthropic's shape, nothing forwarded.
        body = {"model": "scripted-qwen", "max_tokens": 8, "messages": USER[1:]}
        messages[1].write(_http("POST", "/v1/messages", body))
        status, headers, answer, rest = await _answer(messages[0])
        assert (status, headers["retry-after"], headers["connection"], rest) == (
            503, "5", "close", b""
        )  # fmt: skip
        assert answer == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": Stopping().message},
        }
        health[1].write(_http("GET", "/health"))
        status, headers, answer, rest = await _answer(health[0])
        assert (status, headers["connection"], rest) == (503, "close", b"")
        assert answer == {
            "error": {
                "message": Stopping().message,
                "type": "server_error",
                "param": None,
                "code": "stopping",
            }
        }
        responses[1].write(
            _http(
                "POST",
                "/ng-rollout/r2/training-token-capture/v1/responses",
                {"model": "scripted-qwen", "input": "hi"},
            )
        )
        status, _, answer, _ = await _answer(responses[0])
        assert (status, answer["error"]["code"]) == (503, "stopping")

        await weights.release()
        status, headers, answer, rest = await _answer(call[0])
        assert (status, headers["connection"], rest) == (200, "close", b""), answer
        assert [p for m, p, _ in stack.engine_app[SEEN_REQUESTS] if m == "POST"] == [
            "/v1/chat/completions"
        ]
        async with asyncio.timeout(10):
            await closing
    finally:
        for _, writer in conns:
            writer.close()
        if closing is not None and not closing.done():
            closing.cancel()
    lines = [r.getMessage() for r in caplog.records]
    size = len(json.dumps(body))
    assert f"POST /v1/messages -> 503 (stopping, <{size} bytes in>)" in lines, lines
    assert "stopping: 3 requests that came during the stop were answered 503 (stopping)" in lines
