"""Tier 2: a Responses ``previous_response_id`` with ``instructions``, through the proxy in
both prompt modes. The API's rule: ``instructions`` is a system message at the start of the
context; the instructions of the referenced response are not carried over; its input items
(developer and system messages among them) stay."""

from __future__ import annotations

from typing import Any

import pytest

from capture_proxy.scripted_engine import Policy, ScriptedEngineConfig
from tests.proxy.api_clients import capture_url
from tests.proxy.conftest import Stack

MODES = ["backend_template", "exact_tokens"]
#: a request without tools gets the title: every call is answered "One."
POLICY = Policy.model_validate({"title": "One."})
#: call 1's answer, as stored and as call 2's history holds it
ANSWER = {"role": "assistant", "content": "One.", "tool_calls": []}


async def _respond(stack: Stack, rollout: str, body: dict[str, Any]) -> tuple[str, dict]:
    resp = await stack.client.post(
        capture_url(rollout, "responses"), json={"model": "scripted-qwen", **body}
    )
    assert resp.status == 200, await resp.text()
    return resp.headers["x-capture-call-id"], await resp.json()


async def _two_calls(
    make_stack, mode: str, first: dict[str, Any], second: dict[str, Any]
) -> tuple[Stack, dict]:
    """Call 1 with ``first``, then call 2 with ``second`` naming call 1's response; the stack
    and call 2's stored record."""
    stack = await make_stack(engine_config=ScriptedEngineConfig(policy=POLICY), prompt_mode=mode)
    _, response = await _respond(stack, "r1", first)
    call_id, _ = await _respond(stack, "r1", {"previous_response_id": response["id"], **second})
    return stack, await stack.get_json(f"/captures/calls/{call_id}")


#: the ``parent_digest_mismatch`` explanation of a prompt whose system messages changed
SYSTEM_CHANGED = (
    "differs inside the parent's prompt, where the request's system messages are not the "
    "parent's; the rest of the history is the parent's (a changed system prompt, e.g. a "
    "Responses request's instructions, which previous_response_id does not carry over)"
)
#: the ``exact_prompt_refused`` reason of the same (exact-token mode)
NOT_SPLICED = (
    "the system messages differ from the parent's request (a changed system prompt, e.g. a "
    "Responses request's instructions, which previous_response_id does not carry over): the "
    "prompt is rendered whole"
)


def _check_system_changed(call: dict, mode: str, position: int) -> None:
    """Refused, and the reason names the changed system messages, not an edited history."""
    parent = call["linking"]["digest_parent_call_id"]
    assert parent is not None  # the digest found call 1: the turns are its
    assert call["parent_call_id"] is None
    assert call["linking"]["verdict"] == "refused"
    assert call["linking"]["reason"] == "tokens do not chain (system_changed)"
    mismatch = {
        "kind": "parent_digest_mismatch",
        "details": {
            "parent_call_id": parent,
            "position": position,
            "class": "system_changed",
            "explanation": SYSTEM_CHANGED,
            "classified_with_text": True,
        },
    }
    refused = {
        "kind": "exact_prompt_refused",
        "details": {"parent_call_id": parent, "reason": NOT_SPLICED, "message_index": 0},
    }
    expected = [mismatch] if mode == "backend_template" else [refused, mismatch]
    assert call["diagnostics"] == expected


def _prompt(qwen_tokenizer, stack: Stack, i: int) -> str:
    """What the engine was sent as call ``i``'s prompt, as text."""
    return qwen_tokenizer.decode(stack.sent[i].prompt_token_ids)


@pytest.mark.parametrize("mode", MODES)
async def test_instructions_of_the_referenced_response_are_not_carried_over(
    make_stack, qwen_tokenizer, mode
):
    stack, call = await _two_calls(
        make_stack, mode, {"instructions": "INSTR-ONE", "input": "hello"}, {"input": "again"}
    )
    assert call["request_messages"] == [
        {"role": "user", "content": "hello"},
        ANSWER,
        {"role": "user", "content": "again"},
    ]
    assert _prompt(qwen_tokenizer, stack, 1) == (
        "<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\nOne.<|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The prompt no longer begins with call 1's (its system turn is gone): the link is
    # refused, first differing at the token after <|im_start|>.
    _check_system_changed(call, mode, 1)


@pytest.mark.parametrize("mode", MODES)
async def test_new_instructions_come_before_the_developer_item_of_the_history(
    make_stack, qwen_tokenizer, mode
):
    first = {
        "input": [
            {"role": "developer", "content": "DEV-MSG"},
            {"role": "user", "content": "hello"},
        ]
    }
    stack, call = await _two_calls(
        make_stack, mode, first, {"instructions": "INSTR-TWO", "input": "again"}
    )
    assert call["request_messages"] == [
        {"role": "system", "content": "INSTR-TWO"},
        {"role": "system", "content": "DEV-MSG"},
        {"role": "user", "content": "hello"},
        ANSWER,
        {"role": "user", "content": "again"},
    ]
    assert _prompt(qwen_tokenizer, stack, 1) == (
        "<|im_start|>system\nINSTR-TWO<|im_end|>\n"
        "<|im_start|>system\nDEV-MSG<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\nOne.<|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    _check_system_changed(call, mode, 3)  # system\n, then INSTR-TWO where DEV-MSG was


@pytest.mark.parametrize("mode", MODES)
async def test_the_same_instructions_each_call_still_link(make_stack, qwen_tokenizer, mode):
    first = {
        "instructions": "INSTR",
        "input": [
            {"role": "developer", "content": "DEV-MSG"},
            {"role": "user", "content": "hello"},
        ],
    }
    stack, call = await _two_calls(
        make_stack, mode, first, {"instructions": "INSTR", "input": "again"}
    )
    assert call["request_messages"] == [
        {"role": "system", "content": "INSTR"},
        {"role": "system", "content": "DEV-MSG"},
        {"role": "user", "content": "hello"},
        ANSWER,
        {"role": "user", "content": "again"},
    ]
    assert call["linking"]["verdict"] == "resolved"
    first_call = stack.sent[0]
    parent = first_call.prompt_token_ids + first_call.generation_token_ids
    assert stack.sent[1].prompt_token_ids[: len(parent)] == parent
