"""The scripted engine's MoE mode: deterministic routed experts in vLLM's encoding."""

import numpy as np
import pytest

from capture_proxy.core.routed_experts import (
    check_overlap,
    decode_sglang_routed_experts,
    decode_vllm_routed_experts,
)
from capture_proxy.scripted_engine import ScriptedEngineConfig, build_scripted_engine_app
from capture_proxy.scripted_engine.moe import (
    expert_rows,
    sglang_routed_experts,
    vllm_routed_experts,
)
from tests.scripted_engine.test_app import FIRST, POLICY, body, post

MOE = (3, 2, 300)


def test_rows_are_deterministic_per_position_and_token():
    ids = list(range(100, 140))
    rows = expert_rows(ids, MOE)
    assert rows.shape == (39, 3, 2) and rows.dtype == np.uint16
    assert int(rows.max()) < 300
    assert (rows[:, :, 0] != rows[:, :, 1]).all()  # top-k ids are distinct
    assert np.array_equal(expert_rows(ids[:20], MOE), rows[:19])  # shared prefix, same rows
    assert np.array_equal(expert_rows(ids, MOE, start=25), rows[25:])
    assert expert_rows(ids, (2, 8, 256)).dtype == np.uint8
    assert expert_rows(ids, MOE, start=50).shape == (0, 3, 2)
    with pytest.raises(ValueError):
        expert_rows(ids, (2, 9, 8))


def test_both_wire_encodings_decode_in_the_core():
    rows = expert_rows(list(range(30)), MOE)
    assert np.array_equal(decode_vllm_routed_experts(vllm_routed_experts(rows)), rows)
    back = decode_sglang_routed_experts(sglang_routed_experts(rows), num_layers=3, top_k=2)
    assert back.dtype == np.int32 and np.array_equal(back, rows)


@pytest.fixture
async def moe_client(aiohttp_client, qwen_tokenizer):
    config = ScriptedEngineConfig(policy=POLICY, moe=MOE)
    return await aiohttp_client(build_scripted_engine_app(config, tokenizer=qwen_tokenizer))


async def test_non_streaming_answer_carries_all_rows(moe_client):
    out = await post(moe_client, body(FIRST))
    choice = out["choices"][0]
    full = out["prompt_token_ids"] + choice["token_ids"]
    rows = decode_vllm_routed_experts(choice["routed_experts"])
    assert np.array_equal(rows, expert_rows(full, MOE))
    assert rows.shape[0] == len(full) - 1


async def test_prompt_start_gives_only_the_new_rows(moe_client):
    whole = await post(moe_client, body(FIRST))
    part = await post(moe_client, body(FIRST, routed_experts_prompt_start=5))
    a = decode_vllm_routed_experts(whole["choices"][0]["routed_experts"])
    b = decode_vllm_routed_experts(part["choices"][0]["routed_experts"])
    assert np.array_equal(b, a[5:])
    assert check_overlap(a, 0, b, 5) is None


async def test_streams_carry_no_rows_and_bad_start_is_400(moe_client):
    resp = await moe_client.post("/v1/chat/completions", json=body(FIRST, stream=True))
    assert "routed_experts" not in await resp.text()
    resp = await moe_client.post(
        "/v1/chat/completions", json=body(FIRST, routed_experts_prompt_start=-1)
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "routed_experts_prompt_start"
