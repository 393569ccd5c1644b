"""Tier 2: what protects a proxy on a shared machine by default (issue 26, classes 1-3, 6):
engine credentials never reach an answer, a record or a log; the request policy (allowed
``Host`` values, cross-site ``Origin``, JSON bodies, the request target's form); slow clients
are cut off; compressed bodies are decoded honestly or refused."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import zlib

import pytest
from aiohttp import web

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.proxy.server import ProxyRunner
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.conftest import CAPTURE, MakeStack
from tests.proxy.test_capture import USER, _body

WAIT_S = 10.0
PASSWORD = "PASSWORD-s3cr3t"


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _raw(port: int, data: bytes, *, read_s: float = WAIT_S) -> bytes:
    """Send ``data`` on a new connection; read one answer (its head and Content-Length
    body), or, when the server closes without one, b"" (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(read_s):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                return exc.partial
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            return head + await reader.readexactly(length)
    finally:
        writer.close()


def _status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


# --- 1. engine credentials ---------------------------------------------------------------


def test_backend_url_credentials_are_kept_out_of_the_base_url():
    settings = Settings(backend=f"http://user:{PASSWORD}@127.0.0.1:9/", store="s")
    assert settings.backend_base == "http://127.0.0.1:9"
    assert settings.backend_label == "http://user:***@127.0.0.1:9"
    assert settings.backend_auth_header == "Basic dXNlcjpQQVNTV09SRC1zM2NyM3Q="


async def test_engine_credentials_are_in_no_answer_record_or_log(aiohttp_client, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    settings = Settings(
        backend=f"http://user:{PASSWORD}@127.0.0.1:{_dead_port()}",
        store=tmp_path / "store",
        upstream_connect_retries=0,
    )
    client = await aiohttp_client(build_proxy_app(settings, SQLiteStore(tmp_path / "store")))
    resp = await client.post(CAPTURE.format(rollout="r1"), json=_body(USER))
    text = await resp.text()
    assert resp.status == 502, text
    assert PASSWORD not in text
    assert json.loads(text)["error"]["code"] == "engine_unreachable"
    assert "engine at http://127.0.0.1:" in json.loads(text)["error"]["message"]
    # The failed call is stored, and its id is on the 502 (class 10).
    call_id = resp.headers["X-Capture-Call-Id"]
    call = await (await client.get(f"/captures/calls/{call_id}")).text()
    assert json.loads(call)["status"] == "failed"
    assert PASSWORD not in call
    health = await (await client.get("/health")).text()
    assert PASSWORD not in health
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "engine_unreachable" in logged or "502" in logged
    assert PASSWORD not in logged


async def test_a_harness_credential_and_headers_reach_no_record_only_its_session_headers(
    make_stack: MakeStack, caplog
):
    """A record keeps the headers that name the harness's session (``core.sessions``) and no
    other: not the harness's key, cookie or any header outside the allow-list, in the read
    API, the stored rows or the log; a session header that is no plain id is left out."""
    caplog.set_level(logging.DEBUG)
    stack = await make_stack()
    secrets = ["sk-HARNESS-s3cr3t", "COOKIE-s3cr3t", "AFFINITY-s3cr3t", "CLAUDE-s3cr3t"]
    headers = [
        ("Authorization", f"Bearer {secrets[0]}"),
        ("x-api-key", secrets[0]),
        ("Cookie", f"session={secrets[1]}"),
        ("x-session-affinity", secrets[2]),
        ("X-Claude-Code-Session-Id", secrets[3]),
        ("X-Session-Id", "ses_dd45e419dffe640t0DYpOs71VK"),
        ("x-parent-session-id", f"Bearer {secrets[0]}"),  # no plain id: left out
    ]
    resp = await stack.client.post(
        CAPTURE.format(rollout="r1"), json=_body(USER, stream=True), headers=headers
    )
    answer = await resp.text()
    assert resp.status == 200, answer
    call_id = resp.headers["X-Capture-Call-Id"]
    call = await (await stack.client.get(f"/captures/calls/{call_id}")).text()
    assert json.loads(call)["session_headers"] == {"x-session-id": "ses_dd45e419dffe640t0DYpOs71VK"}
    chains = await (await stack.client.get("/captures/rollouts/r1/chains")).text()
    stored = b"".join(p.read_bytes() for p in stack.store_dir.rglob("*") if p.is_file())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for secret in secrets:
        for where, text in (("answer", answer), ("call", call), ("chains", chains)):
            assert secret not in text, where
        assert secret.encode() not in stored
        assert secret not in logged


async def test_backend_url_credentials_reach_the_engine_as_basic_auth(
    aiohttp_server, aiohttp_client, tmp_path
):
    seen: list[tuple[str, str | None]] = []

    async def engine(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization")))
        return web.json_response({"object": "list", "data": []})

    spy = web.Application()
    spy.router.add_route("*", "/{tail:.*}", engine)
    server = await aiohttp_server(spy)
    settings = Settings(
        backend=f"http://user:{PASSWORD}@127.0.0.1:{server.port}", store=tmp_path / "s"
    )
    client = await aiohttp_client(build_proxy_app(settings, SQLiteStore(tmp_path / "s")))
    for path in ("/v1/models", "/ng-rollout/r1/v1/models"):
        resp = await client.get(path, headers={"Authorization": "Bearer harness-key"})
        assert resp.status == 200, await resp.text()
    # (the engine's health probe and weight-version reader carry the credential too)
    basic = "Basic dXNlcjpQQVNTV09SRC1zM2NyM3Q="
    assert [auth for _, auth in seen] == [basic] * len(seen)
    called = [path for path, _ in seen if path not in ("/health", "/weight_info")]
    assert called == ["/v1/models"] * 2


# --- 2. the request policy: hosts, origins, JSON bodies, the request target -------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/captures/rollouts"),
        ("POST", CAPTURE.format(rollout="r1")),
        ("GET", "/captures/ui/"),
    ],
)
async def test_a_host_not_allowed_is_refused(make_stack: MakeStack, method, path):
    stack = await make_stack()
    kwargs = {"json": _body(USER)} if method == "POST" else {}
    resp = await stack.client.request(method, path, headers={"Host": "attacker.example"}, **kwargs)
    assert resp.status == 421, await resp.text()
    err = (await resp.json())["error"]
    assert (err["code"], err["param"]) == ("host_not_allowed", "Host")
    assert "allowed_hosts" in err["message"]
    assert stack.sent == []


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1:8080", "[::1]:80", "127.0.0.2", "LOCALHOST."]
)
async def test_loopback_hosts_are_allowed_by_default(make_stack: MakeStack, host):
    stack = await make_stack()
    resp = await stack.client.get("/captures/rollouts", headers={"Host": host})
    assert resp.status == 200, await resp.text()


