"""Schema v3: request messages stored as a delta after the prompt parent's, tools and large
system messages content-addressed; v2 migration; idempotency on logical content."""

import dataclasses
import json

import numpy as np
import pytest

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
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.stored_form import (
    COLUMNS,
    CorruptRecord,
    MessageDigests,
    StoredMessages,
    column_values,
    common_messages_prefix,
)
from tests.core.test_codec_v2 import assert_same, chain, v2_form

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "d" * 900 + f" {i}",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
    for i in range(20)
]
SYSTEM = {"role": "system", "content": "You are an agent. " * 200}


def session(turns: int) -> list[CallRecord]:
    """A chain with OpenCode-like JSON: ~20 KB of tools, a large system message and a history
    that grows by an assistant tool call and a tool result per turn."""
    records = chain(turns)
    history: list[dict] = [SYSTEM, {"role": "user", "content": "fix the bug"}]
    for t, rec in enumerate(records):
        rec.request_messages = [dict(m) for m in history]
        rec.request_tools = json.loads(json.dumps(TOOLS))
        answer = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": f"t{t}", "function": {"name": "tool_1", "arguments": "{}"}}],
        }
        rec.response_message = answer
        history += [answer, {"role": "tool", "tool_call_id": f"t{t}", "content": f"out {t} " * 50}]
    return records


def encode_session(records: list[CallRecord]) -> list:
    out = []
    for i, rec in enumerate(records):
        if i == 0:
            out.append(encode_record(rec))
            continue
        prev = records[i - 1]
        pp = PromptParent(prev.call_id, prev.num_prompt_tokens + prev.num_generation_tokens)
        k = common_messages_prefix(
            MessageDigests.of(rec.request_messages), prev.call_id, lookup(out)
        )
        out.append(encode_record(rec, prompt_parent=pp, messages_prefix_len=k))
    return out


def lookup(encoded: list):
    by_id = {e.call_id: e for e in encoded}

    def get(call_id: str) -> StoredMessages | None:
        e = by_id.get(call_id)
        if e is None:
            return None
        return StoredMessages(
            e.call_id,
            e.prompt_parent_call_id,
            e.messages_prefix_len,
            e.num_messages,
            e.messages_chain,
        )

    return get


def assert_same_json(a: CallRecord, b: CallRecord) -> None:
    assert_same(a, b)
    # Exact: canonical texts (types and key order) and Python equality.
    for name in ("request_messages", "request_tools", "response_message"):
        x, y = getattr(a, name), getattr(b, name)
        assert x == y, name
        assert json.dumps(x) == json.dumps(y), name


def test_chain_stores_messages_as_deltas_and_tools_once_per_content():
    records = session(6)
    enc = encode_session(records)
    assert [e.messages_prefix_len for e in enc] == [0, 2, 4, 6, 8, 10]
    assert all(len(json.loads(e.messages_delta)) == 2 for e in enc)
    tool_shas = {json.loads(e.meta)["request_tools_sha256"] for e in enc}
    assert len(tool_shas) == 1
    assert "d" * 100 not in enc[3].meta and "You are an agent" not in enc[0].messages_delta
    assert len(enc[0].json_blobs) == 2  # tools + the system message
    for got, want in zip(decode_records(reversed(enc)), reversed(records), strict=True):
        assert_same_json(got, want)


def test_round_trip_without_base_and_single_record():
    rec = session(3)[2]
    rec.request_messages[1] = {"content": 1.0, "role": "user", "n": 1, "t": True}  # key order
    back = decode_record(encode_record(rec))
    assert_same_json(back, rec)
    assert list(back.request_messages[1]) == ["content", "role", "n", "t"]
    assert type(back.request_messages[1]["content"]) is float
    none = rec.replace(request_tools=None, request_messages=[])
    assert_same_json(decode_record(encode_record(none)), none)
    empty = rec.replace(request_tools=[])
    assert decode_record(encode_record(empty)).request_tools == []


