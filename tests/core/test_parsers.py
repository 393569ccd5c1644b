"""Qwen/Hermes output parser: round trips with the template's rendering, streaming == whole.

Tool calls are read as vLLM's hermes parser reads them (``tests/families/test_parser_goldens``
compares with vLLM itself): the content is the text before the first ``<tool_call>``, so a
turn with content beside calls comes back with the newline that separates them."""

import json

import pytest

from capture_proxy.families import get_parser
from capture_proxy.families.parsing import apply_deltas, tool_call_id
from capture_proxy.families.qwen3 import render_assistant_generation
from tests.factories import answered_content

PARSER = get_parser("qwen")


def _call(i, name, args):
    return {
        "id": tool_call_id("seed", i),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


MESSAGES = {
    "text": {"content": "Hello, world.\nSecond line."},
    "empty": {"content": ""},
    "reasoning+text": {"reasoning_content": "Think about it.\nCarefully.", "content": "Answer."},
    "one-call": {"content": "", "tool_calls": [_call(0, "read", {"filePath": "caf\u00e9.txt"})]},
    "text+call": {
        "content": "Let me look.",
        "tool_calls": [_call(0, "bash", {"command": "ls -la"})],
    },
    "three-calls": {
        "content": "Several.",
        "tool_calls": [
            _call(0, "glob", {"pattern": "*.py"}),
            _call(1, "grep", {"pattern": "TODO", "n": 3}),
            _call(2, "read", {"filePath": "a\nb"}),
        ],
    },
    "reasoning+calls": {
        "reasoning_content": "Plan: two calls.",
        "content": "",
        "tool_calls": [_call(0, "a", {}), _call(1, "b", {"x": [1, 2]})],
    },
    "markup-like-text": {"content": "Use <tool or <think a bit; x < y\n\n"},
}


def _expected(msg):
    return {
        "content": answered_content(msg.get("content") or "", msg.get("tool_calls")),
        "reasoning": msg.get("reasoning_content"),
        "tool_calls": msg.get("tool_calls") or [],
    }


def _as_dict(parsed):
    return {
        "content": parsed.content,
        "reasoning": parsed.reasoning,
        "tool_calls": parsed.tool_calls,
    }


@pytest.mark.parametrize("name", list(MESSAGES))
def test_parse_inverts_the_template(name):
    msg = MESSAGES[name]
    text = render_assistant_generation(msg)
    parsed = PARSER.parse(text, "seed")
    assert _as_dict(parsed) == _expected(msg)
    # And the parsed message re-rendered is the generated text again, but where the content's
    # newline before a call is written a second time by the template.
    again = render_assistant_generation(parsed.to_openai())
    if msg.get("content") and msg.get("tool_calls"):
        assert again == text.replace("\n<tool_call>", "\n\n<tool_call>", 1)
    else:
        assert again == text


@pytest.mark.parametrize("name", list(MESSAGES))
def test_streamed_deltas_concatenate_to_the_whole_parse(name):
    text = render_assistant_generation(MESSAGES[name])
    whole = _as_dict(PARSER.parse(text, "seed"))
    for size in (1, 2, 3, 5, 7, 13):
        stream = PARSER.stream("seed")
        deltas = []
        for i in range(0, len(text), size):
            deltas += stream.feed(text[i : i + size])
        deltas += stream.finish()
        assert _as_dict(apply_deltas(deltas)) == whole, size
        # Never an empty delta, and markup never leaks into content or reasoning.
        for d in deltas:
            assert d.content != "" and d.reasoning != ""
            assert "<tool_call>" not in (d.content or "") and "</think>" not in (d.reasoning or "")


def test_tool_call_deltas_carry_index_id_name_then_arguments():
    text = render_assistant_generation(MESSAGES["three-calls"])
    stream = PARSER.stream("seed")
    deltas = [d for d in [*stream.feed(text), *stream.finish()] if d.tool_call]
    assert [d.to_openai() for d in deltas[:2]] == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": tool_call_id("seed", 0),
                    "type": "function",
                    "function": {"name": "glob", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"pattern": "*.py"}'}}]},
    ]
    assert [d.tool_call["index"] for d in deltas] == [0, 0, 1, 1, 2, 2]


