"""Qwen3-Coder XML and harmony parsers: what the family writes parses back to the message,
streamed in any split equal to whole, and the per-call tail equals the full render."""

from __future__ import annotations

import json

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.hf_template import tail_context
from capture_proxy.families.parsing import apply_deltas, tool_call_id
from capture_proxy.families.qwen3_coder import convert_value, parse_xml_call

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


@pytest.fixture(scope="module")
def fams(qwen_tokenizer):
    return {f: load_family(f, tokenizer=qwen_tokenizer) for f in ("qwen3_coder", "gpt_oss")}


@pytest.mark.parametrize("name", sorted(MESSAGES))
@pytest.mark.parametrize("family", ["qwen3_coder", "gpt_oss"])
def test_written_message_parses_back_whole_and_streamed(fams, family, name):
    fam, message = fams[family], MESSAGES[name]
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
    body = (
        "<function=edit>\n<parameter=path>\na </parameter> b.py\n</parameter>\n"
        "<parameter=count>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        "<parameter=force>\nTrue\n</parameter>\n<parameter=lines>\n[1, 2]\n</parameter>\n"
        "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>"
    )
    name, args = parse_xml_call(body, TOOLS)  # type: ignore[misc]
    assert name == "edit"
    assert json.loads(args) == {**ARGS, "note": None, "extra": "7"}
    assert parse_xml_call("<function=edit>\nno parameter</function>", TOOLS) is None
    assert convert_value("12", {"type": "number"}) == 12
    assert convert_value("x", {"type": "integer"}) == "x"


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
