import pytest

from capture_proxy.core.requests import (
    MAX_NESTING,
    InvalidRequest,
    parse_json_object,
    validate_chat_request,
)


def test_valid_request_passes_with_extras():
    req = validate_chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "temperature": 0.2,
            "chat_template_kwargs": {"a": 1},
        }
    )
    assert req.model_extra == {"temperature": 0.2, "chat_template_kwargs": {"a": 1}}


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"model": "m"}, "messages", "'messages' is required"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'messages.0.role'"),
        ({"messages": "hi"}, "messages", "'messages'"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "'n' > 1"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream", "'stream'"),
        ({"messages": [{"role": "user", "content": "x"}], "n": True}, "n", "'n'"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
            "max_tokens",
            "'max_tokens'",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"},
            "logprobs",
            "'logprobs'",
        ),
        (
            {"messages": [{"role": "user", "content": "hi\ud800"}]},
            "messages.0.content",
            "lone UTF-16 surrogate",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
            "must be JSON text",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            None,
            "only text content parts",
        ),
    ],
)
def test_bad_requests_name_the_field(body, param, fragment):
    with pytest.raises(InvalidRequest) as info:
        validate_chat_request(body)
    assert fragment in str(info.value)
    if param is not None:
        assert info.value.param == param


@pytest.mark.parametrize("raw", [b"{", b"[1]", b'{"a": NaN}', b"\xff\xfe"])
def test_bad_json_is_refused(raw):
    with pytest.raises(InvalidRequest):
        parse_json_object(raw)


def test_numbers_past_64_bits_stay_exact_and_bad_json_is_named():
    # orjson would make this integer a float: the 20-digit run sends it to the stdlib path.
    body = parse_json_object(b'{"seed": 123456789012345678901234567890, "messages": []}')
    assert body["seed"] == 123456789012345678901234567890
    assert parse_json_object(b'{"a": 18446744073709551615}') == {"a": 2**64 - 1}
    with pytest.raises(InvalidRequest, match="NaN is not valid JSON"):
        parse_json_object(b'{"temperature": NaN}')
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_json_object(b'{"messages": [}')
    with pytest.raises(InvalidRequest, match="must be a JSON object, got list"):
        parse_json_object(b"[1, 2]")
    with pytest.raises(InvalidRequest, match="not UTF-8"):
        parse_json_object(b'{"a": "\xff"}')
    assert parse_json_object(b'{"a": "\\ud800"}') == {"a": "\ud800"}  # named later


def _nested(levels: int) -> object:
    """A value that makes a request body ``levels`` deep (the body object is one level)."""
    value: object = 1
    for _ in range(levels - 1):
        value = [value]
    return value


def _chat(**extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_nesting_up_to_the_limit_is_accepted_and_deeper_is_a_400():
    validate_chat_request(_chat(extra=_nested(MAX_NESTING)))
    with pytest.raises(InvalidRequest, match=r"nests 255 levels deep; at most 254"):
        validate_chat_request(_chat(extra=_nested(MAX_NESTING + 1)))
    with pytest.raises(InvalidRequest, match=r"nests 5000 levels deep"):
        validate_chat_request(_chat(extra=_nested(5000)))  # walked without recursion
    deep = b'{"messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(InvalidRequest, match="nests too deeply"):
        parse_json_object(deep)


def test_a_lone_surrogate_deep_in_the_body_is_named_by_its_path():
    body = _chat(tools=[{"function": {"parameters": {"a": [{"b": "x\ud800"}]}}}])
    with pytest.raises(InvalidRequest, match=r"'tools.0.function.parameters.a.0.b' contains"):
        validate_chat_request(body)
    keyed = _chat(extra={"ok": 1, "k\udc00": 2})
    with pytest.raises(InvalidRequest, match=r"'extra' contains a lone UTF-16 surrogate"):
        validate_chat_request(keyed)


def test_tool_call_arguments_are_checked_as_the_stdlib_parses_them():
    from capture_proxy.core.requests import FunctionCall

    # orjson refuses NaN and Infinity; the stdlib (as vLLM parses them) accepts them.
    for accepted in ('{"a": NaN}', '{"a": Infinity}', '{"big": 123456789012345678901234567890}',
                     '{"path": "é/✓"}', "[]"):  # fmt: skip
        assert FunctionCall(name="t", arguments=accepted).arguments == accepted
    for refused in ('{"a": ', "{'a': 1}", "", "{} x"):
        with pytest.raises(ValueError, match="tool call arguments must be JSON text"):
            FunctionCall(name="t", arguments=refused)
