"""Tier 2: weights move under the rollout (issue 32). The scripted engine plays vLLM 0.32's
pause rules (``scripted_engine.weights``); a call is paused at a known token (``hold_at``),
the engine paused in each mode, its version updated and resumed, and the harness's view, the
stored ids and log probs and the weight-version spans are checked against the same call made
without a pause."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from capture_proxy.proxy.weight_watch import WEIGHT_WATCHERS_KEY
from capture_proxy.scripted_engine import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from capture_proxy.scripted_engine.weights import WEIGHTS
from tests.proxy.api_clients import harness
from tests.proxy.conftest import Stack
from tests.proxy.test_api_contract import EXPECTED, POLICY

APIS = ["chat_completions", "responses", "messages"]
WAIT_S = 20.0
#: the token the engine holds the first call at
HOLD = 6


async def _stack(make_stack, mode: str, qwen_tokenizer_dir, dialect: str = "vllm_generate", **kw):
    engine = ScriptedEngineConfig(policy=POLICY, dev_mode=True, enable_scale_out=True)
    settings: dict[str, Any] = {"prompt_mode": mode, **kw}
    if mode == "exact_tokens":
        settings["tokens_in_dialect"] = dialect
        if dialect == "vllm_generate":
            settings["tokenizer"] = qwen_tokenizer_dir
    return await make_stack(engine_config=engine, **settings)


async def _engine(stack: Stack, path: str, **body: Any) -> Any:
    async with stack.client.session.post(stack.engine.make_url(path), json=body or None) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _update(stack: Stack, version: str) -> None:
    """Update the engine's version and let the proxy read it (its reader polls otherwise)."""
    await _engine(stack, "/update_weight_version", new_version=version)
    watcher = stack.client.server.app[WEIGHT_WATCHERS_KEY].for_backend(
        str(stack.engine.make_url("/")).rstrip("/")
    )
    assert watcher is not None and await watcher.read_version() == version


async def _paused_call(
    stack: Stack, api: str, stream: bool, mode: str, *, until_asked_paused: bool = False
):
    """The first call of a session, paused at token ``HOLD`` in ``mode`` (the engine's version
    then set to "2" and resumed); the harness's reply. ``until_asked_paused``: the engine
    enters the pause itself as it holds (``hold_pause``: no unpaused stall for the proxy's
    read timeout to cut), and resumes only once the proxy asked it whether it is paused (its
    read timeout fired)."""
    weights = stack.engine_app[WEIGHTS]
    weights.hold_at = HOLD
    if until_asked_paused:
        weights.hold_pause = mode
    h = harness(api, stack, "r1", stream=stream)
    h.start()
    call = asyncio.create_task(h.send())
    await asyncio.wait_for(weights.held.wait(), WAIT_S)
    if mode == "wait":
        await asyncio.wait_for(_engine(stack, "/pause?mode=wait"), WAIT_S)
        assert call.done() or await asyncio.wait_for(asyncio.shield(call), WAIT_S)
    elif not until_asked_paused:
        await _engine(stack, f"/pause?mode={mode}")
    await _update(stack, "2")
    if until_asked_paused:
        await asyncio.wait_for(weights.asked_paused.wait(), WAIT_S)
    await _engine(stack, "/resume")
    return await asyncio.wait_for(call, WAIT_S)


async def _reference(stack: Stack, api: str, stream: bool) -> Any:
    """The same first call in another rollout, without a pause: (reply, stored call)."""
    h = harness(api, stack, "ref", stream=stream)
    h.start()
    reply = await h.send()
    assert reply.status == 200
    return reply, await stack.get_json(f"/captures/calls/{reply.call_id}")


