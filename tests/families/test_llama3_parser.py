"""The llama3 JSON tool-call parser on its own (no vocabulary): what is a call, what stays
content, what a stream holds back; and the family's settings and loading errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from capture_proxy.config import Settings
from capture_proxy.families import FAMILIES, get_parser, load_family
from capture_proxy.families.base import RenderError
from capture_proxy.families.llama3 import Llama3JsonParser, write_llama3
from capture_proxy.families.parsing import MessageDelta, apply_deltas, tool_call_id

PARSER = Llama3JsonParser()
BACKEND = "http://127.0.0.1:8000"


def calls(*pairs: tuple[str, str]) -> list[dict[str, object]]:
    return [
        {
            "id": tool_call_id("s", i),
            "type": "function",
            "function": {"name": name, "arguments": args},
        }
        for i, (name, args) in enumerate(pairs)
    ]


CASES = {
    # (generated text, content, tool calls)
    "parameters": ('{"name": "f", "parameters": {"a": 1}}', "", calls(("f", '{"a": 1}'))),
    "arguments_key": ('{"name": "f", "arguments": {"a": "é"}}', "", calls(("f", '{"a": "é"}'))),
    "compact_json_redumped": (
        '{"name":"f","parameters":{"a":[1,2]}}',
        "",
        calls(("f", '{"a": [1, 2]}')),
    ),
    "python_tag_and_whitespace": (
        '<|python_tag|> \n{"name": "f", "parameters": {}}',
        "",
        calls(("f", "{}")),
    ),
    "two_calls": (
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": null}}',
        "",
        calls(("f", "{}"), ("g", '{"x": null}')),
    ),
    "trailing_whitespace_dropped": ('{"name": "f", "parameters": {}}\n ;', "", calls(("f", "{}"))),
    "text_after_the_calls_dropped": (  # vLLM: only the objects count after a call
        '{"name": "f", "parameters": {}} and more',
        "",
        calls(("f", "{}")),
    ),
    "later_object_not_a_call": (  # vLLM: then nothing is a call
        '{"name": "f", "parameters": {}}; {"x": 1}',
        '{"name": "f", "parameters": {}}; {"x": 1}',
        [],
    ),
    "brackets_and_escapes_in_strings": (
        '{"name": "f", "parameters": {"a": "}\\"{[", "b": ["]"]}}',
        "",
        calls(("f", '{"a": "}\\"{[", "b": ["]"]}')),
    ),
    "text_before_a_call_is_content": (
        'Sure: {"name": "f", "parameters": {}}',
        'Sure: {"name": "f", "parameters": {}}',
        [],
    ),
    "object_without_arguments": ('{"name": "f"}', '{"name": "f"}', []),
    "name_not_a_string": ('{"name": 1, "parameters": {}}', '{"name": 1, "parameters": {}}', []),
    "invalid_json": ("{not json at all, just braces}", "{not json at all, just braces}", []),
    "unfinished_object": (
        '{"name": "f", "parameters": {"a": ',
        '{"name": "f", "parameters": {"a": ',
        [],
    ),
    "builtin_tool_call_is_content": (
        '<|python_tag|>brave_search.call(query="x")',
        '<|python_tag|>brave_search.call(query="x")',
        [],
    ),
    "plain": ("  Hello {there}  ", "  Hello {there}  ", []),
    "empty": ("", "", []),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_parse_whole_and_streamed(name: str) -> None:
    text, content, tool_calls = CASES[name]
    whole = PARSER.parse(text, "s")
    assert (whole.content, whole.reasoning, whole.tool_calls) == (content, None, tool_calls)
    for size in (1, 2, 5):
        stream = PARSER.stream("s")
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i : i + size])]
        assert apply_deltas([*deltas, *stream.finish()]) == whole, size


def test_stream_holds_back_only_what_may_become_a_call() -> None:
    stream = PARSER.stream("s")
    assert stream.feed(" ") == []  # may precede a call
    assert stream.feed("<|python") == []  # a partial <|python_tag|>
    assert stream.feed('_tag|>{"name": "f", "param') == []
    assert stream.feed('eters": {"a": "}"}') == []  # the object is not complete yet
    # complete, but a later object that is not a call would make all of it content (vLLM):
    # the calls come at the end
    assert stream.feed("}") == []
    assert stream.feed("; ") == []
    assert stream.feed("done") == []  # text after the calls is no content (vLLM)
    assert stream.finish() == [
        MessageDelta(
            tool_call={
                "index": 0,
                "id": tool_call_id("s", 0),
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ),
        MessageDelta(tool_call={"index": 0, "function": {"arguments": '{"a": "}"}'}}),
    ]


def test_a_long_object_is_decoded_a_bounded_number_of_times(monkeypatch) -> None:
    from capture_proxy.families import llama3

    tries: list[int] = []
    decode = llama3._decode_object
    monkeypatch.setattr(llama3, "_decode_object", lambda t: tries.append(len(t)) or decode(t))
    text = '{"name": "f", "parameters": {"text": "' + "x" * 20_000 + '"}}'
    stream = PARSER.stream("s")
    for ch in text:
        assert stream.feed(ch) == []
    assert len(tries) <= 12  # at 16, 32, 64, ... characters, and once when it closes
    assert [d.tool_call["function"]["arguments"] for d in stream.finish()][1] == (
        '{"text": "' + "x" * 20_000 + '"}'
    )


def test_content_streams_at_once() -> None:
    stream = PARSER.stream("s")
    assert stream.feed("Hi") == [MessageDelta(content="Hi")]
    assert stream.feed(' {"name": "f", "parameters": {}}') == [
        MessageDelta(content=' {"name": "f", "parameters": {}}')
    ]


def test_broken_json_is_released_before_the_end() -> None:
    stream = PARSER.stream("s")
    assert stream.feed("{oops") == []  # the error is within the last 10 characters
    assert stream.feed(" this is prose") == [MessageDelta(content="{oops this is prose")]
    assert stream.feed(" more") == [MessageDelta(content=" more")]


def test_an_unterminated_string_is_held_however_long() -> None:
    stream = PARSER.stream("s")
    assert stream.feed('{"name": "f", "parameters": {"text": "' + "x" * 200) == []
    assert stream.finish() == [
        MessageDelta(content='{"name": "f", "parameters": {"text": "' + "x" * 200)
    ]


def test_writer_layout() -> None:
    message = {
        "role": "assistant",
        "content": "not written beside a call",
        "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"b":1,"a":"ü"}'}},
            {"type": "function", "function": {"name": "g", "arguments": "not json"}},
        ],
    }
    assert write_llama3(message) == (
        '{"name": "f", "parameters": {"b": 1, "a": "ü"}}; {"name": "g", "parameters": {}}'
    )
    assert write_llama3({"role": "assistant", "content": [{"type": "text", "text": "a"}]}) == "a"
    assert write_llama3({"role": "assistant", "content": None}) == ""


def test_registry_knows_llama3() -> None:
    assert "llama3" in FAMILIES
    assert isinstance(get_parser("llama3"), Llama3JsonParser)
    with pytest.raises(RenderError) as err:
        load_family("llama3")
    assert str(err.value) == (
        "the llama3 family needs the model's tokenizer directory (family_tokenizers.llama3: "
        "its tokenizer.json and chat template); there is no built-in Llama template"
    )


def test_settings_require_a_llama3_tokenizer(tmp_path) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(backend=BACKEND, model_families={"llama-3.3": "llama3", "qwen": "qwen3"})
    assert (
        "model_families names llama3 for llama-3.3: set family_tokenizers.llama3 to the "
        "model's tokenizer directory" in str(err.value)
    )
    settings = Settings(
        backend=BACKEND,
        model_families={"llama-3.3": "llama3"},
        family_tokenizers={"llama3": tmp_path},
    )
    assert settings.model_families == {"llama-3.3": "llama3"}
    assert settings.family_tokenizers == {"llama3": tmp_path}
