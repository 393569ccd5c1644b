"""Tier 2: engine faults and client disconnects. The harness gets an answer or a proper error;
the call is recorded as failed or incomplete with the reason; never a silent success."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import aiohttp
import pytest

from capture_proxy.core.sse import SSEStreamDecoder
from capture_proxy.proxy import executor as capture_module
from capture_proxy.scripted_engine import CLIENT_GONE, Faults, ScriptedEngineConfig
from tests.proxy.conftest import CAPTURE, Stack
from tests.proxy.test_capture import USER, _body

WAIT_S = 10.0


async def _events(resp) -> list[str]:
    decoder = SSEStreamDecoder()
    events = []
    async for data in resp.content.iter_any():
        events += decoder.feed(data)
    return [e.data for e in events + decoder.close()]


async def _only_call(stack: Stack, rollout: str = "r1") -> dict:
    """The rollout's single call, read once the proxy has stored it (bounded wait)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            resp = await stack.client.get(f"/captures/rollouts/{rollout}")
            if resp.status == 200 and (await resp.json())["num_calls"] == 1:
                break
            await asyncio.sleep(0.02)
    listing = await stack.get_json(f"/captures/rollouts/{rollout}/chains")
    call_id = (listing["chains"] + [{"calls": listing["unlinked_calls"]}])[0]["calls"][0]["call_id"]
    return await stack.get_json(f"/captures/calls/{call_id}")


async def _leave_mid_stream(resp) -> None:
    """Read the role chunk and three token chunks, then go away (the harness, mid-stream)."""
    data_lines = 0
    while data_lines < 4:
        line = await resp.content.readline()
        assert line, "stream ended early"
        data_lines += line.startswith(b"data: ")
    resp.close()


async def _faulty(make_stack, faults: Faults, **settings) -> Stack:
    return await make_stack(engine_config=ScriptedEngineConfig(faults=faults), **settings)


async def test_first_byte_timeout_is_a_504(make_stack):
    stack = await _faulty(
        make_stack, Faults(first_byte_delay_s=5.0), upstream_first_byte_timeout_s=0.2
    )
    resp = await stack.chat("r1", _body(USER))
    assert resp.status == 504
    error = (await resp.json())["error"]
    assert error["code"] == "engine_timeout"
    assert error["message"] == (
        f"engine at {stack.engine.make_url('').human_repr().rstrip('/')} timed out: no response "
        "head within 0.2 s (setting upstream_first_byte_timeout_s)"
    )
    call = await _only_call(stack)
    assert call["status"] == "failed"
    assert call["diagnostics"][0]["kind"] == "upstream_failed"


async def test_stalled_stream_ends_with_an_in_band_error_and_an_incomplete_call(make_stack):
    stack = await _faulty(make_stack, Faults(chunk_delay_s=5.0), upstream_read_timeout_s=0.2)
    resp = await stack.chat("r1", _body(USER, stream=True))
    assert resp.status == 200  # headers were sent before the stall
    events = await _events(resp)
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["type"] == "upstream_error"
    call = await _only_call(stack)
    assert call["status"] == "incomplete"
    reasons = call["diagnostics"][-1]["details"]["reasons"]
    assert "engine stream broke: TimeoutError: no bytes within 0.2 s (setting " \
        "upstream_read_timeout_s)" in reasons