def _diagnostic(call: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((d["details"] for d in call["diagnostics"] if d["kind"] == kind), None)


SOURCES = {
    "vllm_generate": "engine_spans",
    "sglang_generate": "engine_reported",
    "vllm_completions": "observed",
}


@pytest.mark.parametrize("dialect", list(SOURCES))
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", APIS)
async def test_an_abort_is_continued_and_the_harness_sees_one_answer(
    make_stack, qwen_tokenizer_dir, api, stream, dialect
):
    stack = await _stack(make_stack, "exact_tokens", qwen_tokenizer_dir, dialect)
    reply = await _paused_call(stack, api, stream, "abort")
    assert reply.status == 200, reply.body
    content, reasoning, tools = EXPECTED[0]
    assert (reply.content, reply.reasoning) == (content, reasoning)
    assert [(name, args) for _, name, args in reply.tool_calls] == tools
    call = await stack.get_json(f"/captures/calls/{reply.call_id}")
    # the engine's two requests: the aborted one and its continuation, prompt + tokens so far
    first, rest = stack.sent[0], stack.sent[1]
    assert first.finish_reason == "abort" and len(first.generation_token_ids) == HOLD
    assert rest.prompt_token_ids == first.prompt_token_ids + first.generation_token_ids
    generated = first.generation_token_ids + rest.generation_token_ids
    assert call["status"] == "complete"
    assert call["generation_token_ids"] == generated
    stitched = np.float32(first.generation_log_probs + rest.generation_log_probs).tolist()
    assert call["generation_log_probs"] == stitched  # stored as float32
    # ... the tokens and log probs of the same call made without a pause (same weights)
    _, ref = await _reference(stack, api, stream)
    assert call["generation_token_ids"] == ref["generation_token_ids"]
    assert call["generation_log_probs"] == ref["generation_log_probs"]
    assert call["finish_reason"] == "tool_calls"
    n = len(generated)
    assert call["weight_versions"] == [
        {"version": "default", "start": 0, "end": HOLD},
        {"version": "2", "start": HOLD, "end": n},
    ]
    assert call["weight_version_source"] == SOURCES[dialect]
    resumed = _diagnostic(call, "generation_resumed")
    assert resumed is not None
    [resume] = resumed["resumes"]
    assert (resume["at_token"], resume["paused"]) == (HOLD, True)
    assert (resume["from_version"], resume["to_version"]) == ("default", "2")
    # the next call of the session links to it token for token, under the new version
    assert ref["weight_versions"] == [{"version": "2", "start": 0, "end": n}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", APIS)
async def test_an_abort_in_backend_template_mode_is_an_honest_retryable_error(
    make_stack, qwen_tokenizer_dir, api, stream
):
    stack = await _stack(make_stack, "backend_template", qwen_tokenizer_dir)
    reply = await _paused_call(stack, api, stream, "abort")
    if not stream:
        assert reply.status == 503
        error = reply.body["error"]
        # (Anthropic's 503 is overloaded_error, which Claude Code and the SDK retry)
        assert error["type"] in ("server_error", "overloaded_error")
        assert "aborted" in error["message"]
    else:
        assert reply.status == 200  # the stream had started
        names = [e.name for e in reply.events]
        datas = [e.data for e in reply.events]
        if api == "chat_completions":
            assert "[DONE]" not in datas and set(datas[-1]) == {"error"}
            assert not any(c.get("finish_reason") for d in datas[:-1] for c in d.get("choices", []))
        elif api == "responses":
            assert names[-1] == "response.failed" and "response.completed" not in names
        else:
            assert names[-1] == "error" and "message_stop" not in names
            # the type Claude Code retries, as the 503 of a whole answer
            assert datas[-1]["error"]["type"] == "overloaded_error"
    call = await stack.get_json(f"/captures/calls/{reply.call_id}")
    assert call["status"] == "incomplete"
    assert call["finish_reason"] == "abort"
    assert call["generation_token_ids"] == stack.sent[0].generation_token_ids
    assert len(call["generation_token_ids"]) == HOLD
    aborted = _diagnostic(call, "generation_aborted")
    assert aborted is not None and aborted["at_token"] == HOLD
    assert call["weight_versions"] == [{"version": "default", "start": 0, "end": HOLD}]
    # the harness's retry goes to the resumed engine and is answered whole
    h = harness(api, stack, "r1", stream=stream)
    h.start()
    again = await h.send()
    assert again.status == 200
    assert [(n, a) for _, n, a in again.tool_calls] == EXPECTED[0][2]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["backend_template", "exact_tokens"])
async def test_keep_holds_the_call_and_its_tokens_span_two_versions(
    make_stack, qwen_tokenizer_dir, mode, stream
):
    stack = await _stack(make_stack, mode, qwen_tokenizer_dir, upstream_read_timeout_s=0.05)
    # resumed only after the proxy's read timeout (0.05 s) fired: it asked whether the engine
    # was paused and went on waiting, so the held call was not cut
    reply = await _paused_call(stack, "chat_completions", stream, "keep", until_asked_paused=True)
    assert reply.status == 200
    assert [(n, a) for _, n, a in reply.tool_calls] == EXPECTED[0][2]
    assert len(stack.sent) == 1 and stack.sent[0].finish_reason != "abort"
    call = await stack.get_json(f"/captures/calls/{reply.call_id}")
    n = len(stack.sent[0].generation_token_ids)
    assert call["status"] == "complete" and call["generation_token_ids"] == (
        stack.sent[0].generation_token_ids
    )
    if mode == "exact_tokens":  # vLLM's spans: the exact boundary
        assert call["weight_version_source"] == "engine_spans"
        assert call["weight_versions"] == [
            {"version": "default", "start": 0, "end": HOLD},
            {"version": "2", "start": HOLD, "end": n},
        ]
    else:  # observed: the older version on every token, the change and where it fell said
        assert call["weight_version_source"] == "observed"
        assert call["weight_versions"] == [{"version": "default", "start": 0, "end": n}]
        [changed] = _diagnostic(call, "weight_version_changed")["changes"]
        assert (changed["from"], changed["to"]) == ("default", "2")
        first, end = changed["tokens"]
        # the change fell at token HOLD: at or after the first token read once it was seen
        assert (first, end) == ((0, n) if not stream else (first, n)) and first <= HOLD


@pytest.mark.parametrize("mode", ["backend_template", "exact_tokens"])
async def test_wait_lets_the_call_finish_under_its_version(make_stack, qwen_tokenizer_dir, mode):
    stack = await _stack(make_stack, mode, qwen_tokenizer_dir)
    reply = await _paused_call(stack, "messages", True, "wait")
    assert reply.status == 200
    call = await stack.get_json(f"/captures/calls/{reply.call_id}")
    n = len(call["generation_token_ids"])
    assert call["status"] == "complete"
    assert call["weight_versions"] == [{"version": "default", "start": 0, "end": n}]
    # a call after the update: one span of the new version
    _, after = await _reference(stack, "messages", True)
    assert after["weight_versions"] == [{"version": "2", "start": 0, "end": n}]


async def test_an_abort_without_a_pause_or_update_is_not_continued(make_stack, qwen_tokenizer_dir):
    stack = await _stack(make_stack, "exact_tokens", qwen_tokenizer_dir)
    weights = stack.engine_app[WEIGHTS]
    weights.hold_at = HOLD
    h = harness("chat_completions", stack, "r1", stream=False)
    h.start()
    call = asyncio.create_task(h.send())
    await asyncio.wait_for(weights.held.wait(), WAIT_S)
    await _engine(stack, "/abort_requests")  # a trainer ending the batch: no pause
    await weights.release()
    reply = await asyncio.wait_for(call, WAIT_S)
    assert reply.status == 503 and reply.body["error"]["code"] == "generation_aborted"
    assert len(stack.sent) == 1  # no continuation was sent
    stored = await stack.get_json(f"/captures/calls/{reply.call_id}")
    assert stored["status"] == "incomplete"
    assert "neither paused nor updated" in _diagnostic(stored, "generation_aborted")["reason"]


async def test_a_streamed_messages_call_whose_abort_is_not_continued_ends_in_overloaded_error(
    make_stack, qwen_tokenizer_dir
):
    # The stream's in-band error has the type Claude Code retries (the 503's type).
    stack = await _stack(make_stack, "exact_tokens", qwen_tokenizer_dir)
    weights = stack.engine_app[WEIGHTS]
    weights.hold_at = HOLD
    h = harness("messages", stack, "r1", stream=True)
    call = asyncio.create_task(h.send())
    await asyncio.wait_for(weights.held.wait(), WAIT_S)
    await _engine(stack, "/abort_requests")
    await weights.release()
    reply = await asyncio.wait_for(call, WAIT_S)
    assert reply.status == 200 and len(stack.sent) == 1
    names = [e.name for e in reply.events]
    assert names[-1] == "error" and "message_stop" not in names
    error = reply.events[-1].data["error"]
    assert error == {
        "type": "overloaded_error",
        "message": "the engine aborted the generation while neither paused nor updated (a "
        "request aborted on the engine, e.g. /abort_requests): not continued",
    }


async def test_a_paused_engine_that_does_not_resume_in_time_ends_the_call(
    make_stack, qwen_tokenizer_dir
):
    stack = await _stack(make_stack, "exact_tokens", qwen_tokenizer_dir, engine_pause_wait_s=0.3)
    weights = stack.engine_app[WEIGHTS]
    weights.hold_at = HOLD
    h = harness("responses", stack, "r1", stream=True)
    h.start()
    call = asyncio.create_task(h.send())
    await asyncio.wait_for(weights.held.wait(), WAIT_S)
    await _engine(stack, "/pause?mode=abort")
    reply = await asyncio.wait_for(call, WAIT_S)  # never resumed
    assert [e.name for e in reply.events][-1] == "response.failed"
    stored = await stack.get_json(f"/captures/calls/{reply.call_id}")
    assert stored["status"] == "incomplete"
    assert "did not serve again" in _diagnostic(stored, "generation_aborted")["reason"]
    await _engine(stack, "/resume")


#: an answer whose characters take several byte-level ids (an abort can cut one in two)
WIDE_STEP = {
    "reasoning": "Print them.",
    "content": "日本語 🎉🎉 naïve 𝔘𝔫𝔦 done",
    "tool_calls": [{"name": "bash", "arguments": {"command": "echo 🎉 日本"}}],
}


@pytest.mark.parametrize("dialect", list(SOURCES))
@pytest.mark.parametrize("stream", [False, True])
async def test_an_abort_inside_a_character_is_continued_to_the_same_text(
    make_stack, qwen_tokenizer, qwen_tokenizer_dir, stream, dialect
):
    # Held at every token where the ids so far end inside a character: the harness reads the
    # text and arguments of the call made without a pause (no U+FFFD where the cut fell).
    policy = Policy.model_validate({"steps": [WIDE_STEP]})
    engine = ScriptedEngineConfig(policy=policy, dev_mode=True, enable_scale_out=True)
    settings = {"tokens_in_dialect": dialect, "tokenizer": qwen_tokenizer_dir}
    stack = await make_stack(engine_config=engine, prompt_mode="exact_tokens", **settings)
    h = harness("chat_completions", stack, "ref", stream=stream)
    ref = await h.send()
    assert ref.status == 200 and ref.content == WIDE_STEP["content"] + "\n"  # vLLM's hermes
    ids = (await stack.get_json(f"/captures/calls/{ref.call_id}"))["generation_token_ids"]
    cuts = [k for k in range(1, len(ids)) if qwen_tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts == [10, 11, 16, 17, 19, 40, 41]  # 5 in the content, 2 in the arguments
    weights = stack.engine_app[WEIGHTS]
    for k in cuts:
        weights.hold_at = k
        h = harness("chat_completions", stack, f"cut-{k}", stream=stream)
        call = asyncio.create_task(h.send())
        await asyncio.wait_for(weights.held.wait(), WAIT_S)
        weights.held.clear()
        await _engine(stack, "/pause?mode=abort")
        await _update(stack, f"v{k}")
        await _engine(stack, "/resume")
        reply = await asyncio.wait_for(call, WAIT_S)
        assert reply.status == 200, (k, reply.body)
        assert (reply.content, reply.tool_calls[0][1:]) == (ref.content, ref.tool_calls[0][1:]), k
        stored = await stack.get_json(f"/captures/calls/{reply.call_id}")
        assert stored["response_message"]["content"] == ref.content, k
        assert stored["generation_token_ids"] == ids, k


async def test_the_version_is_read_from_sglangs_model_info_where_vllms_endpoint_is_missing():
    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from capture_proxy.proxy.weight_watch import WeightWatcher

    asked: list[str] = []
    model_info = {"model_path": "m", "weight_version": "7"}

    async def get_model_info(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response(model_info)

    async def weight_info(request: web.Request) -> web.Response:
        asked.append(request.path)
        raise web.HTTPNotFound()  # vLLM without dev mode, SGLang

    app = web.Application()
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/weight_info", weight_info)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        watcher = WeightWatcher(session, str(server.make_url("")).rstrip("/"), 1.0)
        assert await watcher.read_version() == "7"
        model_info["weight_version"] = "8"
        assert (await watcher.read_version(), watcher.epoch) == ("8", 2)
        # the endpoint that answered is remembered: /weight_info is asked once only
        assert asked == ["/weight_info", "/get_model_info", "/get_model_info"]


async def test_an_abort_of_a_generation_over_images_is_not_continued(
    make_stack, qwen_tokenizer_dir
):
    from tests.proxy.test_images import A, user_with_image
    from tests.proxy.test_images_exact import EXACT

    engine = ScriptedEngineConfig(
        policy=POLICY, family="qwen3_vl", dev_mode=True, enable_scale_out=True
    )
    stack = await make_stack(
        engine_config=engine,
        tokens_in_dialect="vllm_generate",
        tokenizer=qwen_tokenizer_dir,
        **EXACT,
    )
    weights = stack.engine_app[WEIGHTS]
    weights.hold_at = HOLD
    h = harness("chat_completions", stack, "r1", stream=False)
    h.history = [user_with_image("chat_completions", "What is in the picture?", A)]
    call = asyncio.create_task(h.send())
    await asyncio.wait_for(weights.held.wait(), WAIT_S)
    await _engine(stack, "/pause?mode=abort")
    reply = await asyncio.wait_for(call, WAIT_S)  # not held until the resume: not waited for
    assert reply.status == 503 and reply.body["error"]["code"] == "generation_aborted"
    assert len(stack.sent) == 1  # no continuation was sent
    stored = await stack.get_json(f"/captures/calls/{reply.call_id}")
    reason = "a generation over images is not continued after the engine aborted it"
    assert (stored["status"], stored["finish_reason"]) == ("incomplete", "abort")
    assert stored["generation_token_ids"] == stack.sent[0].generation_token_ids
    assert len(stored["generation_token_ids"]) == HOLD
    assert _diagnostic(stored, "generation_aborted") == {"reason": reason, "at_token": HOLD}
    assert _diagnostic(stored, "capture_incomplete") == {"reasons": [reason]}
    await _engine(stack, "/resume")