def test_messages_that_differ_only_in_json_type_are_not_a_common_prefix():
    base = MessageDigests.of([{"role": "user", "content": 1}])
    assert base.chain[1] != MessageDigests.of([{"role": "user", "content": 1.0}]).chain[1]
    assert base.chain[1] != MessageDigests.of([{"content": 1, "role": "user"}]).chain[1]


def test_branches_share_their_parent_messages():
    parent, a = session(2)
    b = a.replace(call_id="c001b", created_at=1.5)
    b.request_messages = [*a.request_messages[:-1], {"role": "tool", "content": "other"}]
    rows = encode_session([parent, a])
    pp = PromptParent(parent.call_id, parent.num_prompt_tokens + parent.num_generation_tokens)
    k = common_messages_prefix(MessageDigests.of(b.request_messages), parent.call_id, lookup(rows))
    assert k == len(parent.request_messages)
    rows.append(encode_record(b, prompt_parent=pp, messages_prefix_len=k))
    for got, want in zip(decode_records(rows), [parent, a, b], strict=True):
        assert_same_json(got, want)


def test_an_earlier_message_that_changed_shortens_the_prefix():
    records = session(5)
    last = records[4]
    last.request_messages[5] = {**last.request_messages[5], "cache_control": {"type": "x"}}
    enc = encode_session(records)
    assert enc[4].messages_prefix_len == 5  # found in the base's ancestor, not the base
    assert_same_json(decode_records(enc)[4], last)
    first = records[1].replace(call_id="z")
    first.request_messages = [{"role": "system", "content": "other"}, *first.request_messages[1:]]
    k = common_messages_prefix(MessageDigests.of(first.request_messages), "c003", lookup(enc))
    assert k == 0


def test_missing_base_blob_or_wrong_lengths_are_corrupt():
    enc = encode_session(session(3))
    with pytest.raises(CorruptRecord, match="not stored"):
        decode_records([enc[2]])
    short = decode_records(enc[:2])[1]
    with pytest.raises(CorruptRecord, match="not given"):
        decode_record(enc[2], prompt_prefix=(short.prompt_token_ids, short.generation_token_ids))
    with pytest.raises(CorruptRecord, match="at least"):
        decode_record(
            enc[2],
            prompt_prefix=(short.prompt_token_ids, short.generation_token_ids),
            messages_prefix=short.request_messages[:3],
        )
    with pytest.raises(CorruptRecord, match="messages rebuilt"):
        decode_records([*enc[:2], dataclasses.replace(enc[2], num_messages=7)])
    with pytest.raises(CorruptRecord, match="messages_chain"):
        decode_records([*enc[:2], dataclasses.replace(enc[2], messages_chain=b"x")])
    with pytest.raises(CorruptRecord, match="JSON .* is not stored"):
        decode_record(dataclasses.replace(enc[0], json_blobs={}))
    sha = next(iter(enc[0].json_blobs))
    with pytest.raises(CorruptRecord, match="address"):
        decode_record(
            dataclasses.replace(enc[0], json_blobs=dict.fromkeys(enc[0].json_blobs, "[]"))
        )
    assert sha


def test_v2_records_migrate_in_one_step():
    parent, child = session(2)
    pp = PromptParent(parent.call_id, parent.num_prompt_tokens + parent.num_generation_tokens)
    old = [v2_form(parent), v2_form(child, pp)]
    new = [migrate(e) for e in old]
    assert [e.schema_version for e in new] == [SCHEMA_VERSION, SCHEMA_VERSION] == [4, 4]
    assert [e.messages_prefix_len for e in new] == [0, 0]
    assert "request_messages" not in new[1].meta and "d" * 100 not in new[1].meta
    for got, want in zip(decode_records(old), [parent, child], strict=True):
        assert_same_json(got, want)
        assert got.schema_version == 4
    split = encode_session([parent, child])
    assert same_content(old[1], split[1]) and same_content(new[1], split[1])


