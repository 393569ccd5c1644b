"""Schema v2: prompts stored as deltas after a prompt parent, rebuilt on read; v1 migration."""

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest

from capture_proxy.core import codec
from capture_proxy.core.codec import (
    SCHEMA_VERSION,
    PromptParent,
    decode_record,
    decode_records,
    encode_record,
    same_content,
)
from capture_proxy.core.record_migrations import migrate
from capture_proxy.core.records import CallRecord
from capture_proxy.core.stored_form import (
    CorruptRecord,
    EncodedRecord,
    UnsupportedSchemaVersion,
    token_digest,
)
from tests.factories import record


def chain(turns: int, new_prompt: int = 7, gen: int = 3) -> list[CallRecord]:
    """A linear chain: each prompt = previous prompt + generation + ``new_prompt`` ids."""
    rng = np.random.default_rng(turns)
    out: list[CallRecord] = []
    prompt = rng.integers(0, 2**32, new_prompt, dtype=np.uint64).astype(np.uint32)
    for t in range(turns):
        g = rng.integers(0, 2**32, gen, dtype=np.uint64).astype(np.uint32)
        rec = record(f"c{t:03d}", prompt.tolist(), g.tolist(), created_at=float(t))
        out.append(rec)
        extra = rng.integers(0, 2**32, new_prompt, dtype=np.uint64).astype(np.uint32)
        prompt = np.concatenate([prompt, g, extra])
    return out


def encode_chain(records: list[CallRecord]) -> list[EncodedRecord]:
    out = []
    for i, rec in enumerate(records):
        parent = None
        if i:
            prev = records[i - 1]
            parent = PromptParent(prev.call_id, prev.num_prompt_tokens + prev.num_generation_tokens)
        out.append(encode_record(rec, prompt_parent=parent))
    return out


def assert_same(a: CallRecord, b: CallRecord) -> None:
    assert a.call_id == b.call_id
    for name in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
    if a.routed_experts is None:
        assert b.routed_experts is None
    else:
        assert np.array_equal(a.routed_experts, b.routed_experts)
        assert a.routed_experts_start == b.routed_experts_start


def test_child_stores_only_its_new_prompt_tokens():
    records = chain(3)
    enc = encode_chain(records)
    assert len(enc[0].prompt_token_ids) == 7 * 4
    assert [len(e.prompt_token_ids) for e in enc[1:]] == [7 * 4, 7 * 4]
    assert enc[2].prompt_parent_call_id == "c001"
    assert enc[2].prompt_prefix_len == records[1].num_prompt_tokens + 3
    for got, want in zip(decode_records(reversed(enc)), reversed(records), strict=True):
        assert_same(got, want)


def test_stored_bytes_per_appended_turn_do_not_grow():
    enc = encode_chain(chain(64))
    sizes = {len(e.prompt_token_ids) + len(e.generation_token_ids) for e in enc}
    assert sizes == {(7 + 3) * 4}


def test_reads_decode_each_record_once(monkeypatch):
    calls = []
    real = codec.decode_record

    def counting(encoded, **kw):
        calls.append(encoded.call_id)
        return real(encoded, **kw)

    monkeypatch.setattr(codec, "decode_record", counting)
    decode_records(reversed(encode_chain(chain(40))))
    assert len(calls) == 40


@pytest.mark.parametrize(
    ("experts", "start"),
    [
        (None, 0),
        (np.zeros((0, 2, 2), np.uint8), 9),
        (np.arange(12, dtype=np.int64).reshape(2, 3, 2), 0),
        (np.full((3, 1, 8), 255, np.int32), 4),
        (np.full((2, 4, 1), 256, np.int64), 1),
        (np.full((1, 2, 2), 65535, np.uint16), 0),
        (np.full((1, 2, 2), 65536, np.int64), 0),
    ],
)
@pytest.mark.parametrize("with_parent", [False, True])
def test_round_trip_every_dtype_and_shape(experts, start, with_parent):
    parent, child = chain(2)
    child.routed_experts = experts
    child.routed_experts_start = start
    child.generation_log_probs = np.array([math.nan, -math.inf, -0.0], np.float32)
    rows = [encode_record(parent)] if with_parent else []
    pp = PromptParent("c000", parent.num_prompt_tokens + 3) if with_parent else None
    rows.append(encode_record(child, prompt_parent=pp))
    back = decode_records(rows)[-1]
    assert_same(back, child)
    if experts is not None:
        top = int(experts.max()) if experts.size else 0
        want = np.uint8 if top < 256 else np.uint16 if top < 65536 else np.int32
        assert back.routed_experts.dtype == want
        assert back.routed_experts.shape == experts.shape


