"""The qwen2_5 family with the Qwen2.5 vocabulary and the published Qwen2.5 template
(tests/fixtures/chat_templates/qwen2_5_instruct.jinja): the vocabulary is Qwen3's without its
four added tokens, the writer writes what the template renders of a turn, and the parser (vLLM's
hermes, no reasoning) gives back what the writer wrote, whole and streamed. Pure: no event loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture_proxy.families import FAMILIES, PARSERS, load_family
from capture_proxy.families.base import ModelFamily, RenderError
from capture_proxy.families.parsing import apply_deltas, tool_call_id
from capture_proxy.families.qwen2_5 import (
    QWEN2_5_VOCAB_SIZE,
    write_qwen2_5,
    write_qwen2_5_tokenizer,
)

TEMPLATE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen2_5_instruct.jinja"
)
IM_START, IM_END, END_OF_TEXT, TOOL_CALL, TOOL_CALL_END = 151644, 151645, 151643, 151657, 151658
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "read", "arguments": '{"path": "notes café.txt", "limit": 3}'},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> ModelFamily:
    directory = write_qwen2_5_tokenizer(tmp_path_factory.mktemp("qwen2_5"), TEMPLATE.read_text())
    return load_family("qwen2_5", tokenizer_dir=directory)


def test_the_family_is_registered_and_needs_its_directory():
    assert "qwen2_5" in FAMILIES
    assert PARSERS["qwen2_5"].family == "qwen2_5"
    with pytest.raises(RenderError, match="family_tokenizers.qwen2_5"):
        load_family("qwen2_5")


def test_vocabulary_is_qwen3s_without_its_four_added_tokens(family):
    tok = family.renderer.tokenizer
    assert len(tok) == QWEN2_5_VOCAB_SIZE == 151665
    assert [family.token_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        END_OF_TEXT,
        IM_START,
        IM_END,
    ]
    assert (family.token_id("<tool_call>"), family.token_id("</tool_call>")) == (
        TOOL_CALL,
        TOOL_CALL_END,
    )
    for text in ("<tool_response>", "</tool_response>", "<think>", "</think>"):
        assert family.renderer.token_id(text) is None
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) > 1 and max(ids) < END_OF_TEXT, text
    assert family.end_of_turn_id == IM_END
    assert family.close_ids == frozenset({IM_END, END_OF_TEXT})
    assert family.reasoning_tokens is None
    assert not family.opens_reasoning([IM_START, 77091, 198])


def test_writer_is_the_templates_turn_and_drops_reasoning():
    with_content = {"role": "assistant", "content": "Reading.", "tool_calls": [CALL, CALL]}
    call_text = (
        '<tool_call>\n{"name": "read", "arguments": {"path": "notes café.txt", "limit": 3}}'
        "\n</tool_call>"
    )
    assert write_qwen2_5(with_content) == f"Reading.\n{call_text}\n{call_text}"
    null = {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "x"}
    assert write_qwen2_5(null) == call_text
    assert write_qwen2_5({"role": "assistant", "content": "Done.", "reasoning": "r"}) == "Done."


def test_rendered_session_with_null_content_echo(family):
    """A tool-call turn echoed with ``content: null`` renders (vLLM's normalisation), its
    rendering is the model's ids, tool results are grouped into one user turn as text."""
    echo = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    user = [{"role": "user", "content": "Read it."}]
    result = {"role": "tool", "tool_call_id": "call_1", "content": "TODO: ship"}
    prompt = family.renderer.render_sync(user, TOOLS, add_generation_prompt=True)
    full = family.renderer.render_sync([*user, echo, result], TOOLS, add_generation_prompt=True)
    written = family.write(echo)
    assert full[: len(prompt) + len(written)] == prompt + written
    text = family.renderer.decode(full[len(prompt) + len(written) :])
    assert text == (
        "\n<|im_start|>user\n<tool_response>\nTODO: ship\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    system = family.renderer.decode(prompt).split("<|im_end|>")[0]
    assert system.startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.\n\n# Tools\n"
    )


def _both(family: ModelFamily, text: str, step: int) -> list[dict]:
    stream = family.parser.stream("s")
    deltas = [d for k in range(0, len(text), step) for d in stream.feed(text[k : k + step])]
    streamed = apply_deltas([*deltas, *stream.finish()]).to_openai()
    return [family.parser.parse(text, "s").to_openai(), streamed]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_parser_reads_calls_and_keeps_think_as_content(family, step):
    text = (
        "<think>\nnot reasoning\n</think>\n\nLet me look.\n<tool_call>\n"
        + json.dumps({"name": "read", "arguments": {"path": "a b.txt"}})
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "bash", "arguments": {}})
        + "\n</tool_call>"
    )
    want = {
        "role": "assistant",
        # vLLM's hermes parser: the text before the first <tool_call>, newline included
        "content": "<think>\nnot reasoning\n</think>\n\nLet me look.\n",
        "tool_calls": [
            {
                "id": tool_call_id("s", 0),
                "type": "function",
                "function": {"name": "read", "arguments": '{"path": "a b.txt"}'},
            },
            {
                "id": tool_call_id("s", 1),
                "type": "function",
                "function": {"name": "bash", "arguments": "{}"},
            },
        ],
    }
    assert _both(family, text, step) == [want, want]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_parser_keeps_a_block_that_is_not_a_call_as_content(family, step):
    # vLLM's hermes parser: a block that is not a call leaves the whole text as content
    text = "Here.\n<tool_call>\n{not json}\n</tool_call>"
    want = {"role": "assistant", "content": text}
    got = _both(family, text, step)
    assert got == [{**want, "tool_calls": []}] * 2


def test_vendored_template_is_the_one_its_provenance_names():
    import hashlib

    provenance = json.loads((TEMPLATE.parent / "PROVENANCE.json").read_text(encoding="utf-8"))
    (entry,) = [t for t in provenance["templates"] if t["file"] == TEMPLATE.name]
    data = TEMPLATE.read_bytes()
    assert (entry["sha256"], entry["bytes"]) == (hashlib.sha256(data).hexdigest(), len(data))
    assert entry["family"] == "qwen2_5" and entry["verbatim"] is True
    assert entry["copy"]["commit"] == "ddb28eb931be8493db1ad275461fa4e60800aa6a"
    assert entry["vocabulary"]["vocab_size"] == QWEN2_5_VOCAB_SIZE
    assert not data.endswith(b"\n") and b"\r" not in data
