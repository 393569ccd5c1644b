"""Token id and log prob arrays from engine JSON: exact values, refused values named by
position, on the fast path and the per-element one."""

import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture_proxy.core.assembly import CallContext, ChatCaptureAssembler
from capture_proxy.core.records import CallStatus, as_log_prob_array, as_token_array, ids_array


def test_log_probs_are_float32_exactly_as_assigned_one_by_one():
    values = [-0.1, -1e-5, -3, -123.456789, 0.0, -1e-45]
    expected = np.empty(len(values), dtype=np.float32)
    for i, v in enumerate(values):
        expected[i] = v
    got = as_log_prob_array(values, field_name="logprobs")
    assert got.dtype == np.float32
    assert got.tobytes() == expected.tobytes()


def _one_by_one(values: list[float | int]) -> np.ndarray:
    expected = np.empty(len(values), dtype=np.float32)
    for i, v in enumerate(values):
        expected[i] = v
    return expected


#: what a JSON number can be in Python (the stdlib reads NaN/Infinity literals; 1e39 is past
#: float32; 5e-324 below it), and ints next to floats
_LOG_PROB_FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [math.nan, math.inf, -math.inf, -1e39, 3.4028235677973366e38, -5e-324, -0.0]
)


@given(st.lists(_LOG_PROB_FLOATS, max_size=40))
def test_float_log_probs_fast_path_is_the_one_by_one_assignment(values):
    # (the float-only path: the same bits, and a value past float32 warns as one by one does)
    with warnings.catch_warnings(record=True) as expected_warnings:
        warnings.simplefilter("always")
        expected = _one_by_one(values)
    with warnings.catch_warnings(record=True) as got_warnings:
        warnings.simplefilter("always")
        got = as_log_prob_array(values, field_name="logprobs")
    assert got.dtype == np.float32 and got.shape == (len(values),)
    assert got.tobytes() == expected.tobytes()
    assert {str(w.message) for w in got_warnings} <= {str(w.message) for w in expected_warnings}


@given(st.lists(st.floats(allow_nan=False, width=32) | st.integers(-(2**60), 2**60), max_size=40))
def test_log_probs_mixing_ints_and_floats_are_the_one_by_one_assignment(values):
    got = as_log_prob_array(values, field_name="logprobs")
    assert got.tobytes() == _one_by_one(values).tobytes()


def test_null_log_probs_are_kept_as_nan_and_bad_ones_named():
    got = as_log_prob_array([-0.5, None, -1.5], field_name="logprobs")
    assert got[0] == np.float32(-0.5) and math.isnan(got[1]) and got[2] == np.float32(-1.5)
    with pytest.raises(ValueError, match=r"logprobs\[1\]: expected a number, got True"):
        as_log_prob_array([-0.5, True], field_name="logprobs")
    with pytest.raises(ValueError, match=r"logprobs\[0\]: expected a number, got '-1'"):
        as_log_prob_array(["-1"], field_name="logprobs")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1, True], r"token_ids\[1\]: expected a token id \(uint32\), got True"),
        ([1, 2.0], r"token_ids\[1\]: expected a token id \(uint32\), got 2.0"),
        ([-1], r"token_ids\[0\]: expected a token id \(uint32\), got -1"),
        ([0, 2**32], r"token_ids\[1\]: expected a token id \(uint32\), got 4294967296"),
        (["7"], r"token_ids\[0\]: expected a token id \(uint32\), got '7'"),
    ],
)
def test_values_that_are_not_token_ids_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        as_token_array(values, field_name="token_ids")


def test_token_ids_are_uint32_exactly():
    got = as_token_array([0, 151645, 2**32 - 1], field_name="token_ids")
    assert got.dtype == np.uint32 and got.tolist() == [0, 151645, 2**32 - 1]


CTX = CallContext("c1", "r1", 1.0, True, "/v1/chat/completions", {"messages": []})


def _assembler(prompt: list) -> ChatCaptureAssembler:
    asm = ChatCaptureAssembler(CTX)
    asm.add_chunk({"prompt_token_ids": prompt, "choices": [{"index": 0, "delta": {}}]})
    asm.add_chunk(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "ok"},
                    "token_ids": [5, 6],
                    "logprobs": {"content": [{"logprob": -0.25}, {"logprob": -0.5}]},
                    "finish_reason": "stop",
                }
            ]
        }
    )
    return asm


def test_prompt_settled_early_gives_the_same_record():
    early, late = _assembler([1, 2, 3]), _assembler([1, 2, 3])
    early.settle_prompt()
    assert early.prompt_token_ids == []  # the list is let go: the stream keeps the array
    early.add_chunk({"prompt_token_ids": [9, 9], "choices": []})  # a later one is not taken
    a = early.finish(latency_ms=1.0, http_status=200)
    b = late.finish(latency_ms=1.0, http_status=200)
    assert a.status is b.status is CallStatus.COMPLETE
    assert a.prompt_token_ids.tolist() == b.prompt_token_ids.tolist() == [1, 2, 3]
    assert a.generation_token_ids.tolist() == [5, 6]
    assert a.generation_log_probs.tolist() == [-0.25, -0.5]


def test_a_bad_prompt_settled_early_makes_the_record_incomplete_and_names_it():
    asm = _assembler([1, "x"])
    asm.settle_prompt()
    rec = asm.finish(latency_ms=1.0, http_status=200)
    assert rec.status is CallStatus.INCOMPLETE
    [diag] = [d for d in rec.diagnostics if d.kind == "capture_incomplete"]
    assert diag.details["reasons"] == ["prompt_token_ids[1]: expected a token id (uint32), got 'x'"]
    assert rec.generation_token_ids.tolist() == [5, 6]  # what arrived is kept


def test_ids_array_is_numpys_conversion_of_a_renderers_ids():
    for ids in (
        [],
        [0, 1, 2**32 - 1, 151643],
        list(range(5000)),
        [True, 2],
        [1.5, 2.0],
        (3, 4),
        np.arange(4, dtype=np.int64),
        [np.int64(7), 8],
    ):
        got, want = ids_array(ids), np.asarray(ids, dtype=np.uint32)
        assert got.dtype == want.dtype == np.uint32
        assert got.tolist() == want.tolist()
        assert got.flags.writeable and got.flags.c_contiguous
    for bad in ([-1], [2**32], [0, 2**70]):
        with pytest.raises(OverflowError) as numpy_says:
            np.asarray(bad, dtype=np.uint32)
        with pytest.raises(OverflowError, match=str(numpy_says.value)):
            ids_array(bad)