async def test_allowed_hosts_setting_admits_a_name(make_stack: MakeStack):
    stack = await make_stack(allowed_hosts=["proxy.internal"])
    ok = await stack.client.get("/captures/rollouts", headers={"Host": "proxy.internal:8080"})
    assert ok.status == 200
    refused = await stack.client.get("/captures/rollouts", headers={"Host": "other.internal"})
    assert refused.status == 421
    anyhost = await make_stack(allowed_hosts=["*"])
    assert (await anyhost.client.get("/captures/rollouts", headers={"Host": "x.y"})).status == 200


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
async def test_a_body_that_is_not_json_typed_is_refused_before_the_engine(
    make_stack: MakeStack, content_type
):
    stack = await make_stack()
    headers = {"Content-Type": content_type} if content_type else {}
    data = json.dumps(_body(USER)).encode()
    resp = await stack.client.post(
        CAPTURE.format(rollout="r1"), data=data, headers=headers, skip_auto_headers={"Content-Type"}
    )
    assert resp.status == 415, await resp.text()
    err = (await resp.json())["error"]
    assert (err["code"], err["param"]) == ("unsupported_media_type", "Content-Type")
    assert stack.sent == []
    assert (await stack.client.get("/captures/rollouts/r1")).status == 404


async def test_cross_site_writes_to_the_read_api_are_refused(make_stack: MakeStack):
    stack = await make_stack()
    assert (await stack.chat("r1", _body(USER))).status == 200
    form = await stack.client.put(
        "/captures/rollouts/r1/metadata",
        data="tags=x",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert form.status == 415
    # A page's fetch without a body carries its Origin: refused.
    freeze = await stack.client.post(
        "/captures/rollouts/r1/freeze", headers={"Origin": "http://attacker.example"}
    )
    assert freeze.status == 403, await freeze.text()
    assert (await freeze.json())["error"]["code"] == "cross_origin_request"
    delete = await stack.client.delete("/captures/rollouts/r1", headers={"Origin": "null"})
    assert delete.status == 403
    info = await stack.get_json("/captures/rollouts/r1")
    assert info["snapshot"] is None
    # The same origin (the viewer's own pages) and no origin (curl, trainers) pass.
    same = await stack.client.post(
        "/captures/rollouts/r1/freeze", headers={"Origin": str(stack.client.make_url(""))}
    )
    assert same.status == 200, await same.text()


async def test_a_fragment_in_the_request_target_is_refused(make_stack: MakeStack):
    stack = await make_stack()
    body = json.dumps(_body(USER)).encode()
    request = (
        f"POST {CAPTURE.format(rollout='r1')}#frag HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body
    status, err = _status_and_body(await _raw(stack.client.port, request))
    assert status == 400
    assert (err["error"]["code"], err["error"]["param"]) == ("invalid_request_target", "path")
    assert stack.sent == []


async def test_an_absolute_form_request_target_is_refused(make_stack: MakeStack):
    stack = await make_stack()
    body = json.dumps(_body(USER)).encode()
    request = (
        f"POST http://127.0.0.1{CAPTURE.format(rollout='r1')} HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    status, err = _status_and_body(await _raw(stack.client.port, request))
    assert status == 400
    assert err["error"]["code"] == "invalid_request_target"
    assert stack.sent == []


# --- 3. slow clients -------------------------------------------------------------------------


async def _served(tmp_path, engine_url: str, **settings) -> tuple[ProxyRunner, int]:
    cfg = Settings(backend=engine_url, store=tmp_path / "slow", **settings)
    app = build_proxy_app(cfg, SQLiteStore(tmp_path / "slow"))
    runner = ProxyRunner(app, access_log=None, **cfg.server_kwargs)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    return runner, sock.getsockname()[1]


async def test_a_body_that_stops_coming_gets_a_408(make_stack: MakeStack, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    stack = await make_stack()
    runner, port = await _served(
        tmp_path, str(stack.engine.make_url("")).rstrip("/"), client_body_timeout_s=0.3
    )
    try:
        request = (
            f"POST {CAPTURE.format(rollout='r1')} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"model": '
        ).encode()
        status, err = _status_and_body(await _raw(port, request, read_s=5.0))
        assert status == 408
        assert (err["error"]["code"], err["error"]["param"]) == ("request_timeout", "body")
        assert stack.sent == []
        # The line says the 10 bytes that came of the 500 declared (it said 500).
        assert [r.getMessage() for r in caplog.records if " -> 408 " in r.getMessage()] == [
            f"POST {CAPTURE.format(rollout='r1')} -> 408 (request_timeout, <10 of 500 bytes in>)"
        ]
    finally:
        await runner.cleanup()


async def test_headers_that_never_end_are_cut_off(make_stack: MakeStack, tmp_path):
    stack = await make_stack()
    runner, port = await _served(
        tmp_path, str(stack.engine.make_url("")).rstrip("/"), client_header_timeout_s=0.3
    )
    try:
        # The server closes the connection (bounded read: no hang).
        raw = await _raw(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a", read_s=5.0)
        assert raw == b""
    finally:
        await runner.cleanup()


def test_server_kwargs_carry_the_header_timeout_and_the_stop_bound():
    settings = Settings(
        backend="http://127.0.0.1:9", store="s", client_header_timeout_s=12.5,
        shutdown_timeout_s=30.0,
    )  # fmt: skip
    assert settings.server_kwargs == {"keepalive_timeout": 12.5, "shutdown_timeout": 30.0}


# --- 6. compressed bodies ------------------------------------------------------------------


@pytest.mark.parametrize(
    "encode",
    [gzip.compress, zlib.compress, lambda b: zlib.compress(b)[2:-4]],
    ids=["gzip", "deflate", "raw-deflate"],
)
async def test_a_compressed_body_is_decoded_and_forwarded_plain(make_stack: MakeStack, encode):
    stack = await make_stack()
    name = "gzip" if encode is gzip.compress else "deflate"
    resp = await stack.client.post(
        CAPTURE.format(rollout="r1"),
        data=encode(json.dumps(_body(USER)).encode()),
        headers={"Content-Type": "application/json", "Content-Encoding": name},
    )
    assert resp.status == 200, await resp.text()
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["status"] == "complete"
    assert len(stack.sent) == 1


@pytest.mark.parametrize("name", ["gzip", "deflate"])
async def test_an_undecodable_body_is_a_400(make_stack: MakeStack, name):
    stack = await make_stack()
    resp = await stack.client.post(
        CAPTURE.format(rollout="r1"),
        data=b"this is not compressed at all",
        headers={"Content-Type": "application/json", "Content-Encoding": name},
    )
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert (err["code"], err["param"]) == ("body_not_decodable", "Content-Encoding")
    assert stack.sent == []
    # The answer closed its connection, so the client's next request takes a new one (it
    # was sent on the old one as it closed: "Server disconnected").
    assert resp.headers["Connection"] == "close"
    assert (await stack.chat("r1", _body(USER))).status == 200


async def _send_and_read_to_close(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it (bounded): the
    server has finished with the request, its log lines included, once it has closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(WAIT_S):
            return await reader.read()
    finally:
        writer.close()


NOT_COMPRESSED = b"this is not compressed at all"
#: A deflate stream cut short: aiohttp's parser finds it at the body's end, before any handler.
CUT_DEFLATE = zlib.compress(json.dumps(_body(USER)).encode())[:-8]
#: The log line of each: the policy's (the body failed while read), the parser's.
POLICY_LINE = "{method} {path} -> 400 (body_not_decodable, <{size} bytes in>)"
PARSER_LINE = "rejected a malformed request from 127.0.0.1 -> 400 (ContentEncodingError)"


@pytest.mark.parametrize(
    ("name", "body", "logged"),
    [
        ("gzip", NOT_COMPRESSED, POLICY_LINE),
        ("deflate", NOT_COMPRESSED, POLICY_LINE),
        ("deflate", CUT_DEFLATE, PARSER_LINE),
    ],
    ids=["gzip", "deflate", "deflate-cut-short"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", CAPTURE.format(rollout="enc")), ("PUT", "/captures/rollouts/enc/metadata")],
    ids=["capture", "metadata"],
)
async def test_an_undecodable_body_leaves_one_info_line_and_no_traceback(
    make_stack: MakeStack, caplog, name, body, logged, method, path
):
    """A new-user trial: the client got its 400, and the log an ERROR "Unhandled exception"
    with tracebacks (aiohttp's lingering close read the broken body again). A deflate body
    cut short was a 415 saying deflate is not supported."""
    caplog.set_level(logging.DEBUG)
    stack = await make_stack()
    raw = await _send_and_read_to_close(
        stack.client.port,
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: {name}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )
    # (The server closed the connection: the rest of such a body cannot be parsed.)
    head, _, answer = raw.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"400", raw
    err = json.loads(answer)["error"]
    assert (err["code"], err["param"]) == ("body_not_decodable", "Content-Encoding")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "capture_proxy"] == [
        ("INFO", logged.format(method=method, path=path, size=len(body)))
    ]
    assert stack.sent == []


@pytest.mark.parametrize("name", ["br", "compress", "gzip, gzip", "zstd"])
async def test_an_encoding_the_proxy_cannot_decode_is_a_415(make_stack: MakeStack, name):
    stack = await make_stack()
    resp = await stack.client.post(
        CAPTURE.format(rollout="r1"),
        data=b"\x00\x01binary",
        headers={"Content-Type": "application/json", "Content-Encoding": name},
    )
    assert resp.status == 415, await resp.text()
    err = (await resp.json())["error"]
    assert (err["code"], err["param"]) == ("unsupported_content_encoding", "Content-Encoding")
    assert stack.sent == []
