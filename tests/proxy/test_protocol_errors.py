"""Tier 2: what aiohttp rejects before the app (an over-long request line or header, a
malformed header) is answered in OpenAI's error shape and logged as one INFO line, no
traceback; requests the middlewares reject (401, 413) are logged too."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest
from aiohttp import web

from capture_proxy.proxy.server import ProxyRunner
from tests.proxy.conftest import CAPTURE, MakeStack


async def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    raw = await reader.read()  # the server closes the connection after a protocol error
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@pytest.fixture
async def served_port():
    app = web.Application()
    app.router.add_get("/health", _ok)
    runner = ProxyRunner(app, access_log=None)
    await runner.setup()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        try:
            yield sock.getsockname()[1]
        finally:
            await runner.cleanup()


@pytest.mark.parametrize(
    ("request_bytes", "code"),
    [
        (
            b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            "request_line_or_header_too_long",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + b"s" * 9000
            + b"\r\n\r\n",
            "request_line_or_header_too_long",
        ),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", "bad_request"),
    ],
    ids=["long-request-line", "long-header", "malformed-header"],
)
async def test_protocol_errors_are_json_and_logged_without_a_traceback(
    served_port, caplog, request_bytes, code
):
    caplog.set_level(logging.INFO)
    status, headers, body = await _raw(served_port, request_bytes)
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", code)
    assert b"sss" not in body  # a too-long header's value is not echoed
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert [r.levelname for r in caplog.records if "malformed request" in r.getMessage()] == [
        "INFO"
    ]
    # The server serves on.
    status, _, body = await _raw(
        served_port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert (status, json.loads(body)) == (200, {"status": "ok"})


async def test_requests_rejected_on_the_way_in_are_logged(make_stack: MakeStack, caplog):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    stack = await make_stack(max_request_body_bytes=1000, proxy_token="s3cret")
    path = CAPTURE.format(rollout="r1")
    resp = await stack.client.post(
        path, data=b"x" * 2000, headers={"Authorization": "Bearer s3cret"}
    )
    assert resp.status == 413
    resp = await stack.client.post(path, json={})
    assert resp.status == 401
    lines = [r for r in caplog.records if " -> 4" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in lines] == [
        ("INFO", f"POST {path} -> 413 (request_too_large, <2000 bytes in>)"),
        ("INFO", f"POST {path} -> 401 (invalid_api_key, <2 bytes in>)"),
    ]
    assert "s3cret" not in caplog.text
