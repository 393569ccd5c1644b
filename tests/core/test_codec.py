import dataclasses
import json
import math

import numpy as np
import pytest

from capture_proxy.core.codec import (
    SCHEMA_VERSION,
    compact_routed_experts,
    decode_record,
    encode_record,
    same_content,
)
from capture_proxy.core.records import CallStatus, Diagnostic
from capture_proxy.core.stored_form import UnsupportedSchemaVersion
from tests.factories import record


def _full_record():
    rec = record("c1", [151644, 8948, 198, 2**32 - 1], [9707, 0, 151645], created_at=1700000000.25)
    rec.generation_log_probs = np.array([-0.25, math.nan, -math.inf], dtype=np.float32)
    rec.routed_experts = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2) * 20
    rec.routed_experts_start = 5
    rec.request_messages = [{"role": "user", "content": "h\u00e9llo"}]
    rec.request_tools = [{"type": "function", "function": {"name": "read"}}]
    rec.response_message = {"role": "assistant", "content": "hi"}
    rec.diagnostics = [Diagnostic("non_finite_logprob", {"positions": [1, 2]})]
    rec.usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    return rec


def test_round_trip_is_bit_exact():
    rec = _full_record()
    back = decode_record(encode_record(rec))
    assert back.prompt_token_ids.dtype == np.uint32
    assert back.prompt_token_ids.tolist() == [151644, 8948, 198, 2**32 - 1]
    assert back.generation_token_ids.tolist() == [9707, 0, 151645]
    assert back.generation_log_probs.dtype == np.float32
    assert back.generation_log_probs.tobytes() == rec.generation_log_probs.tobytes()
    assert back.routed_experts.dtype == np.uint8  # ids < 256 are narrowed
    assert back.routed_experts.tolist() == rec.routed_experts.tolist()
    assert back.routed_experts_start == 5
    for f in (
        "call_id",
        "rollout_id",
        "created_at",
        "request_messages",
        "request_tools",
        "response_message",
        "diagnostics",
        "usage",
        "status",
    ):
        assert getattr(back, f) == getattr(rec, f), f


def test_arrays_are_binary_not_json():
    enc = encode_record(_full_record())
    assert enc.prompt_token_ids == np.array([151644, 8948, 198, 2**32 - 1], "<u4").tobytes()
    assert "151644" not in enc.meta


@pytest.mark.parametrize(
    ("top", "dtype"), [(255, np.uint8), (256, np.uint16), (65535, np.uint16), (65536, np.int32)]
)
def test_routed_expert_dtype_narrowing(top, dtype):
    arr = np.array([[[0, top]]], dtype=np.int64)
    assert compact_routed_experts(arr).dtype == dtype
    rec = dataclasses.replace(_full_record(), routed_experts=arr)
    back = decode_record(encode_record(rec))
    assert back.routed_experts.dtype == dtype
    assert back.routed_experts.tolist() == [[[0, top]]]


def test_newer_schema_is_refused():
    enc = dataclasses.replace(encode_record(_full_record()), schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(UnsupportedSchemaVersion):
        decode_record(enc)


def test_status_survives():
    rec = dataclasses.replace(_full_record(), status=CallStatus.INCOMPLETE)
    assert decode_record(encode_record(rec)).status is CallStatus.INCOMPLETE


def test_session_headers_round_trip_and_a_record_without_them_keeps_its_stored_text():
    rec = _full_record()
    before = encode_record(rec)
    # an additive v4 field, written only when the request sent one: a record without it
    # (every record stored before it) keeps its text, so a re-put of it is the same content
    assert "session_headers" not in json.loads(before.meta)
    assert decode_record(before).session_headers is None
    headers = {"x-parent-session-id": "ses_p", "x-session-id": "ses_s"}
    enc = encode_record(dataclasses.replace(rec, session_headers=headers))
    meta = json.loads(enc.meta)
    assert meta["session_headers"] == headers
    assert list(meta)[-1] == "session_headers"  # after META_KEYS
    assert decode_record(enc).session_headers == headers
    assert not same_content(before, enc)
    assert same_content(enc, encode_record(decode_record(enc)))