def test_partial_tool_call_is_held_back_until_decided():
    stream = PARSER.stream("s")
    assert [d.to_openai() for d in stream.feed("Hi.\n<tool_")] == [{"content": "Hi.\n"}]
    assert stream.feed('call>\n{"name": "x", ') == []
    # a later block could still fail to parse (then all of it is content): calls at the end
    assert stream.feed('"arguments": {}}\n</tool_call>') == []
    out = stream.finish()
    assert [d.tool_call["function"] for d in out] == [
        {"name": "x", "arguments": ""},
        {"arguments": "{}"},
    ]


def test_whitespace_before_calls_is_held_and_is_no_content():
    stream = PARSER.stream("s")
    assert stream.feed("\n \n") == []
    assert stream.feed('<tool_call>\n{"name": "x", "arguments": {}}') == []
    assert [d.tool_call["function"] for d in stream.finish()] == [
        {"name": "x", "arguments": ""},
        {"arguments": "{}"},
    ]
    stream = PARSER.stream("s")
    assert stream.feed("\n") == []
    assert [d.to_openai() for d in stream.feed("\nHi")] == [{"content": "\n\nHi"}]


def test_odd_spacing_in_arguments_is_normalised_like_vllm():
    text = '<tool_call>\n{"name": "bash", "arguments": {\n  "command" :  "ls"\n}}\n</tool_call>'
    parsed = PARSER.parse(text, "s")
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"command": "ls"}'


def test_broken_json_leaves_the_whole_text_as_content():
    text = 'Try this.\n<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call>'
    parsed = PARSER.parse(text, "s")
    assert parsed.tool_calls == []
    assert parsed.content == text
    # one block that is not a call: no call at all (vLLM)
    ok = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    parsed = PARSER.parse(ok + "\n<tool_call>\n[1]\n</tool_call>", "s")
    assert (parsed.content, parsed.tool_calls) == (ok + "\n<tool_call>\n[1]\n</tool_call>", [])


def test_stop_on_length_inside_reasoning_or_a_tool_call_keeps_the_text():
    assert _as_dict(PARSER.parse("<think>\nhalf a thou", "s")) == {
        "content": "",
        "reasoning": "half a thou",
        "tool_calls": [],
    }
    cut = PARSER.parse('Do.\n<tool_call>\n{"name": "x", "argu', "s")
    assert cut.tool_calls == [] and cut.content == 'Do.\n<tool_call>\n{"name": "x", "argu'


def test_unknown_family_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown parser family 'gpt-oss'; known: qwen"):
        get_parser("gpt-oss")


def test_a_stream_looks_at_each_piece_a_bounded_number_of_times(monkeypatch):
    from capture_proxy.families import qwen3

    bodies: list[int] = []
    parse = qwen3.hermes_call
    monkeypatch.setattr(qwen3, "hermes_call", lambda b: bodies.append(len(b)) or parse(b))
    long = "x" * 20_000
    text = (
        "<think>\n"
        + long
        + "\n</think>\n\n"
        + long
        + "\n"
        + render_assistant_generation(
            {"content": "", "tool_calls": [_call(0, "write", {"text": long})] * 2}
        )
    )
    stream = PARSER.stream("seed")
    held = 0
    for ch in text:
        stream.feed(ch)
        held = max(held, len(stream.buf), len(stream.calls.tail))
    deltas = stream.finish()
    assert held < len("</tool_call>")  # only a partial tag is ever held
    assert len(bodies) == 2  # each call's body parsed once
    assert [d.tool_call["index"] for d in deltas] == [0, 0, 1, 1]
