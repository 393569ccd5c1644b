"""Images in exact-token mode on the scripted engine (family qwen3_vl, the published Qwen3-VL
template): the proxy renders the prompt and expands each image's placeholder as vLLM's
processor does, sends the engine one <|image_pad|> per image with the images, and the engine's
expansion of them (its echoed prompt ids) must be the proxy's, id for id."""

from __future__ import annotations

from typing import Any

import aiohttp
import numpy as np
import pytest

from capture_proxy.core.image_spans import image_runs
from capture_proxy.scripted_engine.state import ScriptedEngineConfig
from tests.proxy.api_clients import MODEL, capture_url
from tests.proxy.conftest import MakeStack
from tests.proxy.test_images import APIS, A, B, chain_calls, run_session, sha, user_with_image

EXACT: dict[str, Any] = {
    "prompt_mode": "exact_tokens",
    "model_families": {MODEL: "qwen3_vl"},
    "image_processors": {MODEL: "qwen3_vl"},
}


def _engine() -> ScriptedEngineConfig:
    return ScriptedEngineConfig(family="qwen3_vl", enable_scale_out=True)


@pytest.mark.parametrize("dialect", ["vllm_generate", "sglang_generate"])
@pytest.mark.parametrize("api", APIS)
async def test_an_exact_session_with_images_is_one_chain(
    make_stack: MakeStack, qwen_tokenizer_dir, api: str, dialect: str
) -> None:
    stack = await make_stack(
        engine_config=_engine(),
        tokens_in_dialect=dialect,
        tokenizer=qwen_tokenizer_dir,
        **EXACT,
    )
    rollout = f"exact-{api}-{dialect}"
    call_ids = await run_session(stack, api, rollout, stream=api == "messages")
    calls = await chain_calls(stack, rollout)
    assert [c["call_id"] for c in calls] == call_ids
    assert [c["parent_call_id"] for c in calls] == [None, *call_ids[:2]]
    assert [c["linking"]["verdict"] for c in calls] == ["root", "resolved", "resolved"]
    expected = [[A], [A, B], [A, B, A]]
    for call, sent, images in zip(calls, stack.sent, expected, strict=True):
        assert call["prompt_mode"] == "exact_tokens" and call["diagnostics"] == []
        # the engine expanded the one-pad-per-image prompt it was sent into the proxy's ids
        assert call["prompt_token_ids"] == sent.prompt_token_ids
        runs = image_runs(np.asarray(call["prompt_token_ids"]))
        assert [(e["prompt_start"], e["prompt_end"]) for e in call["images"]] == runs
        assert [e["sha256"] for e in call["images"]] == [sha(d) for d in images]
        body = sent.request_body
        if dialect == "vllm_generate":
            assert body["return_token_ids"] is True
            urls = [p["url"] for p in body["content_parts"]]
            assert body["token_ids"].count(151655) == len(images)
        else:
            urls = body["image_data"]
            assert body["input_ids"].count(151655) == len(images)
        assert len(urls) == len(images)
    # exact: every child's prompt begins with its parent's prompt + generation
    for parent, child in zip(calls, calls[1:], strict=False):
        head = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert child["prompt_token_ids"][: len(head)] == head


async def test_the_exact_prompt_is_the_engines_chat_render(
    make_stack: MakeStack, qwen_tokenizer_dir
):
    """A root call's exact prompt is what the engine's own chat endpoint renders and expands
    for the same conversation (the scripted engine renders with the family's objects; the real
    vLLM check is tests/realengine)."""
    stack = await make_stack(
        engine_config=_engine(),
        tokens_in_dialect="vllm_generate",
        tokenizer=qwen_tokenizer_dir,
        **EXACT,
    )
    body = {"model": MODEL, "messages": [user_with_image("chat_completions", "What is it?", B)]}
    resp = await stack.chat("render", body)
    assert resp.status == 200, await resp.text()
    record = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    async with aiohttp.ClientSession() as session:
        url = stack.engine.make_url("/tokenize")
        async with session.post(url, json={**body, "add_generation_prompt": True}) as answer:
            tokenized = await answer.json()
    assert record["prompt_token_ids"] == tokenized["tokens"]


async def test_vllm_completions_cannot_carry_images(make_stack: MakeStack) -> None:
    stack = await make_stack(engine_config=_engine(), **EXACT)
    body = {"model": MODEL, "messages": [user_with_image("chat_completions", "x", A)]}
    resp = await stack.client.post(capture_url("no-dialect", "chat_completions"), json=body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "vllm_generate or sglang_generate" in error["message"]
    assert error["param"] == "messages.0.content.1.image_url.url"
    assert stack.sent == []


MOE = (2, 2, 8)  # layers, top_k, experts


async def test_routed_expert_rows_cover_the_expanded_prompt(
    make_stack: MakeStack, qwen_tokenizer_dir
):
    """A VL MoE model (the scripted engine's MoE mode): each call's rows are the engine's over
    the prompt with every image expanded, from the parent's end on (vLLM on the CPU returns no
    routed experts: this is checked on the scripted engine only)."""
    from capture_proxy.scripted_engine.moe import expert_rows

    stack = await make_stack(
        engine_config=ScriptedEngineConfig(family="qwen3_vl", enable_scale_out=True, moe=MOE),
        tokens_in_dialect="vllm_generate",
        tokenizer=qwen_tokenizer_dir,
        **EXACT,
    )
    call_ids = await run_session(stack, "chat_completions", "moe", stream=False)
    rows_end = 0
    for call_id, sent in zip(call_ids, stack.sent, strict=True):
        record = await stack.get_json(f"/captures/calls/{call_id}")
        seq = sent.prompt_token_ids + sent.generation_token_ids
        assert record["routed_experts_start"] == rows_end
        assert (
            np.asarray(record["routed_experts"]).tolist()
            == expert_rows(seq, MOE, rows_end).tolist()
        )
        assert record["images"] and record["diagnostics"] == []
        rows_end = len(seq) - 1