def test_same_content_ignores_the_messages_split_but_not_the_messages():
    records = session(3)
    split = encode_session(records)[2]
    whole = encode_record(records[2])
    assert split.messages_prefix_len and not whole.messages_prefix_len
    assert same_content(whole, split)
    changed = records[2].replace(request_messages=[*records[2].request_messages[:-1], {}])
    assert not same_content(encode_record(changed), split)
    tools = records[2].replace(request_tools=TOOLS[:3])
    assert not same_content(encode_record(tools), split)
    assert np.array_equal(decode_record(whole).prompt_token_ids, records[2].prompt_token_ids)


def test_messages_prefix_needs_a_prompt_parent_and_must_fit():
    rec = session(2)[1]
    with pytest.raises(ValueError):
        encode_record(rec, messages_prefix_len=1)
    with pytest.raises(ValueError):
        encode_record(rec, prompt_parent=PromptParent("c000", 1), messages_prefix_len=99)


def test_a_request_encoding_computed_ahead_encodes_exactly_what_the_record_would():
    rec = session(3)[2]
    ahead = RequestEncoding.of(rec.request_messages, rec.request_tools)
    assert ahead.belongs_to(rec)
    parent = PromptParent("c001", 10)
    assert encode_record(
        rec, prompt_parent=parent, messages_prefix_len=2, request=ahead
    ) == encode_record(rec, prompt_parent=parent, messages_prefix_len=2)


def test_a_request_encoding_belongs_only_to_the_same_objects():
    rec = session(2)[1]
    ahead = RequestEncoding.of(rec.request_messages, rec.request_tools)
    equal_copies = rec.replace(
        request_messages=[dict(m) for m in rec.request_messages],
        request_tools=json.loads(json.dumps(rec.request_tools)),
    )
    assert not ahead.belongs_to(equal_copies)  # equal values, other objects: not vouched for
    assert not ahead.belongs_to(rec.replace(request_messages=rec.request_messages[:-1]))
    assert not ahead.belongs_to(rec.replace(request_tools=None))
    assert ahead.belongs_to(rec.replace(request_messages=list(rec.request_messages)))
    # one message an equal copy (first or last), the tools the same object: not vouched for
    first, *rest = rec.request_messages
    assert not ahead.belongs_to(rec.replace(request_messages=[dict(first), *rest]))
    assert not ahead.belongs_to(rec.replace(request_messages=[first, *rest[:-1], dict(rest[-1])]))
    with pytest.raises(ValueError, match="does not belong"):
        encode_record(equal_copies, request=ahead)


def test_canonical_json_is_the_stdlib_text_whichever_encoder_writes_it():
    """orjson writes the canonical text when it writes it as the stdlib does: checked on every
    code point and on the values where the two differ (floats) or orjson refuses (integers
    past 64 bits, lone surrogates, keys that are not strings), which take the stdlib."""
    import enum
    import json
    import math

    import pytest

    from capture_proxy.core.stored_form import canonical_json

    def stdlib(value):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)

    points = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for start in range(0, len(points), 4096):
        text = "".join(points[start : start + 4096])
        assert canonical_json(text) == stdlib(text)
        assert canonical_json({text[:64]: [text]}) == stdlib({text[:64]: [text]})

    class Text(str):
        pass

    class Level(enum.IntEnum):
        HIGH = 3

    values = [
        None,
        True,
        False,
        0,
        -1,
        2**63 - 1,
        2**63,
        2**64 - 1,
        2**64,
        -(2**63),
        -(2**63) - 1,
        10**30,
        1.0,
        1e16,
        1e-7,
        0.1,
        -0.0,
        "\ud800 lone",
        {"\udfff": 1},
        {1: "int key"},
        {"a": [1, True, None, {"é": "\u2028\x7f\x00"}], "b": (1, 2)},
        [],
        {},
        "",
        [[[]]],
        {"text": Text("sub")},
        [Level.HIGH],
        {"f": [1, 2.5]},
    ]
    for value in values:
        assert canonical_json(value) == stdlib(value), value
    for bad in (math.nan, [math.inf], {"x": -math.inf}):
        with pytest.raises(ValueError):
            canonical_json(bad)
    with pytest.raises(TypeError):
        canonical_json({"when": object()})


