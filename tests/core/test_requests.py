import pytest

from capture_proxy.core.json_bodies import MAX_NESTING, InvalidRequest, parse_json_object
from capture_proxy.core.requests import validate_chat_request


def test_valid_request_passes_with_extras():
    req = validate_chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "temperature": 0.2,
            "chat_template_kwargs": {"a": 1},
        }
    )
    assert req.model_extra == {"chat_template_kwargs": {"a": 1}}
    assert req.temperature == 0.2


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
                                "function": {"name": "f", "arguments": "[" * 100_000},
                            }
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
            "nest too deeply",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            None,
            "only text and image_url content parts",
        ),
    ],
)
def test_bad_requests_name_the_field(body, param, fragment):
    with pytest.raises(InvalidRequest) as info:
        validate_chat_request(body)
    assert fragment in str(info.value)
    if param is not None:
        assert info.value.param == param


def test_the_n_refusal_says_identical_requests_are_siblings_not_retries():
    # docs/linking.md §5: identical requests in one rollout are siblings; a retry needs
    # x-stainless-retry-count > 0 (or an earlier identical call that failed).
    with pytest.raises(InvalidRequest) as info:
        validate_chat_request({"messages": [{"role": "user", "content": "x"}], "n": 2})
    assert str(info.value) == (
        "'n' > 1 is not supported under capture (one record per call): send n separate "
        "requests; identical requests in one rollout are siblings, each its own sample (a "
        "retry only with an x-stainless-retry-count header > 0, or after the earlier one failed)"
    )
    assert info.value.param == "n"


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
    body = _chat(tools=[{"function": {"name": "t", "parameters": {"a": [{"b": "x\ud800"}]}}}])
    with pytest.raises(InvalidRequest, match=r"'tools.0.function.parameters.a.0.b' contains"):
        validate_chat_request(body)
    keyed = _chat(extra={"ok": 1, "k\udc00": 2})
    with pytest.raises(InvalidRequest, match=r"'extra' contains a lone UTF-16 surrogate"):
        validate_chat_request(keyed)


def test_tools_and_tool_choice_are_checked_and_extras_pass():
    tools = [
        {
            "type": "function",
            "function": {"name": "read", "description": "d", "parameters": {}, "strict": True},
            "cache_control": {"type": "ephemeral"},
        },
        {"function": {"name": "ls"}},  # vLLM: a missing type is a function tool
    ]
    choice = {"type": "function", "function": {"name": "read"}}
    req = validate_chat_request(_chat(tools=tools, tool_choice=choice))
    assert req.tools is not None
    assert [t.function.name for t in req.tools] == ["read", "ls"]
    assert req.tools[0].model_extra == {"cache_control": {"type": "ephemeral"}}
    assert req.tools[0].function.model_extra == {"strict": True}
    for mode in ("none", "auto", "required", None):
        assert validate_chat_request(_chat(tool_choice=mode)).tool_choice == mode


def _fn(**function: object) -> dict:
    return {"tools": [{"type": "function", "function": function}]}


def _choice(**function: object) -> dict:
    return {"tool_choice": {"type": "function", "function": function}}


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        (_fn(), "tools.0.function.name", "required"),
        (_fn(name=""), "tools.0.function.name", "at least 1"),
        (_fn(name=5), "tools.0.function.name", "valid string"),
        (_fn(name="a", description=3), "tools.0.function.description", "valid string"),
        (_fn(name="a", parameters=[]), "tools.0.function.parameters", "valid dictionary"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
        (
            {"tools": [{"function": {"name": "a"}}, {"type": "web_search", "function": {}}]},
            "tools.1.type",
            "function tools only",
        ),
        ({"tools": ["read"]}, "tools.0", "valid dictionary"),
        ({"tools": {"function": {"name": "a"}}}, "tools", "valid list"),
        ({"tool_choice": 5}, "tool_choice", "must be 'none', 'auto', 'required' or {"),
        ({"tool_choice": ["auto"]}, "tool_choice", "must be 'none', 'auto', 'required' or {"),
        ({"tool_choice": "any"}, "tool_choice", "'none', 'auto' or 'required'"),
        (_choice(), "tool_choice.function.name", "required"),
        (_choice(name=""), "tool_choice.function.name", "at least 1"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.function", "required"),
        (
            {"tool_choice": {"type": "tool", "function": {"name": "a"}}},
            "tool_choice.type",
            "'function'",
        ),
    ],
)
def test_bad_tools_and_tool_choice_are_refused_naming_the_field(fields, param, fragment):
    with pytest.raises(InvalidRequest) as info:
        validate_chat_request(_chat(**fields))
    assert info.value.param == param
    assert fragment in str(info.value)
    assert "text content parts" not in str(info.value)


def test_tool_call_arguments_are_taken_as_vllm_takes_them():
    from capture_proxy.core.requests import FunctionCall

    # vLLM 0.32 takes any text: "" (a streaming SDK's no-argument call), invalid JSON and
    # non-objects become {} for the template; the text is kept as sent.
    for accepted in ('{"a": NaN}', '{"a": Infinity}', '{"big": 123456789012345678901234567890}',
                     '{"path": "é/✓"}', "[]", '{"a": ', "{'a': 1}", "", "{} x"):  # fmt: skip
        assert FunctionCall(name="t", arguments=accepted).arguments == accepted
    # only nesting the stdlib parser cannot take is refused
    with pytest.raises(ValueError, match="nest too deeply"):
        FunctionCall(name="t", arguments="[" * 100_000 + "]" * 100_000)