@pytest.mark.parametrize(
    ("faults", "reason"),
    [
        (Faults(drop_done=True), "engine stream ended without [DONE]"),
        (Faults(disconnect_after_chunks=3), "engine stream broke"),
        (Faults(malformed_chunk_at=2), "engine sent a malformed stream event"),
    ],
    ids=["no-done", "disconnect", "malformed"],
)
async def test_broken_streams_are_recorded_incomplete(make_stack, faults, reason):
    stack = await _faulty(make_stack, faults)
    resp = await stack.chat("r1", _body(USER, stream=True))
    events = await _events(resp)
    assert "[DONE]" not in events
    call = await _only_call(stack)
    assert call["status"] == "incomplete"
    assert any(r.startswith(reason) for r in call["diagnostics"][-1]["details"]["reasons"])
    summary = await stack.get_json("/captures/rollouts/r1")
    assert summary["incomplete"] is True and summary["num_chains"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_ids_and_log_probs_of_different_lengths_are_refused(make_stack, stream):
    stack = await _faulty(make_stack, Faults(drop_logprob_at=1))
    resp = await stack.chat("r1", _body(USER, stream=stream))
    assert resp.status == 200
    await resp.read()
    call = await _only_call(stack)
    n = len(stack.sent[0].generation_token_ids)
    assert call["status"] == "incomplete"
    assert call["diagnostics"][-1]["details"]["reasons"] == [
        f"generation_token_ids has {n} ids but generation_log_probs has {n - 1} values"
    ]
    assert call["generation_token_ids"] == stack.sent[0].generation_token_ids  # kept, not lost


@pytest.mark.parametrize("stream", [False, True])
async def test_nan_log_prob_is_kept_and_flagged(make_stack, stream):
    stack = await _faulty(make_stack, Faults(nan_logprob_at=2))
    resp = await stack.chat("r1", _body(USER, stream=stream))
    await resp.read()
    call = await _only_call(stack)
    assert call["status"] == "complete"
    assert call["generation_log_probs"][2] is None  # JSON has no NaN: null, and flagged
    assert call["diagnostics"] == [
        {"kind": "non_finite_logprob", "details": {"positions": [2], "count": 1}}
    ]
    expected = stack.sent[0].generation_log_probs
    got = call["generation_log_probs"]
    assert all(
        math.isclose(a, b, abs_tol=1e-6)
        for i, (a, b) in enumerate(zip(expected, got, strict=True))
        if i != 2
    )


async def test_engine_4xx_passes_through_in_openai_shape(make_stack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(fail_status=400))
    resp = await stack.chat("r1", _body(USER))
    assert resp.status == 400
    assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
    assert (await _only_call(stack))["status"] == "failed"


async def test_client_disconnect_cancels_upstream_and_records_what_arrived(make_stack):
    stack = await _faulty(make_stack, Faults(chunk_delay_s=0.05))
    await _leave_mid_stream(await stack.chat("r1", _body(USER, stream=True)))
    async with asyncio.timeout(WAIT_S):
        await stack.engine_app[CLIENT_GONE].wait()  # the proxy closed its upstream request
    call = await _only_call(stack)
    assert call["status"] == "incomplete"
    assert (
        "client disconnected before the stream ended"
        in call["diagnostics"][-1]["details"]["reasons"]
    )
    sent = stack.sent[0]
    assert call["prompt_token_ids"] == sent.prompt_token_ids
    got = call["generation_token_ids"]
    assert 0 < len(got) < len(sent.generation_token_ids)
    assert got == sent.generation_token_ids[: len(got)]


async def test_proxy_and_read_api_tokens(make_stack):
    stack = await make_stack(captures_token="read-secret", proxy_token="proxy-secret")
    assert (await stack.chat("r1", _body(USER))).status == 401
    bad = await stack.chat("r1", _body(USER), headers={"Authorization": "Bearer nope"})
    assert bad.status == 401
    assert (await bad.json())["error"]["code"] == "invalid_api_key"
    ok = await stack.chat("r1", _body(USER), headers={"Authorization": "Bearer proxy-secret"})
    assert ok.status == 200
    # The harness's token is for the proxy; it is not forwarded to the engine.
    assert "authorization" not in {k.lower() for k in stack.sent[0].request_headers}
    assert (await stack.client.get("/captures/rollouts")).status == 401
    listing = await stack.client.get(
        "/captures/rollouts", headers={"Authorization": "Bearer read-secret"}
    )
    assert listing.status == 200
    assert (await stack.client.get("/health")).status == 200


async def test_the_proxy_token_may_come_in_either_header(make_stack, caplog):
    """Claude Code sends ``Authorization`` and ``x-api-key`` when ``ANTHROPIC_AUTH_TOKEN`` and
    ``ANTHROPIC_API_KEY`` are both set: the token in either passes, both are stripped before
    the engine, and a 401 names the headers checked and sent, never their values."""
    caplog.set_level(logging.DEBUG)
    stack = await make_stack(captures_token="read-secret", proxy_token="proxy-secret")
    for headers in (
        {"x-api-key": "proxy-secret", "Authorization": "Bearer other-secret"},
        {"x-api-key": "other-secret", "Authorization": "Bearer proxy-secret"},
    ):
        resp = await stack.chat("r1", _body(USER), headers=headers)
        assert resp.status == 200, await resp.text()
        sent = {k.lower() for k in stack.sent[-1].request_headers}
        assert "authorization" not in sent and "x-api-key" not in sent
    checked = "invalid token for the proxy: checked Authorization: Bearer and x-api-key, and the"
    refused = [
        ({}, "no token for the proxy: send it as Authorization: Bearer <token> or x-api-key: "
             "<token>"),
        ({"Authorization": "Bearer other-secret"},
         f"{checked} Authorization header sent does not carry it"),
        ({"Authorization": "Basic proxy-secret"},
         f"{checked} Authorization header sent does not carry it"),
        ({"x-api-key": "other-secret"}, f"{checked} x-api-key header sent does not carry it"),
        ({"x-api-key": "other-secret", "Authorization": "Bearer other-secret"},
         f"{checked} Authorization and x-api-key headers sent do not carry it"),
    ]  # fmt: skip
    for headers, message in refused:
        resp = await stack.chat("r1", _body(USER), headers=headers)
        err = (await resp.json())["error"]
        assert (resp.status, err["code"], err["message"]) == (401, "invalid_api_key", message)
    assert len(stack.sent) == 2
    # The read API takes its token the same ways.
    for headers in ({"x-api-key": "read-secret"}, {"Authorization": "Bearer read-secret"}):
        assert (await stack.client.get("/captures/rollouts", headers=headers)).status == 200
    resp = await stack.client.get("/captures/rollouts", headers={"x-api-key": "proxy-secret"})
    assert (resp.status, (await resp.json())["error"]["message"]) == (
        401,
        "invalid token for the read API: checked Authorization: Bearer and x-api-key, and the "
        "x-api-key header sent does not carry it",
    )
    assert "secret" not in caplog.text


async def test_backend_api_key_replaces_the_harness_credential(make_stack):
    stack = await make_stack(backend_api_key="engine-key")
    await (await stack.chat("r1", _body(USER), headers={"Authorization": "Bearer harness"})).read()
    assert stack.sent[0].request_headers["Authorization"] == "Bearer engine-key"


async def test_bad_rollout_ids_at_the_proxy(stack: Stack):
    for rid in ["..", "%2e%2e", "a%2Fb", "-x", "r%C3%A9", "a" * 300, "%00"]:
        resp = await stack.client.post(CAPTURE.format(rollout=rid), json=_body(USER))
        assert resp.status in (400, 404), rid
        if resp.status == 400:
            assert (await resp.json())["error"]["param"] == "rollout_id"
    assert stack.sent == []


async def test_the_answer_ends_at_done_without_waiting_for_the_engines_body_end(
    make_stack, monkeypatch
):
    """The harness gets ``[DONE]`` and the end of its body as soon as the call is stored; an
    engine body that lingers after ``[DONE]`` is closed after ``BODY_END_TIMEOUT_S``."""
    monkeypatch.setattr(capture_module, "BODY_END_TIMEOUT_S", 0.2)
    stack = await _faulty(make_stack, Faults(hold_body_after_done_s=30.0))
    async with asyncio.timeout(WAIT_S):  # the engine holds its body open for 30 s
        resp = await stack.chat("r1", _body(USER, stream=True))
        events = await _events(resp)
    assert events[-1] == "[DONE]"
    call = await _only_call(stack)
    assert call["status"] == "complete"
    assert call["generation_token_ids"] == stack.sent[0].generation_token_ids


async def test_the_engine_connection_is_kept_alive_across_streamed_calls(stack: Stack):
    for _ in range(3):
        resp = await stack.chat("r1", _body(USER, stream=True))
        assert (await _events(resp))[-1] == "[DONE]"
    peers = [sent.peer for sent in stack.sent]
    assert len(peers) == 3 and peers[0] is not None
    assert peers == [peers[0]] * 3  # one connection: each body was read to its end


async def test_a_harness_that_leaves_before_the_first_byte_still_gets_its_call_recorded(
    make_stack,
):
    """The engine takes 1 s to its first byte; the harness gives up after 0.1 s. The call is
    stored incomplete (nothing arrived), the engine's request is closed, the proxy serves on."""
    stack = await _faulty(make_stack, Faults(first_byte_delay_s=1.0))
    with pytest.raises(asyncio.TimeoutError):
        await stack.chat("r1", _body(USER, stream=True), timeout=aiohttp.ClientTimeout(total=0.1))
    call = await _only_call(stack)
    assert call["status"] == "incomplete"
    [diag] = [d for d in call["diagnostics"] if d["kind"] == "capture_incomplete"]
    # The test server cancels handlers of closed connections (run_app does not: then the
    # disconnect shows when the response starts, "... before the stream ended").
    assert diag["details"]["reasons"] == ["client disconnected before the engine answered"]
    assert call["generation_token_ids"] == []
    assert (await stack.get_json("/health"))["status"] == "ok"


async def test_a_cut_off_stream_retried_to_completion_leaves_the_rollout_complete(make_stack):
    """The harness loses a stream midway and retries the same request (an SDK's retry header);
    the retry completes and the harness goes on from its answer. The cut-off call is kept (as
    incomplete, unlinked), the retry supersedes it: the rollout reads complete, its chain is
    retry -> child."""
    from tests.proxy.test_chains_rest import _echo

    stack = await _faulty(make_stack, Faults(chunk_delay_s=0.02))
    body = _body(USER, stream=True)
    await _leave_mid_stream(await stack.chat("r1", body, headers={"x-stainless-retry-count": "0"}))
    cut = await _only_call(stack)
    assert cut["status"] == "incomplete"
    assert (await stack.get_json("/captures/rollouts/r1"))["incomplete"] is True

    retry = await stack.chat("r1", body, headers={"x-stainless-retry-count": "1"})
    assert (await _events(retry))[-1] == "[DONE]"
    retry_id = retry.headers["X-Capture-Call-Id"]
    retried = await stack.get_json(f"/captures/calls/{retry_id}")
    assert (retried["status"], retried["retry_of"]) == ("complete", cut["call_id"])
    assert (await stack.get_json("/captures/rollouts/r1"))["incomplete"] is False

    message = retried["response_message"]
    messages = [
        *USER,
        _echo(message),
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "a.txt"},
    ]
    child = await stack.chat("r1", _body(messages, stream=True))
    assert (await _events(child))[-1] == "[DONE]"
    child_id = child.headers["X-Capture-Call-Id"]
    assert (await stack.get_json(f"/captures/calls/{child_id}"))["parent_call_id"] == retry_id
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert chains["incomplete"] is False
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [
        [retry_id, child_id]
    ]
    assert [(u["call_id"], u["reason"], u["superseded_by"]) for u in chains["unlinked_calls"]] == [
        (cut["call_id"], "superseded_retry", retry_id)
    ]
    summary = await stack.get_json("/captures/rollouts/r1")
    assert (summary["incomplete"], summary["num_calls"], summary["num_chains"]) == (False, 3, 1)
