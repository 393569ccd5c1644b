"""The real-vLLM tier's model directory renders the ids our renderer does.

``scripts/e2e-vllm`` writes the tokenizer files of its tiny models with
``renderers.write_model_tokenizer``; vLLM renders a chat request with the directory's chat
template (``chat_template.jinja`` / ``tokenizer_config.json``) through transformers'
``apply_chat_template`` (tool arguments parsed into objects first, text encoded without
special tokens). The same
directory is built here, without vLLM, and every recorded conversation is rendered both ways.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from capture_proxy.families import load_family, write_model_tokenizer
from capture_proxy.families.vllm_messages import normalise_messages, normalise_tools
from capture_proxy.harnesses.recorded import load_recording


def _conversations(fixtures_dir):
    # chat-completions recordings only (the Messages and Responses ones are other APIs)
    for path in sorted(fixtures_dir.glob("opencode/logs/*.jsonl")):
        for rec in load_recording(path):
            if "messages" in rec.body:
                yield rec.body["messages"], rec.body.get("tools")


def _vllm_render(tok, messages, tools, generation_prompt=True):
    text = tok.apply_chat_template(
        normalise_messages(messages),
        tools=normalise_tools(tools),
        add_generation_prompt=generation_prompt,
        tokenize=False,
    )
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder"])
def test_model_dir_template_renders_our_ids(tmp_path, qwen_tokenizer, fixtures_dir, family):
    directory = write_model_tokenizer(tmp_path / family, family, qwen_tokenizer)
    # The template travels in the directory (transformers 5 writes chat_template.jinja beside
    # tokenizer_config.json; older ones wrote it into the config).
    config = json.loads((directory / "tokenizer_config.json").read_text())
    jinja = directory / "chat_template.jinja"
    assert config.get("chat_template") or jinja.read_text()
    model_tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ours = load_family(family, tokenizer=qwen_tokenizer).renderer
    checked = 0
    for messages, tools in _conversations(fixtures_dir):
        for gen in (True, False):
            theirs = _vllm_render(model_tok, messages, tools, gen)
            assert theirs == ours.render_sync(messages, tools, add_generation_prompt=gen)
        checked += 1
    assert checked >= 20
    # and a conversation with reasoning and typed XML-able arguments
    conv = [
        {"role": "system", "content": "S."},
        {"role": "user", "content": "Go."},
        {
            "role": "assistant",
            "content": "Ok.",
            "reasoning_content": "Think.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1, "b": [true], "c": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _vllm_render(model_tok, conv, tools) == ours.render_sync(
        conv, tools, add_generation_prompt=True
    )


def test_gpt_oss_has_no_template_to_write(tmp_path):
    from capture_proxy.families.base import RenderError

    with pytest.raises(RenderError, match="no chat template"):
        write_model_tokenizer(tmp_path, "gpt_oss")
