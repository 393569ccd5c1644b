"""Routed experts: both engine encodings, row ranges, verification and alignment."""

import base64
import io

import numpy as np
import pytest

from capture_proxy.core.records import DiagnosticKind
from capture_proxy.core.routed_experts import (
    align_to_sequence,
    check_overlap,
    check_row_count,
    decode_sglang_routed_experts,
    decode_vllm_routed_experts,
    expected_rows,
    routed_experts_request_fields,
    rows_end,
)
from tests.factories import record


def _npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_vllm_npy_decodes_every_dtype(dtype):
    arr = (np.arange(5 * 3 * 2).reshape(5, 3, 2) % 200).astype(dtype)
    out = decode_vllm_routed_experts(_npy_b64(arr))
    assert out.dtype == dtype
    assert np.array_equal(out, arr)


def test_vllm_nested_lists_of_older_releases():
    assert decode_vllm_routed_experts([[[1, 2]], [[3, 4]]]).shape == (2, 1, 2)


@pytest.mark.parametrize("bad", ["not base64!", _npy_b64(np.zeros((2, 2))), 7, [[1, 2]]])
def test_vllm_refuses_other_shapes_and_encodings(bad):
    with pytest.raises(ValueError):
        decode_vllm_routed_experts(bad)


def test_sglang_base64_little_endian_int32():
    arr = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2) * 1000
    value = base64.b64encode(arr.astype("<i4").tobytes()).decode()
    out = decode_sglang_routed_experts(value, num_layers=3, top_k=2)
    assert out.dtype == np.int32
    assert np.array_equal(out, arr)


def test_sglang_refuses_partial_rows_and_non_base64():
    value = base64.b64encode(np.zeros(7, dtype="<i4").tobytes()).decode()
    with pytest.raises(ValueError, match="whole number"):
        decode_sglang_routed_experts(value, num_layers=3, top_k=2)
    with pytest.raises(ValueError):
        decode_sglang_routed_experts("@@", num_layers=3, top_k=2)


def test_request_fields_ask_only_for_new_rows():
    assert routed_experts_request_fields(None) == {}
    assert routed_experts_request_fields(0) == {}
    assert routed_experts_request_fields(42) == {"routed_experts_prompt_start": 42}
    assert routed_experts_request_fields(42, dialect="sglang") == {
        "return_routed_experts": True,
        "routed_experts_start_len": 42,
    }
    assert routed_experts_request_fields(None, dialect="sglang")["routed_experts_start_len"] == 0
    with pytest.raises(ValueError):
        routed_experts_request_fields(1, dialect="openai")


def test_expected_rows_omit_the_last_sampled_token():
    assert expected_rows(10, 4, 0) == range(0, 13)
    assert expected_rows(10, 4, 13) == range(13, 13)
    assert expected_rows(10, 4, 20) == range(20, 20)


def test_rows_end_of_a_parent_is_the_childs_start():
    parent = record("p", [1] * 10, [2] * 4)
    assert rows_end(parent) is None
    parent.routed_experts = np.zeros((13, 2, 2), np.uint8)
    assert rows_end(parent) == 13
    # The child's request starts there and the engine returns rows [13, P + G - 1).
    assert routed_experts_request_fields(rows_end(parent)) == {"routed_experts_prompt_start": 13}


def test_row_count_checked_against_covered_range():
    rows = np.zeros((13, 2, 2), np.uint8)
    assert check_row_count(rows, start=0, num_prompt_tokens=10, num_generation_tokens=4) is None
    d = check_row_count(rows[:12], start=0, num_prompt_tokens=10, num_generation_tokens=4)
    assert d is not None and d.kind == DiagnosticKind.ROUTED_EXPERTS_MISMATCH
    assert d.details == {"reason": "row_count", "start": 0, "expected_rows": 13, "got_rows": 12}
    incremental = rows[:5]
    assert (
        check_row_count(incremental, start=8, num_prompt_tokens=10, num_generation_tokens=4) is None
    )


def test_overlapping_rows_must_agree():
    full = np.random.default_rng(0).integers(0, 256, (20, 3, 2)).astype(np.uint8)
    assert check_overlap(full[:10], 0, full[6:], 6) is None
    assert check_overlap(full[:5], 0, full[10:], 10) is None  # no overlap
    other = full[6:].copy()
    other[2, 1, 0] ^= 1  # position 8
    d = check_overlap(full[:10], 0, other, 6)
    assert d is not None and d.kind == DiagnosticKind.ROUTED_EXPERTS_MISMATCH
    assert d.details["first_position"] == 8 and d.details["num_positions"] == 1
    assert check_overlap(full[:10], 0, np.zeros((3, 3, 4), np.uint8), 6).details["reason"] == (
        "shape"
    )


def test_align_prefers_the_first_call_covering_a_position():
    a = np.full((5, 1, 2), 1, np.uint8)  # positions 0..4
    b = np.full((6, 1, 2), 2, np.uint16)  # positions 3..8
    out, mask = align_to_sequence([(a, 0), (b, 3)], 10)
    assert out.dtype == np.uint16
    assert out[:, 0, 0].tolist() == [1, 1, 1, 1, 1, 2, 2, 2, 2, 0]
    assert mask.tolist() == [1] * 9 + [0]
    assert align_to_sequence([], 4) is None
    with pytest.raises(ValueError):
        align_to_sequence([(a, 0), (np.zeros((1, 2, 2), np.uint8), 5)], 10)
