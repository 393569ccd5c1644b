"""Tier 2: the harness always gets an answer or a clear error; nothing fails silently."""

from __future__ import annotations

import socket

import pytest

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.store.base import StoreError
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.conftest import CAPTURE, Stack
from tests.proxy.test_capture import USER, _body, _read_stream


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_down_gives_502_and_stores_no_success(aiohttp_client, tmp_path, stream):
    settings = Settings(backend=f"http://127.0.0.1:{_free_port()}", store=tmp_path / "s")
    client = await aiohttp_client(build_proxy_app(settings, SQLiteStore(tmp_path / "s")))
    resp = await client.post(CAPTURE.format(rollout="r1"), json=_body(USER, stream=stream))
    assert resp.status == 502
    err = (await resp.json())["error"]
    assert err["type"] == "upstream_error" and err["code"] == "engine_unreachable"
    assert "unreachable" in err["message"]
    summary = await (await client.get("/captures/rollouts/r1")).json()
    assert (summary["num_complete"], summary["num_failed"], summary["num_chains"]) == (0, 1, 0)
    chains = await (await client.get("/captures/rollouts/r1/chains")).json()
    assert chains["chains"] == []
    assert chains["unlinked_calls"][0]["status"] == "failed"


async def test_engine_error_status_passes_through_in_openai_shape(make_stack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(fail_status=503))
    resp = await stack.chat("r1", _body(USER))
    assert resp.status == 503
    err = (await resp.json())["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    summary = await stack.get_json("/captures/rollouts/r1")
    assert (summary["num_failed"], summary["num_chains"]) == (1, 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_without_token_data_still_answers_and_marks_rollout(make_stack, stream):
    stack = await make_stack(engine_config=ScriptedEngineConfig(omit_token_ids=True))
    resp = await stack.chat("r1", _body(USER, stream=stream))
    assert resp.status == 200
    if stream:
        chunks, done = await _read_stream(resp)
        assert done and chunks
    else:
        assert (await resp.json())["choices"][0]["message"]["tool_calls"]
    summary = await stack.get_json("/captures/rollouts/r1")
    assert summary["incomplete"] is True
    assert summary["num_incomplete"] == 1 and summary["num_chains"] == 0
    assert summary["diagnostics"]["calls_by_kind"] == {"capture_incomplete": 1}
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["diagnostics"][0]["details"]["reasons"] == [
        "engine sent no prompt_token_ids",
        "engine sent no token_ids",
        "engine sent no logprobs",
    ]


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        (b"{not json", 400, "body"),
        (b'{"model": "m"}', 400, "messages"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "n"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "stream_options": "x"}',
            400,
            "stream_options",
        ),
    ],
)
async def test_bad_input_is_refused_and_never_forwarded(stack: Stack, raw, status, param):
    resp = await stack.client.post(
        CAPTURE.format(rollout="r1"), data=raw, headers={"Content-Type": "application/json"}
    )
    assert resp.status == status
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert stack.sent == []
    assert (await stack.get_json("/captures/rollouts"))["rollouts"] == []


async def test_body_over_the_limit_is_413(make_stack):
    stack = await make_stack(max_request_body_bytes=1000)
    resp = await stack.chat("r1", _body([{"role": "user", "content": "x" * 2000}]))
    assert resp.status == 413
    assert "max_request_body_bytes" in (await resp.json())["error"]["message"]
    assert stack.sent == []


async def test_uncaptured_paths_are_forwarded_and_not_stored(stack: Stack):
    models = await stack.get_json("/v1/models")
    assert models["data"][0]["id"] == "scripted-qwen"
    resp = await stack.client.post("/v1/chat/completions", json=_body(USER))
    assert resp.status == 200 and "prompt_token_ids" not in await resp.json()
    resp = await stack.client.post("/ng-rollout/r9/v1/chat/completions", json=_body(USER))
    assert resp.status == 200
    tokens = await (await stack.client.post("/tokenize", json={"prompt": "hello"})).json()
    assert tokens["tokens"] == [14990]
    assert len(stack.sent) == 2
    # Neither the plain nor the correlation-only call asked for token data or was stored.
    assert all("return_token_ids" not in s.request_body for s in stack.sent)
    assert (await stack.get_json("/captures/rollouts"))["rollouts"] == []


async def test_health(stack: Stack):
    health = await stack.get_json("/health")
    assert health["status"] == "ok" and health["store"]["kind"] == "sqlite"


@pytest.mark.parametrize("levels", [300, 100_000])
async def test_deeply_nested_bodies_are_400s_not_500s(stack: Stack, levels):
    raw = (
        b'{"model": "scripted-qwen", "messages": [{"role": "user", "content": "x"}], "x": '
        + b"[" * levels
        + b"]" * levels
        + b"}"
    )
    resp = await stack.client.post(
        CAPTURE.format(rollout="r1"), data=raw, headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and "nests" in error["message"]
    assert stack.sent == []
    assert (await stack.get_json("/health"))["status"] == "ok"


async def test_health_is_degraded_while_writes_fail_and_recovers_by_itself(make_stack, tmp_path):
    """The store still answers reads (its own health is fine) but refuses writes: ``/health``
    is 503 ``degraded`` with the first failed write's error, ok again after one succeeds."""

    class FullThenFreed(SQLiteStore):
        full = True
        failures = 0

        async def put_call(self, record, request=None, digests=None):
            if self.full:
                self.failures += 1
                raise StoreError(f"database or disk is full (injected #{self.failures})")
            return await super().put_call(record, request, digests)

    store = FullThenFreed(tmp_path / "full")
    stack = await make_stack(store=store)
    before = await stack.client.get("/health")
    assert before.status == 200 and (await before.json())["status"] == "ok"
    await stack.chat("r1", _body(USER))
    await stack.chat("r2", _body(USER))
    resp = await stack.client.get("/health")
    assert resp.status == 503
    health = await resp.json()
    assert health["status"] == "degraded"
    # the first failed write's error, not the latest one's
    assert health["store"]["write_error"] == ("StoreError: database or disk is full (injected #1)")
    assert health["capture"]["store_failures"] == 2
    metrics = await (await stack.client.get("/metrics")).text()
    assert "capture_proxy_store_failures_total 2.0" in metrics
    store.full = False
    await stack.chat("r3", _body(USER))
    after = await stack.client.get("/health")
    assert after.status == 200
    body = await after.json()
    assert body["status"] == "ok" and "write_error" not in body["store"]