#: Every sampling field the proxy forwards at a value OpenAI or vLLM accepts, at the edges.
ACCEPTED_SAMPLING = [
    {"temperature": 0},
    {"temperature": 2},
    {"temperature": 0.7, "top_p": 1, "top_k": -1, "min_p": 0},
    {"top_p": 1e-9, "top_k": 0, "min_p": 1},
    {"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 1e-3},
    {"seed": -(2**63)},
    {"seed": 2**63 - 1},
    {"stop": "END"},
    {"stop": []},
    {"stop": ["</done>", "\n\nUser:"]},
    {"top_logprobs": 0},
    {"top_logprobs": -1, "logprobs": True},  # vLLM: the whole vocabulary
    {"top_logprobs": 50},  # past OpenAI's 20: the engine's max_logprobs decides
    {"logit_bias": {}},
    {"logit_bias": {"50256": -100, "7": 100, "12": 0.5}},
    {"stop_token_ids": [151645], "min_tokens": 0, "ignore_eos": False},
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "[0-9]+"}},
    {k: None for k in ("temperature", "top_p", "seed", "stop", "logit_bias", "top_k")},
]


@pytest.mark.parametrize("fields", ACCEPTED_SAMPLING)
def test_sampling_fields_in_range_pass(fields):
    validate_chat_request(_chat(**fields))


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"temperature": True}, "temperature", "valid number"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"temperature": float("inf")}, "temperature", "finite"),
        ({"top_p": []}, "top_p", "valid number"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": "0"}, "frequency_penalty", "valid number"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"top_k": 1.5}, "top_k", "valid integer"),
        ({"top_k": -2}, "top_k", "greater than or equal to -1"),
        ({"min_p": 1.1}, "min_p", "less than or equal to 1"),
        ({"seed": "x"}, "seed", "valid integer"),
        ({"seed": 1.0}, "seed", "valid integer"),
        ({"seed": 2**63}, "seed", "less than or equal to"),
        ({"stop": 5}, "stop", "a string or a list of strings"),
        ({"stop": {"a": 1}}, "stop", "a string or a list of strings"),
        ({"stop": ["a", 5]}, "stop", "stop[1] is int"),
        ({"stop": ""}, "stop", "empty"),
        ({"stop": ["a", ""]}, "stop", "stop[1] is empty"),
        ({"top_logprobs": "3"}, "top_logprobs", "valid integer"),
        ({"top_logprobs": -2}, "top_logprobs", "greater than or equal to -1"),
        ({"top_logprobs": 2.0}, "top_logprobs", "valid integer"),
        ({"logit_bias": [1, 2]}, "logit_bias", "valid dictionary"),
        ({"logit_bias": "x"}, "logit_bias", "valid dictionary"),
        ({"logit_bias": {"hello": 1}}, "logit_bias", "key 'hello' is not a token id"),
        ({"logit_bias": {"-5": 1}}, "logit_bias", "key '-5' is not a token id"),
        ({"logit_bias": {"5": "up"}}, "logit_bias", "the bias of 5 is str, not a number"),
        ({"logit_bias": {"5": True}}, "logit_bias", "the bias of 5 is bool"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "the bias of 5 is 101, not from -100 to 100"),
        ({"logit_bias": {"5": float("inf")}}, "logit_bias", "not from -100 to 100"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids.1", "valid integer"),
        ({"stop_token_ids": 5}, "stop_token_ids", "valid list"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"ignore_eos": "yes"}, "ignore_eos", "valid boolean"),
        ({"response_format": "json"}, "response_format", "valid dictionary"),
    ],
)
def test_bad_sampling_fields_are_refused_naming_the_field(fields, param, fragment):
    with pytest.raises(InvalidRequest) as info:
        validate_chat_request(_chat(**fields))
    assert info.value.param == param
    assert str(info.value).startswith(f"'{param}': ")
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("content", "param", "message"),
    [
        (
            [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "data:image/png"}],
            "messages.0.content.1.image_url",
            "'messages.0.content.1.image_url': must be an object with a \"url\" "
            '({"url": "data:image/png;base64,..."}), got a string',
        ),
        (
            [{"type": "image_url", "image_url": {"detail": "low"}}],
            "messages.0.content.0.image_url.url",
            "'messages.0.content.0.image_url.url' is required",
        ),
        (
            [{"type": "text", "text": 5}],
            "messages.0.content.0.text",
            "'messages.0.content.0.text': Input should be a valid string",
        ),
        (
            [{"type": "input_audio", "input_audio": {}}],
            "messages.0.content.0.type",
            "'messages.0.content.0.type': Input should be 'text' (only text and image_url "
            "content parts can be captured)",
        ),
        (
            [5],
            "messages.0.content.0",
            "'messages.0.content.0': a content part must be an object (only text and "
            "image_url content parts can be captured)",
        ),
        (
            5,
            "messages.0.content",
            "'messages.0.content': content must be a string, an array of content parts or null",
        ),
    ],
)
def test_a_bad_content_part_is_named_not_the_string_content_is_not(content, param, message):
    with pytest.raises(InvalidRequest) as info:
        validate_chat_request({"model": "m", "messages": [{"role": "user", "content": content}]})
    assert (info.value.param, str(info.value)) == (param, message)