def test_empty_prompt_and_generation_round_trip():
    rec = record("e", [], [])
    assert_same(decode_record(encode_record(rec)), rec)


def test_prefix_of_wrong_length_or_missing_parent_is_corrupt():
    enc = encode_chain(chain(2))
    with pytest.raises(CorruptRecord, match="not stored"):
        decode_records([enc[1]])
    with pytest.raises(CorruptRecord, match="expects"):
        decode_record(enc[1], prompt_prefix=(np.zeros(3, np.uint32),))
    lying = dataclasses.replace(enc[1], prompt_prefix_len=enc[1].prompt_prefix_len - 1)
    with pytest.raises(CorruptRecord):
        decode_records([enc[0], lying])


def test_prefix_longer_than_prompt_is_refused():
    rec = record("x", [1, 2], [3])
    with pytest.raises(ValueError):
        encode_record(rec, prompt_parent=PromptParent("p", 3))


def legacy_meta(rec: CallRecord) -> str:
    """The metadata text schema v1 and v2 wrote: whole messages and tools inside."""
    experts = json.loads(encode_record(rec).meta)["routed_experts"]
    meta: dict[str, Any] = {
        "model": rec.model,
        "latency_ms": rec.latency_ms,
        "stream": rec.stream,
        "upstream_path": rec.upstream_path,
        "request_messages": rec.request_messages,
        "request_tools": rec.request_tools,
        "response_message": rec.response_message,
        "finish_reason": rec.finish_reason,
        "usage": rec.usage,
        "http_status": rec.http_status,
        "parent_call_id": rec.parent_call_id,
        "linking": rec.linking,
        "retry_of": rec.retry_of,
        "diagnostics": [d.to_json() for d in rec.diagnostics],
        "num_prompt_tokens": rec.num_prompt_tokens,
        "num_generation_tokens": rec.num_generation_tokens,
        "routed_experts": experts,
    }
    return json.dumps(meta, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def v2_form(rec: CallRecord, prompt_parent: PromptParent | None = None) -> EncodedRecord:
    """What schema v2 wrote: the prompt after its parent, whole messages and tools in meta."""
    return dataclasses.replace(
        encode_record(rec, prompt_parent=prompt_parent),
        schema_version=2,
        meta=legacy_meta(rec),
        messages_delta="[]",
        messages_prefix_len=0,
        num_messages=0,
        messages_sha256=b"",
        messages_chain=b"",
        json_blobs={},
    )


def v1_form(rec: CallRecord) -> EncodedRecord:
    """What schema v1 wrote: the full prompt, no v2 fields."""
    return dataclasses.replace(
        v2_form(rec),
        schema_version=1,
        num_prompt_tokens=0,
        num_generation_tokens=0,
        tokens_sha256=b"",
    )


def test_v1_records_migrate_one_step_at_a_time():
    rec = chain(2)[1]
    rec.routed_experts = np.ones((2, 2, 2), np.uint8)
    old = v1_form(rec)
    assert old.schema_version == 1 and old.tokens_sha256 == b""
    new = migrate(old)
    assert new.schema_version == SCHEMA_VERSION == 4
    assert new.prompt_parent_call_id is None
    assert new.tokens_sha256 == token_digest(rec.prompt_token_ids, rec.generation_token_ids)
    assert (new.num_prompt_tokens, new.num_generation_tokens) == (rec.num_prompt_tokens, 3)
    back = decode_record(old)
    assert back.schema_version == SCHEMA_VERSION
    assert_same(back, rec)


def test_newer_records_are_refused_and_unknown_steps_too(monkeypatch):
    enc = encode_record(chain(1)[0])
    with pytest.raises(UnsupportedSchemaVersion):
        migrate(dataclasses.replace(enc, schema_version=SCHEMA_VERSION + 1))
    with pytest.raises(UnsupportedSchemaVersion):
        decode_records([dataclasses.replace(enc, schema_version=SCHEMA_VERSION + 1)])
    with pytest.raises(UnsupportedSchemaVersion, match="no migration"):
        migrate(dataclasses.replace(enc, schema_version=0))


def test_same_content_ignores_how_the_prompt_was_split():
    parent, child = chain(2)
    whole = encode_record(child)
    split = encode_record(child, prompt_parent=PromptParent("c000", parent.num_prompt_tokens + 3))
    assert whole != split
    assert same_content(whole, split)
    assert same_content(v1_form(child), split)
    other = child.replace(prompt_token_ids=child.prompt_token_ids.copy())
    other.prompt_token_ids[-1] ^= 1
    assert not same_content(encode_record(other), split)
    assert not same_content(encode_record(child.replace(finish_reason="length")), split)
