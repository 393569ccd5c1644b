"""Qwen3-Coder XML and harmony parsers: what the family writes parses back to the message,
streamed in any split equal to whole, and the per-call tail equals the full render.

Qwen3-Coder's parser reads as vLLM's ``qwen3_coder`` tool parser without a reasoning parser
(the cases vLLM answers are in ``tests/fixtures/parser_goldens/qwen3_coder.json``): a think
block is content, and a value ends at a ``</parameter>`` written inside it, so its round trip
holds for messages without reasoning and without that tag in a value."""

from __future__ import annotations

import json

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.hf_template import tail_context
from capture_proxy.families.parsing import apply_deltas, tool_call_id
from capture_proxy.families.qwen3_coder import convert_value, xml_call

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "count": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "force": {"type": "boolean"},
                    "lines": {"type": "array"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    }
]
ARGS = {"path": "a </parameter> b.py", "count": 3, "ratio": 0.5, "force": True, "lines": [1, 2]}


def _call(i: int, name: str, args: dict) -> dict:
    return {
        "id": tool_call_id("seed", i),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


MESSAGES = {
    "text": {"content": "Hello.\nTwo lines."},
    "reasoning+text": {"reasoning_content": "Think.\nMore.", "content": "Answer."},
    "call": {"content": "", "tool_calls": [_call(0, "edit", ARGS)]},
    "reasoning+text+call": {
        "reasoning_content": "Plan.",
        "content": "Editing.",
        "tool_calls": [_call(0, "edit", {"path": "x\ny"})],
    },
}
#: what Qwen3-Coder's parser reads back (no reasoning: vLLM serves it without a reasoning parser)
CODER_MESSAGES = {
    "text": MESSAGES["text"],
    "call": {"content": "", "tool_calls": [_call(0, "edit", {**ARGS, "path": "a <b>.py"})]},
    "text+call": {"content": "Editing.", "tool_calls": [_call(0, "edit", {"path": "x\ny"})]},
}


@pytest.fixture(scope="module")
def fams(qwen_tokenizer):
    return {f: load_family(f, tokenizer=qwen_tokenizer) for f in ("qwen3_coder", "gpt_oss")}


@pytest.mark.parametrize(
    ("family", "name"),
    [("qwen3_coder", n) for n in sorted(CODER_MESSAGES)]
    + [("gpt_oss", n) for n in sorted(MESSAGES)],
)
def test_written_message_parses_back_whole_and_streamed(fams, family, name):
    fam = fams[family]
    message = (CODER_MESSAGES if family == "qwen3_coder" else MESSAGES)[name]
    ids = fam.write(message)
    assert ids[-1] in fam.close_ids
    text = fam.renderer.decode_text(ids)
    whole = fam.parser.parse(text, "seed", token_ids=ids, tools=TOOLS)
    assert whole.content == message["content"]
    assert whole.reasoning == message.get("reasoning_content")
    assert whole.tool_calls == message.get("tool_calls", [])
    for size in (1, 3, 7):
        stream = fam.parser.stream("seed", TOOLS)
        deltas = []
        for k in range(0, len(ids), size):
            chunk = ids[k : k + size]
            deltas += stream.feed(fam.renderer.decode_text(chunk), chunk)
        deltas += stream.finish()
        assert apply_deltas(deltas) == whole


def test_xml_values_follow_the_schema():
    raw = (
        "\n<parameter=path>\na </parameter> b.py\n</parameter>\n"
        "<parameter=count>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        "<parameter=force>\nTrue\n</parameter>\n<parameter=lines>\n[1, 2]\n</parameter>\n"
        "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
    )
    name, args = xml_call(" edit ", raw, TOOLS)  # type: ignore[misc]
    assert name == "edit"
    # the value ends at the first </parameter>, as vLLM cuts it
    assert json.loads(args) == {**ARGS, "path": "a ", "note": None, "extra": "7"}
    assert xml_call("", "", TOOLS) is None
    assert xml_call("edit", "no parameter", TOOLS) == ("edit", "{}")
    assert convert_value("12", {"type": "number"}) == 12
    assert convert_value("x", {"type": "integer"}) == "x"
    assert convert_value("5.0", {"type": "integer"}) == 5.0
    assert convert_value("yes", {"type": "boolean"}) == "yes"
    assert convert_value("{'a': 1}", {"type": "object"}) == "{'a': 1}"


def test_truncated_harmony_tool_call_stays_content(fams):
    fam = fams["gpt_oss"]
    ids = fam.write(MESSAGES["call"])[:-3]
    whole = fam.parser.parse("", "seed", token_ids=ids, tools=TOOLS)
    assert whole.tool_calls == []
    assert whole.content.startswith('{"path": "a </parameter> b.py"')
    stream = fam.parser.stream("seed")
    assert apply_deltas([*stream.feed("", ids), *stream.finish()]) == whole


@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder", "gpt_oss"])
def test_tail_render_is_the_full_render_after_the_turn(qwen_tokenizer, family):
    fam = load_family(family, tokenizer=qwen_tokenizer)
    turn = {"role": "assistant", **MESSAGES["reasoning+text+call"]}
    head = [{"role": "system", "content": "S."}, {"role": "user", "content": "Go."}]
    conv = [
        *head,
        turn,
        {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"], "content": "done"},
        {"role": "user", "content": "And now?"},
    ]
    r = fam.renderer
    prompt = r.render_sync(head, TOOLS, add_generation_prompt=True)
    tail = r.render_tail_sync(
        tail_context(conv, 2), conv[3:], TOOLS, end_of_turn_text=fam.end_of_turn_token
    )
    full = r.render_sync(conv, TOOLS, add_generation_prompt=True)
    if family != "gpt_oss":
        assert prompt + fam.write(turn) + tail == full
        return
    # vLLM re-renders a tool-call turn of the history otherwise than gpt-oss writes it: the
    # content before the reasoning, the call in ``json`` (not ``<|constrain|>json``)
    assert full[: len(prompt)] == prompt and full[len(full) - len(tail) :] == tail
    history = r.decode(full[len(prompt) : len(full) - len(tail)])
    written = r.decode(fam.write(turn))
    call = "<|start|>assistant to=functions.edit<|channel|>commentary {}json<|message|>{}<|call|>"
    args = '{"path": "x\\ny"}'
    assert history == (
        "<|channel|>commentary<|message|>Editing.<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Plan.<|end|>" + call.format("", args)
    )
    assert written == (
        "<|channel|>analysis<|message|>Plan.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Editing.<|end|>"
        + call.format("<|constrain|>", args)
    )


def test_a_coder_stream_holds_only_a_partial_tag():
    from capture_proxy.families.qwen3_coder import Qwen3CoderStream, xml_tool_call

    long = "x" * 20_000
    text = long + "\n\n" + xml_tool_call({"name": "edit", "arguments": {"path": long}})
    stream = Qwen3CoderStream("seed", TOOLS)
    held, deltas = 0, []
    for ch in text:
        deltas += stream.feed(ch)
        held = max(held, len(stream.buf))
    deltas += stream.finish()
    assert held < len("</parameter>")
    whole = apply_deltas(deltas)
    assert whole.content == long
    assert json.loads(whole.tool_calls[0]["function"]["arguments"]) == {"path": long}
