"""Tier 2: a prefilled call (the request's last message is a partial assistant message the
engine continues) and the next turn, whose history holds the merged turn (prefill +
continuation), through the proxy against the scripted engine: one chain, token for token, in
both prompt modes, over Anthropic Messages and chat completions."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from capture_proxy.scripted_engine.state import ScriptedEngineConfig
from tests.proxy.conftest import Stack

BASE = "/ng-rollout/r1/training-token-capture"
ANTHROPIC = {"anthropic-version": "2023-06-01"}
USER = {"role": "user", "content": "Say hi"}
#: what the scripted engine writes after any prompt
CONTINUATION = " world"
#: backend_template: the engine renders; exact_tokens: the proxy renders through the engine's
#: /tokenize, or with its own tokenizer (a local renderer)
MODES = ["backend_template", "exact_tokens", "exact_tokens_local"]


def _answer(_body: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": CONTINUATION}


async def _stack(make_stack, qwen_tokenizer_dir, mode: str) -> Stack:
    settings: dict[str, Any] = {"prompt_mode": mode.removesuffix("_local")}
    if mode == "exact_tokens_local":
        settings["tokenizer"] = qwen_tokenizer_dir
    return await make_stack(engine_config=ScriptedEngineConfig(responder=_answer), **settings)


async def _messages(stack: Stack, messages: list[dict], stream: bool = False) -> tuple[str, str]:
    """A Messages call: (the call id, the answer's text as the harness got it)."""
    body = {"model": "scripted-qwen", "max_tokens": 32, "messages": messages, "stream": stream}
    resp = await stack.client.post(BASE + "/v1/messages", json=body, headers=ANTHROPIC)
    assert resp.status == 200, await resp.text()
    if stream:
        events = [
            json.loads(line[6:])
            for line in (await resp.text()).splitlines()
            if line.startswith("data: ")
        ]
        text = "".join(
            e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"
        )
    else:
        text = "".join(b.get("text", "") for b in (await resp.json())["content"])
    return resp.headers["X-Capture-Call-Id"], text


async def _chat(stack: Stack, messages: list[dict], prefill: bool) -> tuple[str, str]:
    body: dict[str, Any] = {"model": "scripted-qwen", "max_tokens": 32, "messages": messages}
    if prefill:
        body |= {"continue_final_message": True, "add_generation_prompt": False}
    resp = await stack.chat("r1", body)
    assert resp.status == 200, await resp.text()
    text = (await resp.json())["choices"][0]["message"]["content"]
    return resp.headers["X-Capture-Call-Id"], text


def _kinds(call: dict) -> list[str]:
    return [d["kind"] for d in call["diagnostics"]]


async def _check_chain(stack: Stack, first_id: str, child_id: str) -> None:
    """The prefilled call is a root that says it continued a prefill, with no foreign turn;
    the next turn is its verified child, whose prompt extends its prompt + generation."""
    first = await stack.get_json(f"/captures/calls/{first_id}")
    child = await stack.get_json(f"/captures/calls/{child_id}")
    assert first["linking"]["verdict"] == "root" and first["linking"]["reason"] is None
    assert first["linking"]["prefill"] is True
    assert "foreign_turn_projected_portable" not in _kinds(first)
    assert first["response_message"]["content"] == CONTINUATION  # the engine's answer, kept
    assert child["parent_call_id"] == first_id
    assert child["linking"]["verdict"] == "resolved"
    assert child["linking"]["digest_parent_call_id"] == first_id
    assert child["linking"]["parent_digest"] == first["linking"]["child_digest"]
    unwanted = {"foreign_turn_projected_portable", "parent_digest_mismatch", "exact_prompt_refused"}
    assert not unwanted & set(_kinds(child))
    head = first["prompt_token_ids"] + first["generation_token_ids"]
    assert child["prompt_token_ids"][: len(head)] == head
    chains = (await stack.get_json("/captures/rollouts/r1/chains"))["chains"]
    assert [[c["call_id"] for c in chain["calls"]] for chain in chains] == [[first_id, child_id]]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", MODES)
async def test_a_messages_prefill_links_to_its_next_turn(
    make_stack, qwen_tokenizer, qwen_tokenizer_dir, mode, stream
):
    stack = await _stack(make_stack, qwen_tokenizer_dir, mode)
    prefill = {"role": "assistant", "content": "Hello,"}
    first_id, text = await _messages(stack, [USER, prefill], stream)
    assert text == CONTINUATION  # the harness gets the continuation only, as from Anthropic
    merged = {"role": "assistant", "content": "Hello," + text}
    child_id, _ = await _messages(stack, [USER, merged, {"role": "user", "content": "again"}])
    await _check_chain(stack, first_id, child_id)
    first = await stack.get_json(f"/captures/calls/{first_id}")
    # the prompt ends with the prefill left open; the prefill's tokens are prompt, not output
    prompt = qwen_tokenizer.decode(first["prompt_token_ids"])
    assert prompt.endswith("<|im_start|>assistant\nHello,")
    assert qwen_tokenizer.decode(first["generation_token_ids"]) == CONTINUATION + "<|im_end|>"


@pytest.mark.parametrize("mode", MODES)
async def test_a_chat_completions_prefill_links_to_its_next_turn(
    make_stack, qwen_tokenizer_dir, mode
):
    stack = await _stack(make_stack, qwen_tokenizer_dir, mode)
    first_id, text = await _chat(stack, [USER, {"role": "assistant", "content": "Hello,"}], True)
    assert text == CONTINUATION
    merged = {"role": "assistant", "content": "Hello," + text}
    child_id, _ = await _chat(stack, [USER, merged, {"role": "user", "content": "again"}], False)
    await _check_chain(stack, first_id, child_id)


@pytest.mark.parametrize("mode", MODES)
async def test_a_prefill_after_a_model_turn_links_to_that_turns_call(
    make_stack, qwen_tokenizer_dir, mode
):
    stack = await _stack(make_stack, qwen_tokenizer_dir, mode)
    root_id, text = await _messages(stack, [USER])
    history = [USER, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    prefill_id, more = await _messages(stack, [*history, {"role": "assistant", "content": "So,"}])
    merged = {"role": "assistant", "content": "So," + more}
    child_id, _ = await _messages(stack, [*history, merged, {"role": "user", "content": "ok"}])
    calls = {c: await stack.get_json(f"/captures/calls/{c}") for c in (prefill_id, child_id)}
    assert calls[prefill_id]["parent_call_id"] == root_id
    assert calls[prefill_id]["linking"]["verdict"] == "resolved"
    assert calls[prefill_id]["diagnostics"] == [
        d for d in calls[prefill_id]["diagnostics"] if d["kind"] == "exact_prompt_full_render"
    ]
    assert calls[child_id]["parent_call_id"] == prefill_id
    assert calls[child_id]["linking"]["verdict"] == "resolved"
    chains = (await stack.get_json("/captures/rollouts/r1/chains"))["chains"]
    assert [[c["call_id"] for c in chain["calls"]] for chain in chains] == [
        [root_id, prefill_id, child_id]
    ]


@pytest.mark.parametrize("mode", MODES)
async def test_a_merged_turn_that_retokenizes_is_spliced_or_refused_never_linked_wrong(
    make_stack, qwen_tokenizer, qwen_tokenizer_dir, mode
):
    # The prefill ends with a space and the model writes "world": the model saw and wrote
    # " " + "world", the merged text "Hello, world" tokenizes " world".
    def answer(_body: dict[str, Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": "world"}

    settings: dict[str, Any] = {"prompt_mode": mode.removesuffix("_local")}
    if mode == "exact_tokens_local":
        settings["tokenizer"] = qwen_tokenizer_dir
    stack = await make_stack(engine_config=ScriptedEngineConfig(responder=answer), **settings)
    first_id, text = await _messages(stack, [USER, {"role": "assistant", "content": "Hello, "}])
    merged = {"role": "assistant", "content": "Hello, " + text}
    child_id, _ = await _messages(stack, [USER, merged, {"role": "user", "content": "again"}])
    first = await stack.get_json(f"/captures/calls/{first_id}")
    child = await stack.get_json(f"/captures/calls/{child_id}")
    head = first["prompt_token_ids"] + first["generation_token_ids"]
    assert child["linking"]["digest_parent_call_id"] == first_id
    if mode == "backend_template":
        # the engine re-tokenises the merged text: the link is refused, and says why
        assert child["parent_call_id"] is None
        assert child["linking"]["verdict"] == "refused"
        (mismatch,) = [d for d in child["diagnostics"] if d["kind"] == "parent_digest_mismatch"]
        assert mismatch["details"]["class"] == "retokenized"
        assert child["prompt_token_ids"][: len(head)] != head
    else:
        # the model is shown the tokens it saw and wrote: " " then "world"
        assert child["parent_call_id"] == first_id
        assert child["linking"]["verdict"] == "resolved"
        assert child["prompt_token_ids"][: len(head)] == head
        kinds = _kinds(child)
        assert "exact_prompt_refused" not in kinds and "exact_prompt_full_render" not in kinds
        tail = [qwen_tokenizer.decode([t]) for t in first["prompt_token_ids"][-2:]]
        assert tail == [",", " "]


@pytest.mark.parametrize("mode", MODES)
async def test_add_generation_prompt_false_alone_renders_the_conversation_closed(
    make_stack, qwen_tokenizer, qwen_tokenizer_dir, mode
):
    """vLLM 0.32 continues a message only with ``continue_final_message``: with
    ``add_generation_prompt: false`` alone every message is closed and no generation prompt
    follows. The trailing assistant message is then history (not a prefill), in either mode."""
    stack = await _stack(make_stack, qwen_tokenizer_dir, mode)
    messages = [USER, {"role": "assistant", "content": "Hello,"}]
    body = {"model": "scripted-qwen", "max_tokens": 32, "messages": messages}
    resp = await stack.chat("r1", {**body, "add_generation_prompt": False})
    assert resp.status == 200, await resp.text()
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["linking"]["prefill"] is False
    prompt = qwen_tokenizer.decode(call["prompt_token_ids"])
    assert prompt.endswith("<|im_start|>assistant\nHello,<|im_end|>\n")
    async with aiohttp.ClientSession() as session:
        tokenize = {"messages": messages, "add_generation_prompt": False}
        async with session.post(stack.engine.make_url("/tokenize"), json=tokenize) as got:
            assert call["prompt_token_ids"] == (await got.json())["tokens"]


@pytest.mark.parametrize("generation", [True, None], ids=["true", "left_out"])
@pytest.mark.parametrize("mode", MODES)
async def test_continue_final_message_with_the_generation_prompt_on_is_a_400(
    make_stack, qwen_tokenizer_dir, mode, generation
):
    """vLLM 0.32 refuses ``continue_final_message`` unless ``add_generation_prompt`` is
    false (its default is true; transformers refuses the pair): the engine says so in
    backend-template mode, the proxy in exact-token mode, naming the field."""
    stack = await _stack(make_stack, qwen_tokenizer_dir, mode)
    body: dict[str, Any] = {
        "model": "scripted-qwen",
        "max_tokens": 32,
        "messages": [USER, {"role": "assistant", "content": "Hello,"}],
        "continue_final_message": True,
    }
    if generation is not None:
        body["add_generation_prompt"] = generation
    resp = await stack.chat("r1", body)
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["param"] == "add_generation_prompt", error
    assert "add_generation_prompt: false" in error["message"]