def test_floats_without_an_exponent_take_orjson_and_keep_the_stdlib_text():
    """A float the stdlib writes without an exponent (0, magnitudes in [1e-4, 1e16)) lets orjson
    write the value (a record's metadata holds latency and sampling floats); the text is the
    stdlib's, at the boundaries, across every decade and on random bit patterns. Others
    (1e-05, 1e+16, NaN) take the stdlib."""
    import json
    import math
    import random
    import struct

    from capture_proxy.core.stored_form import _orjson_writes_it_alike, canonical_json

    def stdlib(value):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)

    assert _orjson_writes_it_alike({"latency_ms": 412.5, "sampling": [1.0, 0.95, 0.0, -0.0]})
    for outside in (1e-5, 9.99e-5, 1e16, -1e16, 1e300, 5e-324, math.inf, math.nan):
        assert not _orjson_writes_it_alike({"f": [outside]}), outside
    floats = [
        sign * m * 10.0**e
        for e in range(-330, 309)
        for m in (1.0, 1.2345678901234567, 5.0, 9.999999999999999)
        for sign in (1, -1)
    ]
    rng = random.Random(22)
    floats += [
        struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(20000)
    ]
    floats += [1e-4, math.nextafter(1e-4, 0), 9999999999999998.0, math.nextafter(1e16, 0)]
    for value in (f for f in floats if math.isfinite(f)):
        assert canonical_json({"x": [value]}) == stdlib({"x": [value]}), value


def test_received_values_are_inline_or_addressed_by_their_text_length_alone():
    """Short scalars are kept inline without writing their text; a value that is the request's
    tools list takes the encoding's text; everything else is written and measured: the same
    split as writing every value (a control character's escape is 6 characters)."""
    from capture_proxy.core.stored_form import REF_MIN_BYTES, canonical_json, received_refs

    tools = [{"type": "function", "function": {"name": "bash", "description": "y" * 600}}]
    received = {
        "model": "m",
        "stream": True,
        "temperature": 0.7,
        "seed": 10**17,
        "big": 10**600,
        "none": None,
        "escaped_short": "\x00" * 79,
        "escaped_long": "\x00" * 90,
        "plain_long": "z" * 600,
        "tools": tools,
        "small": {"a": [1, 2]},
    }
    text = canonical_json(tools)
    fast = received_refs(received, b1 := {}, known=[(tools, text, "f" * 64)])
    by_text = {k for k, v in received.items() if len(canonical_json(v)) >= REF_MIN_BYTES}
    assert set(fast[1] or {}) == by_text == {"big", "escaped_long", "plain_long", "tools"}
    assert set(fast[0] or {}) == set(received) - by_text
    assert fast[1]["tools"] == "f" * 64 and b1["f" * 64] == text
    slow = received_refs(received, b2 := {})
    assert slow[0] == fast[0] and set(slow[1] or {}) == by_text and len(b2) == len(b1)


def test_column_values_are_the_columns_in_order():
    rec = session(3)[2]
    enc = encode_record(rec, prompt_parent=PromptParent("c001", 10), messages_prefix_len=2)
    values = column_values(enc)
    assert type(values) is tuple and len(values) == len(COLUMNS) == 20
    assert values == tuple(getattr(enc, name) for name in COLUMNS)
    assert COLUMNS[:3] == ("call_id", "rollout_id", "created_at") and "json_blobs" not in COLUMNS
    assert values[:3] == (rec.call_id, rec.rollout_id, rec.created_at)
