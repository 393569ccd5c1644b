"""Tier 2: hostile input and careless clients (issue 26, classes 4, 5, 7-10): lone surrogates
on every API front and the read API, a recorder that never fails a call, non-finite log probs
in exact-token mode, ``finish_reason: null``, the fuzzer's findings and the frictions."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import pytest

from capture_proxy.scripted_engine import Faults, ScriptedEngineConfig
from tests.proxy.conftest import CAPTURE, MakeStack, Stack
from tests.proxy.test_capture import USER, _body

BASE = "/ng-rollout/{rollout}/training-token-capture"
LONE = "\ud800"
WAIT_S = 10.0


def _raw_json(body: dict) -> bytes:
    """JSON text with lone surrogates escaped (``\\ud800``), as a careless client writes it."""
    return json.dumps(body).encode()


async def _post_raw(stack: Stack, path: str, body: dict, **headers: str) -> aiohttp.ClientResponse:
    return await stack.client.post(
        path, data=_raw_json(body), headers={"Content-Type": "application/json", **headers}
    )


def _messages_body(**extra) -> dict:
    return {
        "model": "scripted-qwen",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "List the files."}],
        **extra,
    }


def _responses_body(**extra) -> dict:
    return {"model": "scripted-qwen", "input": "List the files.", **extra}


async def _num_calls(stack: Stack, rollout: str) -> int:
    resp = await stack.client.get(f"/captures/rollouts/{rollout}")
    if resp.status == 404:
        return 0
    return int((await resp.json())["num_calls"])


# --- 4. lone surrogates ------------------------------------------------------------------

SURROGATE_CASES = [
    (
        "/v1/chat/completions",
        _body([{"role": "user", "content": "a" + LONE}]),
        "messages.0.content",
    ),
    (
        "/v1/messages",
        _messages_body(messages=[{"role": "user", "content": LONE}]),
        "messages.0.content",
    ),
    ("/v1/messages", _messages_body(metadata={"user_id": LONE}), "metadata.user_id"),
    ("/v1/messages", _messages_body(container=LONE), "container"),
    ("/v1/responses", _responses_body(instructions=LONE), "instructions"),
    ("/v1/responses", _responses_body(metadata={"k": LONE}), "metadata.k"),
    ("/v1/responses", _responses_body(n=LONE), "n"),
    ("/v1/responses", _responses_body(metadata={LONE: "v"}), "metadata"),
]


@pytest.mark.parametrize(("api_path", "body", "field"), SURROGATE_CASES)
async def test_a_lone_surrogate_is_a_400_naming_the_field_on_every_front(
    make_stack: MakeStack, api_path, body, field
):
    stack = await make_stack()
    resp = await _post_raw(stack, BASE.format(rollout="s1") + api_path, body)
    assert resp.status == 400, await resp.text()
    got = await resp.json()
    if api_path == "/v1/messages":
        assert got["type"] == "error"
        assert got["error"]["type"] == "invalid_request_error"
        assert f"'{field}'" in got["error"]["message"]
    else:
        assert got["error"]["param"] == field
        assert "surrogate" in got["error"]["message"]
    assert stack.sent == []
    assert await _num_calls(stack, "s1") == 0


@pytest.mark.parametrize(
    "metadata", [{"tags": ["ok", LONE]}, {"annotations": {LONE: 1}}, {"annotations": {"k": LONE}}]
)
async def test_a_lone_surrogate_in_read_api_metadata_is_a_400(make_stack: MakeStack, metadata):
    stack = await make_stack()
    assert (await stack.chat("r1", _body(USER))).status == 200
    resp = await stack.client.put(
        "/captures/rollouts/r1/metadata",
        data=_raw_json(metadata),
        headers={"Content-Type": "application/json"},
    )
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["code"] == "invalid_text"
    assert err["param"].startswith(("tags", "annotations"))


# --- 5. the recorder -----------------------------------------------------------------------


async def test_a_long_rollout_id_is_recorded_under_a_hashed_name(make_stack: MakeStack, tmp_path):
    record_dir = tmp_path / "rec"
    stack = await make_stack(record_dir=record_dir)
    rollout = "r" * 256
    resp = await stack.chat(rollout, _body(USER))
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Capture-Call-Id"]
    (path,) = record_dir.iterdir()
    assert len(path.name) < 200 and path.name.startswith("r" * 64)
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["rollout_id"] == rollout
    assert line["call_id"] == resp.headers["X-Capture-Call-Id"]


async def test_what_the_recorder_cannot_write_never_fails_the_call(
    make_stack: MakeStack, tmp_path, caplog
):
    record_dir = tmp_path / "rec"
    stack = await make_stack(record_dir=record_dir)
    plain = json.dumps(_body(USER))
    deep = plain[:-1] + ', "deep": ' + "[" * 990 + '"x"' + "]" * 990 + "}"
    resp = await stack.client.post(
        CAPTURE.format(rollout="d1"), data=deep, headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400, await resp.text()  # refused, in OpenAI's shape; not a 500
    assert (await resp.json())["error"]["code"] == "invalid_request"
    lone = await _post_raw(
        stack, CAPTURE.format(rollout="d1"), _body([{"role": "user", "content": LONE}])
    )
    assert lone.status == 400
    lines = [json.loads(x) for x in (record_dir / "d1.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == [400, 400]
    assert "\\ud800" in lines[1]["body_raw"]  # kept as the client wrote it


async def test_engine_keys_are_redacted_in_recordings(make_stack: MakeStack, tmp_path):
    stack = await make_stack(record_dir=tmp_path / "rec")
    resp = await stack.chat(
        "k1", _body(USER), headers={"api-key": "azure-secret", "X-Goog-Api-Key": "goog-secret"}
    )
    assert resp.status == 200
    text = (tmp_path / "rec" / "k1.jsonl").read_text()
    assert "azure-secret" not in text and "goog-secret" not in text
    headers = {k.lower(): v for k, v in json.loads(text)["headers"]}
    assert headers["api-key"] == headers["x-goog-api-key"] == "<redacted>"


async def test_query_keys_and_custom_token_headers_are_redacted_in_recordings(
    make_stack: MakeStack, tmp_path
):
    # The trial's case (#9): ?key= and X-Custom-Token were kept in clear.
    stack = await make_stack(record_dir=tmp_path / "rec")
    path = "/ng-rollout/q1/training-token-capture/v1/messages"
    resp = await stack.client.post(
        path + "?beta=true&key=SECRETR7",
        json={
            "model": "scripted-qwen",
            "max_tokens": 20,
            "messages": [{"role": "user", "content": "hi"}],
        },
        headers={"X-Custom-Token": "SECRETR3", "x-api-key": "sk-ant-SECRETR8"},
    )
    assert resp.status == 200, await resp.text()
    text = (tmp_path / "rec" / "q1.jsonl").read_text()
    assert "SECRETR" not in text
    line = json.loads(text)
    assert line["path"] == path + "?beta=true&key=%3Credacted%3E"
    headers = {k.lower(): v for k, v in line["headers"]}
    assert headers["x-custom-token"] == headers["x-api-key"] == "<redacted>"
    assert headers["content-type"] == "application/json"


@pytest.mark.parametrize("how", ["delete", "retire"])
async def test_deleting_or_retiring_a_rollout_removes_its_recording(
    make_stack: MakeStack, tmp_path, how
):
    record_dir = tmp_path / "rec"
    stack = await make_stack(record_dir=record_dir)
    assert (await stack.chat("gone", _body(USER))).status == 200
    assert (await stack.chat("kept", _body(USER))).status == 200
    if how == "delete":
        assert (await stack.client.delete("/captures/rollouts/gone")).status == 200
    else:
        snap = await (await stack.client.post("/captures/rollouts/gone/freeze")).json()
        retired = await stack.client.post(
            "/captures/rollouts/gone/retire",
            json={"snapshot_id": snap["snapshot_id"], "version": snap["version"]},
        )
        assert retired.status == 200, await retired.text()
    assert sorted(p.name for p in record_dir.iterdir()) == ["kept.jsonl"]


# --- 7. non-finite log probs in exact-token mode ------------------------------------------------


async def _stored_only_call(stack: Stack, rollout: str) -> dict:
    async with asyncio.timeout(WAIT_S):
        while await _num_calls(stack, rollout) < 1:
            await asyncio.sleep(0.02)
    chains = await stack.get_json(f"/captures/rollouts/{rollout}/chains")
    calls = [c for ch in chains["chains"] for c in ch["calls"]] + chains["unlinked_calls"]
    assert len(calls) == 1
    return await stack.get_json(f"/captures/calls/{calls[0]['call_id']}")


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["NaN", "-Infinity"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dialect", ["vllm_completions", "sglang_generate"])
async def test_bare_non_finite_log_probs_are_kept_and_flagged_in_exact_mode(
    make_stack: MakeStack, dialect, stream, value
):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(faults=Faults(bare_logprob_at=(2, value))),
        prompt_mode="exact_tokens",
        tokens_in_dialect=dialect,
    )
    resp = await stack.chat("n1", _body(USER, stream=stream))
    assert resp.status == 200, await resp.text()
    await resp.read()
    call = await _stored_only_call(stack, "n1")
    assert call["status"] == "complete"
    assert call["generation_log_probs"][2] is None  # JSON has no NaN: null, and flagged
    flagged = {"kind": "non_finite_logprob", "details": {"positions": [2], "count": 1}}
    assert flagged in call["diagnostics"]
    chains = await stack.get_json("/captures/rollouts/n1/chains")
    assert [c["call_id"] for c in chains["chains"][0]["calls"]] == [call["call_id"]]


# --- 8. finish_reason null -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_missing_finish_reason_gets_a_diagnostic(make_stack: MakeStack, stream):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(faults=Faults(null_finish_reason=True))
    )
    resp = await stack.chat("f1", _body(USER, stream=stream))
    assert resp.status == 200, await resp.text()
    await resp.read()
    call = await _stored_only_call(stack, "f1")
    assert call["finish_reason"] is None
    assert {"kind": "finish_reason_missing", "details": {}} in call["diagnostics"]


# --- 9. the fuzzer's findings ----------------------------------------------------------------


async def test_deeply_nested_tool_call_arguments_are_a_400(make_stack: MakeStack):
    stack = await make_stack()
    arguments = "[" * 6000 + "]" * 6000
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    resp = await stack.chat("deep", _body(messages))
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == "messages.2.tool_calls.0.function.arguments"
    assert stack.sent == []


@pytest.mark.parametrize("api", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_rollout_id_errors_on_messages_paths_have_anthropics_shape(
    make_stack: MakeStack, api
):
    stack = await make_stack()
    resp = await stack.client.post(
        "/ng-rollout/bad!id/training-token-capture" + api, json=_messages_body()
    )
    assert resp.status == 400
    got = await resp.json()
    assert got["type"] == "error"
    assert got["error"]["type"] == "invalid_request_error"
    assert "rollout id" in got["error"]["message"]


async def test_a_bogus_expect_header_is_a_json_417(make_stack: MakeStack):
    stack = await make_stack()
    resp = await stack.client.post(
        CAPTURE.format(rollout="e1"), json=_body(USER), headers={"Expect": "bogus"}
    )
    assert resp.status == 417
    err = (await resp.json())["error"]
    assert (err["code"], err["param"]) == ("expectation_failed", "Expect")
    assert stack.sent == []


async def test_a_long_static_file_name_is_a_404(make_stack: MakeStack):
    stack = await make_stack()
    resp = await stack.client.get("/captures/ui/static/" + "a" * 3000)
    assert resp.status == 404, await resp.text()
    assert (await resp.json())["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("when", ["mid-stream", "before-headers", "whole-answer"])
async def test_a_client_gone_is_one_log_line_without_a_traceback(
    make_stack: MakeStack, caplog, when
):
    caplog.set_level(logging.DEBUG)
    faults = Faults(chunk_delay_s=0.05) if when == "mid-stream" else Faults(first_byte_delay_s=0.3)
    stack = await make_stack(engine_config=ScriptedEngineConfig(faults=faults))
    stream = when != "whole-answer"
    if when == "mid-stream":
        resp = await stack.chat("gone", _body(USER, stream=True))
        assert resp.status == 200
        await resp.content.readline()
        resp.close()
    else:
        with pytest.raises(TimeoutError):
            await stack.chat(
                "gone",
                _body(USER, stream=stream),
                timeout=aiohttp.ClientTimeout(total=0.1),
            )
    call = await _stored_only_call(stack, "gone")
    assert call["status"] == "incomplete"

    def post_lines() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith("POST /ng-rollout/gone/")
        ]

    async with asyncio.timeout(WAIT_S):
        while not post_lines():
            await asyncio.sleep(0.02)
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    (line,) = post_lines()
    assert "client gone" in line, line


# --- 10. frictions ---------------------------------------------------------------------------


async def test_the_read_only_app_answers_writes_with_a_405(tmp_path: Path, aiohttp_client):
    from capture_proxy.app import build_read_only_app
    from capture_proxy.config import Settings
    from capture_proxy.store.sqlite import SQLiteStore

    settings = Settings(backend="http://no-backend.invalid", store=tmp_path / "ro")
    client = await aiohttp_client(build_read_only_app(settings, SQLiteStore(tmp_path / "ro")))
    for method, path in [
        ("POST", "/captures/rollouts/r1/freeze"),
        ("PUT", "/captures/rollouts/r1/metadata"),
        ("POST", "/captures/rollouts/r1/retire"),
        ("DELETE", "/captures/rollouts/r1"),
    ]:
        resp = await client.request(method, path, json={})
        assert resp.status == 405, (method, path, await resp.text())
        err = (await resp.json())["error"]
        assert err["code"] == "read_only"
        assert "read-only" in err["message"]


def test_serve_help_names_the_proxy_token(capsys):
    from capture_proxy.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--proxy-token" in out and "CAPTURE_PROXY_PROXY_TOKEN" in out
    assert "--allowed-host" in out


async def test_a_client_gone_mid_body_is_one_log_line_without_a_traceback(
    make_stack: MakeStack, caplog
):
    """The fuzzer's 239 tracebacks: a client that resets the connection while sending its
    body was an 'unhandled error' (500) with a traceback."""
    import socket
    import struct

    caplog.set_level(logging.INFO)
    stack = await make_stack()
    body = json.dumps(_body(USER)).encode()
    head = (
        f"POST {CAPTURE.format(rollout='mb')} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Expect: 100-continue\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.client.port)
    writer.write(head)
    await writer.drain()
    # The 100 Continue says the handler runs and waits for the body (no sleep needed).
    async with asyncio.timeout(WAIT_S):
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
    writer.write(body[:-5])
    await writer.drain()
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
    writer.close()

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "/ng-rollout/mb/" in r.getMessage()]

    async with asyncio.timeout(WAIT_S):
        while not lines():
            await asyncio.sleep(0.02)
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    # The bytes that came before the reset (those sent, unless the reset overtook some) of
    # those declared.
    [line] = lines()
    prefix = f"POST {CAPTURE.format(rollout='mb')} -> 499 (client_gone, <"
    assert line.startswith(prefix) and line.endswith(f" of {len(body)} bytes in>)"), line
    assert 0 <= int(line.removeprefix(prefix).split(" ", 1)[0]) <= len(body) - 5, line
    assert stack.sent == []
    assert await _num_calls(stack, "mb") == 0
