"""Tier 4, exact-token mode: the proxy builds each child's prompt from its parent's own tokens
and sends token ids to vLLM's /v1/completions, so a chain links even when the random model's
output does not re-tokenise canonically (which breaks backend-template mode, see
test_vllm.py::test_free_text_output_that_retokenizes_differently_is_never_linked)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.realengine.conftest import RealStack
from tests.realengine.test_vllm import SYSTEM, TOOL_CALL_TEXT, TOOLS, USER, _as_harness, _stream

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(300)]


@pytest.mark.parametrize("stream", [False, True], ids=["nonstreaming", "streaming"])
async def test_free_text_chain_links_in_exact_token_mode(real_exact: RealStack, stream: bool):
    real = real_exact
    rollout = f"real-exact-{stream}"
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    records, call_ids = [], []
    for follow_up in (None, "Go on.", "And then?"):
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
        body = {"model": real.model, "messages": messages, "max_tokens": 8, "temperature": 0}
        if stream:
            call_id, chunks = await _stream(real, rollout, body)
            content = "".join(
                (ch.get("delta") or {}).get("content") or "" for c in chunks for ch in c["choices"]
            )
            message: dict[str, Any] = {"content": content}
        else:
            resp = await real.chat(rollout, body)
            assert resp.status == 200, await resp.text()
            call_id = resp.headers["X-Capture-Call-Id"]
            message = (await resp.json())["choices"][0]["message"]
        call_ids.append(call_id)
        records.append(await real.get_json(f"/captures/calls/{call_id}"))
        messages.append(_as_harness(message))

    assert records[0]["prompt_token_ids"] == real.tokenize_chat([SYSTEM, USER])
    for parent, child in zip(records, records[1:], strict=False):
        head = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert child["prompt_token_ids"][: len(head)] == head
        assert len(child["generation_log_probs"]) == len(child["generation_token_ids"]) == 8
    chains = await real.get_json(f"/captures/rollouts/{rollout}/chains")
    shapes = [[(c["call_id"], c["parent_call_id"]) for c in ch["calls"]] for ch in chains["chains"]]
    assert shapes == [[(call_ids[0], None), (call_ids[1], call_ids[0]), (call_ids[2], call_ids[1])]]


async def test_tool_call_chain_in_exact_token_mode(real_exact: RealStack):
    """A forced tool call, its result, then an answer: one chain in exact-token mode too."""
    real = real_exact
    rollout = "real-exact-tool"
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    call_ids = []
    for text in (TOOL_CALL_TEXT, "Done."):
        _, forced = real.forced(text)
        body = {"model": real.model, "messages": messages, "tools": TOOLS, "max_tokens": 64}
        resp = await real.chat(rollout, {**body, **forced})
        assert resp.status == 200, await resp.text()
        call_ids.append(resp.headers["X-Capture-Call-Id"])
        message = (await resp.json())["choices"][0]["message"]
        if text == TOOL_CALL_TEXT:
            assert [c["function"]["name"] for c in message.get("tool_calls") or []] == ["bash"]
        messages.append(_as_harness(message))
        for tc in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": "README.md"})
    chains = await real.get_json(f"/captures/rollouts/{rollout}/chains")
    shapes = [[(c["call_id"], c["parent_call_id"]) for c in ch["calls"]] for ch in chains["chains"]]
    assert shapes == [[(call_ids[0], None), (call_ids[1], call_ids[0])]]


async def test_the_generation_prompt_flags_render_as_vllm_renders_them(real_exact: RealStack):
    """vLLM is the oracle for the two flags in exact-token mode: ``continue_final_message``
    with ``add_generation_prompt: false`` leaves the last message open, ``add_generation_prompt:
    false`` alone closes it with no generation prompt (the proxy's prompt equals vLLM's
    ``/tokenize`` of the same flags), and ``continue_final_message`` alone is a 400 from vLLM's
    chat endpoint and from the proxy, which names ``add_generation_prompt``."""
    real = real_exact
    messages = [SYSTEM, USER, {"role": "assistant", "content": "Let me look"}]
    base = {"model": real.model, "messages": messages, "max_tokens": 4, "temperature": 0}
    for flags in (
        {"continue_final_message": True, "add_generation_prompt": False},
        {"add_generation_prompt": False},
    ):
        resp = await real.chat("real-exact-flags", {**base, **flags})
        assert resp.status == 200, await resp.text()
        call = await real.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
        oracle = real.engine.post(
            "/tokenize", json={"model": real.model, "messages": messages, **flags}
        )
        assert oracle.status_code == 200, oracle.text
        assert call["prompt_token_ids"] == oracle.json()["tokens"], flags
        assert call["linking"]["prefill"] is ("continue_final_message" in flags)
    refused = real.engine.post(
        "/v1/chat/completions", json={**base, "continue_final_message": True}
    )
    assert refused.status_code == 400, refused.text
    resp = await real.chat("real-exact-flags", {**base, "continue_final_message": True})
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["error"]["param"] == "add_generation_prompt"
