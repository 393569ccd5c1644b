"""Routed experts in assembled records: kept as received, row counts checked."""

import base64
import dataclasses
import io

import numpy as np
import pytest

from capture_proxy.core.assembly import CallContext, ChatCaptureAssembler
from capture_proxy.core.capture import augment_chat_request
from capture_proxy.core.records import CallStatus

CTX = CallContext(
    "call-1",
    "r1",
    100.0,
    False,
    "/v1/chat/completions",
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
)


def _body(rows: np.ndarray, prompt: int = 5, gen: int = 3) -> dict:
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    return {
        "prompt_token_ids": list(range(prompt)),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "token_ids": list(range(gen)),
                "logprobs": {"content": [{"logprob": -1.0}] * gen},
                "finish_reason": "stop",
                "routed_experts": base64.b64encode(buf.getvalue()).decode(),
            }
        ],
    }


def _finish(ctx: CallContext, body: dict):
    asm = ChatCaptureAssembler(ctx)
    asm.add_response(body)
    return asm.finish(latency_ms=1.0, http_status=200)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_all_rows(dtype):
    rows = np.arange(7 * 2 * 2).reshape(7, 2, 2).astype(dtype)  # 5 + 3 - 1 rows
    rec = _finish(CTX, _body(rows))
    assert rec.status is CallStatus.COMPLETE and rec.diagnostics == []
    assert rec.routed_experts.dtype == dtype and np.array_equal(rec.routed_experts, rows)
    assert rec.routed_experts_start == 0


def test_incremental_rows_cover_from_the_requested_start():
    ctx = dataclasses.replace(CTX, routed_experts_start=4)
    rec = _finish(ctx, _body(np.zeros((3, 2, 2), np.uint8)))
    assert rec.diagnostics == [] and rec.routed_experts_start == 4


def test_wrong_row_count_is_named_and_data_kept():
    rows = np.ones((6, 2, 2), np.uint8)
    rec = _finish(CTX, _body(rows))
    assert rec.status is CallStatus.COMPLETE  # token data is whole; the experts are flagged
    (diag,) = rec.diagnostics
    assert diag.kind == "routed_experts_mismatch"
    assert diag.details["expected_rows"] == 7 and diag.details["got_rows"] == 6
    assert np.array_equal(rec.routed_experts, rows)


def test_augment_asks_for_new_rows_only_with_a_parent():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert "routed_experts_prompt_start" not in augment_chat_request(body)[0]
    out, _ = augment_chat_request(body, parent_rows_end=17)
    assert out["routed_experts_prompt_start"] == 17


@pytest.mark.parametrize("dialect", ["vllm_completions", "sglang_generate"])
def test_tokens_in_short_rows_are_kept_and_flagged(dialect):
    """Issue 17 item 1: exact-token calls keep the engine's routed experts and flag a
    shortfall (SGLang returns seq_len - 1 rows from routed_experts_start_len)."""
    from capture_proxy.core.engine_formats import Piece, get_dialect
    from capture_proxy.core.tokens_in_assembly import TokensInAssembler
    from capture_proxy.scripted_engine.moe import sglang_routed_experts, vllm_routed_experts

    d = get_dialect(dialect, experts_shape=(2, 2))
    body = d.request([1, 2, 3, 4, 5], _sampling(), stream=False, model="m", experts_start=2)
    if dialect == "sglang_generate":
        assert (body["return_routed_experts"], body["routed_experts_start_len"]) == (True, 2)
    else:
        assert body["routed_experts_prompt_start"] == 2
    ctx = dataclasses.replace(CTX, routed_experts_start=2)
    for n_rows, mismatch in ((5, False), (4, True)):  # rows [2, 5 + 3 - 1) = 5
        rows = np.arange(n_rows * 4, dtype=np.uint8).reshape(n_rows, 2, 2)
        raw = (
            vllm_routed_experts(rows)
            if dialect != "sglang_generate"
            else sglang_routed_experts(rows)
        )
        asm = TokensInAssembler(ctx, np.arange(1, 6, dtype=np.uint32), d.decode_routed_experts)
        asm.add(
            Piece(
                [7, 8, 9],
                [-0.1] * 3,
                "x",
                "stop",
                saw_token_ids=True,
                saw_log_probs=True,
                routed_experts=raw,
            )
        )
        rec = asm.finish(response_message={}, finish_reason="stop", latency_ms=1.0, http_status=200)
        assert rec.routed_experts.tolist() == rows.tolist()
        assert rec.routed_experts_start == 2
        kinds = [d.kind for d in rec.diagnostics]
        assert ("routed_experts_mismatch" in kinds) is mismatch
        assert rec.status is CallStatus.COMPLETE


def _sampling():
    from capture_proxy.core.sampling import Sampling

    return Sampling(max_tokens=8)
