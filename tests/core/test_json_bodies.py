"""Request bodies as JSON: what parses, what is refused and the field it names."""

import pytest

from capture_proxy.core.json_bodies import InvalidRequest, parse_json_object


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
