"""Tier 2: a harness that leaves while the proxy writes nothing to it, on the server as
``serve`` runs it (a handler is not cancelled when its client leaves): a Messages stream
holding a ``tool_use`` block, a Responses stream holding a freeform tool's input, a whole
answer. The proxy finds the harness gone while the engine generates, closes the engine's
request (the engine aborts it) and stores the call ``incomplete`` with what arrived, as for
a chat-completions stream whose next write fails (docs/reliability.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from capture_proxy.proxy.stopping import CALLS_IN_FLIGHT_KEY
from capture_proxy.scripted_engine import (
    CLIENT_GONE,
    Faults,
    Policy,
    ScriptedEngineConfig,
    Step,
    ToolCallSpec,
)
from tests.proxy.conftest import MakeStack, Stack

WAIT_S = 30.0
#: one token every 50 ms: the tool call below takes seconds to generate
PACED = Faults(chunk_delay_s=0.05)
PATCH = "*** Begin Patch\n*** Add File: notes.md\n" + "".join(
    f"+line {i}: the notes say what the task needs\n" for i in range(12)
)
#: a tool call of a few hundred tokens, whichever tool the request names
LONG_CALL = Policy(
    steps=[
        Step(tool_calls=[ToolCallSpec(name="apply_patch", arguments={"input": PATCH})]),
    ]
)
ANTHROPIC = {"anthropic-version": "2023-06-01"}
#: A streamed Responses request offering Codex's freeform ``apply_patch`` tool (its input is
#: sent whole when the call closes, so the stream is silent while the engine writes it)
FREEFORM_REQUEST = {
    "model": "scripted-qwen",
    "stream": True,
    "input": [{"type": "message", "role": "user", "content": "Write the notes."}],
    "tools": [{"type": "custom", "name": "apply_patch", "description": "Edit files"}],
}


def _url(rollout: str, path: str) -> str:
    return f"/ng-rollout/{rollout}/training-token-capture/v1/{path}"


#: the engine renders the template; the proxy sends exact tokens (its own parser reads the
#: tool call out of the engine's tokens)
PROMPT_MODES = pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])


async def _paced_stack(
    make_stack: MakeStack, faults: Faults = PACED, prompt_mode: str = "backend_template"
) -> Stack:
    config = ScriptedEngineConfig(policy=LONG_CALL, faults=faults)
    return await make_stack(engine_config=config, cancel_handlers=False, prompt_mode=prompt_mode)


async def _read_until(resp: Any, event: bytes) -> None:
    """Read the stream up to the SSE event ``event`` (its ``event:`` line), then stop."""
    async with asyncio.timeout(WAIT_S):
        while True:
            line = await resp.content.readline()
            assert line, f"the stream ended before {event!r}"
            if line.rstrip(b"\r\n") == b"event: " + event:
                return


async def _call_ended(stack: Stack) -> dict[str, Any]:
    """The rollout's one call once the proxy's handler of it has ended (bounded)."""
    assert await stack.client.server.app[CALLS_IN_FLIGHT_KEY].wait_idle(WAIT_S)
    listing = await stack.get_json("/captures/rollouts/r1/chains")
    [call] = [c for chain in listing["chains"] for c in chain["calls"]] + listing["unlinked_calls"]
    return await stack.get_json(f"/captures/calls/{call['call_id']}")


def _reasons(call: dict[str, Any]) -> list[str]:
    [diagnostic] = [d for d in call["diagnostics"] if d["kind"] == "capture_incomplete"]
    return diagnostic["details"]["reasons"]


async def _engine_request_closed(stack: Stack) -> None:
    async with asyncio.timeout(WAIT_S):
        await stack.engine_app[CLIENT_GONE].wait()


def _cut_short(stack: Stack, call: dict[str, Any]) -> None:
    """The call stored what the engine sent before the proxy closed its request: a prefix of
    the generation, well short of its end."""
    [sent] = stack.sent
    assert len(sent.generation_token_ids) > 150  # (the generation takes seconds)
    got = call["generation_token_ids"]
    assert got == sent.generation_token_ids[: len(got)]
    assert len(got) < len(sent.generation_token_ids) // 2


@PROMPT_MODES
async def test_a_messages_stream_holding_a_tool_use_block_ends_when_the_harness_leaves(
    make_stack, prompt_mode
):
    stack = await _paced_stack(make_stack, prompt_mode=prompt_mode)
    body = {
        "model": "scripted-qwen",
        "max_tokens": 2000,
        "stream": True,
        "messages": [{"role": "user", "content": "Write the notes."}],
        "tools": [{"name": "apply_patch", "input_schema": {"type": "object"}}],
    }
    resp = await stack.client.post(_url("r1", "messages"), json=body, headers=ANTHROPIC)
    assert resp.status == 200
    # The tool_use block is sent whole at the end: nothing comes after these while the
    # engine generates it, so no write finds the harness gone.
    await _read_until(resp, b"ping")
    resp.close()  # the harness is killed mid-answer

    call = await _call_ended(stack)
    assert call["status"] == "incomplete"
    assert "client disconnected before the stream ended" in _reasons(call)
    _cut_short(stack, call)
    await _engine_request_closed(stack)


@PROMPT_MODES
async def test_a_responses_stream_holding_a_freeform_call_ends_when_the_harness_leaves(
    make_stack, prompt_mode
):
    """Codex's ``apply_patch`` is a freeform tool: its input is sent whole when the call
    closes, so its stream is silent while the engine generates it (Codex's idle timeout then
    drops the stream and retries)."""
    stack = await _paced_stack(make_stack, prompt_mode=prompt_mode)
    body = FREEFORM_REQUEST
    resp = await stack.client.post(_url("r1", "responses"), json=body)
    assert resp.status == 200
    await _read_until(resp, b"response.in_progress")  # then nothing until the call closes
    resp.close()

    call = await _call_ended(stack)
    assert call["status"] == "incomplete"
    assert "client disconnected before the stream ended" in _reasons(call)
    _cut_short(stack, call)
    await _engine_request_closed(stack)


async def test_a_whole_answer_is_not_waited_for_when_its_harness_left(make_stack):
    """Nothing is written to a harness that asked for a whole answer until the engine is done
    (the engine's response head comes with its body): the proxy looks at the connection while
    it waits, and a harness found gone cuts the engine's request."""
    stack = await _paced_stack(make_stack, Faults(first_byte_delay_s=2 * WAIT_S))
    body = {
        "model": "scripted-qwen",
        "max_tokens": 2000,
        "messages": [{"role": "user", "content": "Write the notes."}],
        "tools": [{"name": "apply_patch", "input_schema": {"type": "object"}}],
    }
    asking = asyncio.ensure_future(
        stack.client.post(_url("r1", "messages"), json=body, headers=ANTHROPIC)
    )
    async with asyncio.timeout(WAIT_S):
        while not stack.sent:  # the engine has the request, and holds it
            await asyncio.sleep(0.01)
    asking.cancel()  # the harness leaves (its connection closes)
    await _engine_request_closed(stack)

    call = await _call_ended(stack)
    assert call["status"] == "incomplete"
    assert _reasons(call) == ["client disconnected before the engine answered"]
    assert call["generation_token_ids"] == []


async def test_a_stream_whose_engine_is_silent_is_cut_when_its_harness_leaves(make_stack):
    """Between two engine events nothing is written either (a long prefill, a busy engine):
    the proxy looks at the connection meanwhile, not only at the engine's next event."""
    stack = await _paced_stack(make_stack, Faults(chunk_delay_s=2 * WAIT_S))
    body = {
        "model": "scripted-qwen",
        "stream": True,
        "messages": [{"role": "user", "content": "Write the notes."}],
        "tools": [{"type": "function", "function": {"name": "apply_patch", "parameters": {}}}],
    }
    resp = await stack.client.post(_url("r1", "chat/completions"), json=body)
    assert resp.status == 200
    async with asyncio.timeout(WAIT_S):
        assert (await resp.content.readline()).startswith(b"data: ")  # the role chunk
    resp.close()  # the engine's first token is a minute away
    await _engine_request_closed(stack)

    call = await _call_ended(stack)
    assert call["status"] == "incomplete"
    assert "client disconnected before the stream ended" in _reasons(call)
    assert call["generation_token_ids"] == []


async def test_codex_re_sending_a_call_it_dropped_is_its_retry_while_that_call_is_in_flight(
    make_stack,
):
    """Codex drops a stream that stays silent past its idle timeout and sends the same
    request again, with no retry header. The call it dropped is still in flight when the
    re-send arrives (here its engine is silent for a minute), but its harness is gone, so it
    is stored incomplete: the re-send is its retry (docs/linking.md, item 5), the dropped
    call is superseded and the rollout is complete."""
    faults = Faults(chunk_delay_s=2 * WAIT_S, slow_first_n=1)  # the re-send is answered at once
    stack = await _paced_stack(make_stack, faults)
    body = FREEFORM_REQUEST
    dropped = await stack.client.post(_url("r1", "responses"), json=body)
    await _read_until(dropped, b"response.in_progress")
    dropped.close()  # Codex's idle timeout
    again = await stack.client.post(_url("r1", "responses"), json=body)
    async with asyncio.timeout(WAIT_S):
        assert "event: response.completed" in await again.text()
    assert await stack.client.server.app[CALLS_IN_FLIGHT_KEY].wait_idle(WAIT_S)

    dropped_id, again_id = (r.headers["X-Capture-Call-Id"] for r in (dropped, again))
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [[c["call_id"] for c in chain["calls"]] for chain in chains["chains"]] == [[again_id]]
    [left] = chains["unlinked_calls"]
    assert (left["call_id"], left["status"]) == (dropped_id, "incomplete")
    assert (left["reason"], left["superseded_by"]) == ("superseded_retry", again_id)
    retry = await stack.get_json(f"/captures/calls/{again_id}")
    assert retry["retry_of"] == dropped_id
    assert (await stack.get_json("/captures/rollouts/r1"))["incomplete"] is False
    await _engine_request_closed(stack)
