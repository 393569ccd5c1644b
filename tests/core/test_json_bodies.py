"""Request bodies as JSON: what parses, what is refused and the field it names."""

import pytest

from capture_proxy.core.json_bodies import (
    _DIGITS_TO_ZERO,
    _LONG_NUMBER,
    _WHOLE_BELOW,
    InvalidRequest,
    _holds_long_number,
    parse_json_object,
)


@pytest.mark.parametrize("raw", [b"{", b"[1]", b'{"a": NaN}', b"\xff\xfe"])
def test_bad_json_is_refused(raw):
    with pytest.raises(InvalidRequest):
        parse_json_object(raw)


def test_numbers_past_64_bits_stay_exact_and_bad_json_is_named():
    # orjson would make this integer a float: the 20-digit run sends it to the stdlib path.
    body = parse_json_object(b'{"seed": 123456789012345678901234567890, "messages": []}')
    assert body["seed"] == 123456789012345678901234567890
    assert parse_json_object(b'{"a": 18446744073709551615}') == {"a": 2**64 - 1}
    # 19 digits, below orjson's int64 range: it would be a float there
    assert parse_json_object(b'{"a": -9223372036854775809}') == {"a": -(2**63) - 1}
    assert parse_json_object(b'{"a": -9223372036854775808}') == {"a": -(2**63)}
    with pytest.raises(InvalidRequest, match="NaN is not valid JSON"):
        parse_json_object(b'{"temperature": NaN}')
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_json_object(b'{"messages": [}')
    with pytest.raises(InvalidRequest, match="must be a JSON object, got list"):
        parse_json_object(b"[1, 2]")
    with pytest.raises(InvalidRequest, match="not UTF-8"):
        parse_json_object(b'{"a": "\xff"}')
    # One text check for every front: a lone surrogate is refused here, naming its field.
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as refused:
        parse_json_object(b'{"a": {"b": ["ok", "\\ud800"]}}')
    assert refused.value.param == "a.b.1"
    with pytest.raises(InvalidRequest, match="nests 300 levels") as deep:
        parse_json_object(b'{"a": ' + b"[" * 299 + b"]" * 299 + b"}")
    assert deep.value.param == "body"
    # A number past the double range would be an infinity, which JSON (and orjson, which
    # writes it as null) cannot carry on: refused, on both parse paths.
    for raw in (b'{"x": 1e400}', b'{"x": -1e400, "seed": 123456789012345678901234567890}'):
        with pytest.raises(InvalidRequest, match="out of the range of a double"):
            parse_json_object(raw)
    assert parse_json_object(b'{"x": 1.7976931348623157e308}') == {"x": 1.7976931348623157e308}


def test_the_sampled_long_number_check_says_what_the_whole_translation_says():
    # Every run length from 0 to 40 digits at every offset around the sample's positions,
    # alone, between letters, twice, and among many short numbers (past the sample's bound).
    bodies = []
    for length in range(41):
        for offset in range(40):
            run = b"7" * length
            bodies.append(b"x" * offset + run + b"y" * 23)
            bodies.append(b"1" * offset + b"," + run + b"," + b"9" * 18)
            bodies.append(b"a" * offset + run + b"b" * 5 + run)
    bodies.append(b",".join(b"9007199254740991" for _ in range(40)))
    # more digits in the sample than it looks around (the whole body is translated)
    bodies.append(b"1," * 2000)
    bodies.append(b"1," * 1000 + b"1" * 19 + b"1," * 1000)
    bodies.append(b",".join(b"9007199254740991" for _ in range(40)) + b",1234567890123456789")
    # each also past _WHOLE_BELOW bytes (padded after), where the sample decides
    pad = b" " * _WHOLE_BELOW
    for raw in bodies:
        expected = _LONG_NUMBER in raw.translate(_DIGITS_TO_ZERO)
        assert _holds_long_number(raw) is expected, raw
        assert _holds_long_number(raw + pad) is expected, raw


@pytest.mark.parametrize("offset", range(19))
def test_a_19_digit_run_is_found_at_every_offset_of_the_sample(offset):
    # The check samples every 19th byte first: a run of 19 digits anywhere sends the body to
    # the stdlib, which keeps the integer exact (orjson would make a float of it).
    raw = b'{"pad": "' + b"x" * offset + b'", "a": -9223372036854775809, "b": "' + b"y" * 40 + b'"}'
    assert parse_json_object(raw)["a"] == -(2**63) - 1
    assert type(parse_json_object(raw)["a"]) is int
    # numbers of up to 18 digits (OpenCode's tools carry 9007199254740991) take orjson
    many = b'{"n": [' + b",".join(b"9007199254740991" for _ in range(50)) + b'], "pad": "'
    many += b"x" * offset + b'"}'
    assert parse_json_object(many) == {"n": [9007199254740991] * 50, "pad": "x" * offset}
    # the same past _WHOLE_BELOW bytes, where the check samples
    spaced = raw[:-1] + b" " * _WHOLE_BELOW + b"}"
    assert parse_json_object(spaced)["a"] == -(2**63) - 1


def test_a_deep_body_is_refused_however_few_its_brackets_outside_strings():
    # The nesting check no longer counts brackets: orjson's write tells, for every body past
    # MAX_NESTING bytes (a shallow one of many bytes passes).
    deep = b'{"a": ' + b"[" * 255 + b"]" * 255 + b"}"
    with pytest.raises(InvalidRequest, match="nests 256 levels"):
        parse_json_object(deep)
    shallow = b'{"a": "' + b"[" * 400 + b'"}'
    assert parse_json_object(shallow) == {"a": "[" * 400}
    # MAX_NESTING levels exactly (the object and 253 arrays) are accepted
    value = parse_json_object(b'{"a": ' + b"[" * 253 + b"]" * 253 + b"}")["a"]
    depth = 0
    while value != []:
        (value,) = value
        depth += 1
    assert depth == 252
