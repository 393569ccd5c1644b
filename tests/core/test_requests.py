import pytest

from capture_proxy.core.requests import InvalidRequest, parse_json_object, validate_chat_request


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
