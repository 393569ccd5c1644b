"""Model families: one object per family (``base.ModelFamily``), one module per family.

A family is what exact-token mode (``proxy.exact``) and the scripted engine need to know of a
model's chat format, in one place, so both render and parse with the same objects:

- ``qwen3`` (``qwen3.py``): Hermes ``<tool_call>{json}</tool_call>``, ``<think>`` reasoning,
  turn closed by ``<|im_end|>`` or ``<|endoftext|>``. Serves Qwen3 hybrid (Qwen3-0.6B ... 235B),
  Qwen3-2507 Instruct and Thinking (whose generation prompt opens ``<think>``) with the model's
  own template from its tokenizer directory; without one, our ``templates/chatml_hermes.jinja``
  and the Qwen vocabulary of qwen-tokenizer (``qwen_vocab.py``).
- ``qwen3_coder`` (``qwen3_coder.py``): XML ``<function=N><parameter=K>`` tool calls, closed
  as Qwen3; Qwen3-Coder's template from its directory, else ``templates/qwen3_coder.jinja``.
- ``gpt_oss`` (``gpt_oss.py``, ``gpt_oss_parser.py``): ``openai-harmony`` renders and parses
  (tool calls are ``commentary`` messages to ``functions.NAME``), closed by ``<|return|>`` or
  ``<|call|>`` (``<|end|>`` is appended after a length stop); the o200k vocabulary of
  quicktok-v1. vLLM renders gpt-oss with harmony too, not with its jinja template.
- ``llama3`` (``llama3.py``): Llama 3.1/3.2/3.3 Instruct, JSON tool calls
  ``{"name": N, "parameters": {...}}`` (vLLM's ``llama3_json``), turn closed by
  ``<|eot_id|>`` or ``<|eom_id|>``. Always the model's own template from its tokenizer
  directory: there is no built-in Llama template.
- ``qwen2_5`` (``qwen2_5.py``): Qwen2.5 Instruct and Qwen2.5-Coder Instruct, Hermes JSON tool
  calls (vLLM's ``hermes``), no reasoning, closed as Qwen3; the model's own template from its
  tokenizer directory (no built-in one), the Qwen vocabulary.
- ``qwen3_vl`` (``qwen3_vl.py``): Qwen3-VL Instruct, vision-language: images rendered and their
  placeholders expanded as vLLM's Qwen3-VL processor does (``vision.py``), turns as ``qwen2_5``;
  the published template (``templates/qwen3_vl.jinja``) or the model's own.

Every jinja-template family renders through ``hf_template.LocalRenderer``, which applies vLLM's
message normalisation (``vllm_messages.py``) first. Adding a family is one module (its writer,
its parser, its ``ModelFamily``), one entry in ``_LOADERS`` and its fixtures (the published
template under ``tests/fixtures/chat_templates/`` with its provenance, and the vLLM-rendered
goldens). Nothing here touches a model hub.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from capture_proxy.families.base import ModelFamily, RenderError
from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.families.llama3 import Llama3JsonParser
from capture_proxy.families.parsing import OutputParser
from capture_proxy.families.qwen2_5 import Qwen25HermesParser, load_qwen2_5_family
from capture_proxy.families.qwen3 import QwenHermesParser
from capture_proxy.families.qwen3_coder import Qwen3CoderParser
from capture_proxy.families.qwen3_vl import Qwen3VLHermesParser, load_qwen3_vl_family
from capture_proxy.families.vision import VisionProcessorConfig

FamilyName = Literal["qwen3", "qwen3_coder", "gpt_oss", "llama3", "qwen2_5", "qwen3_vl"]
FAMILIES: tuple[str, ...] = ("qwen3", "qwen3_coder", "gpt_oss", "llama3", "qwen2_5", "qwen3_vl")
_QWEN_TEMPLATES = {"qwen3": "keep_reasoning", "qwen3_coder": "qwen3_coder"}


#: parsers that need nothing but their module (gpt_oss needs its encoding)
PARSERS: dict[str, OutputParser] = {
    "qwen": QwenHermesParser(),
    "qwen3": QwenHermesParser(),
    "qwen3_coder": Qwen3CoderParser(),
    "llama3": Llama3JsonParser(),
    "qwen2_5": Qwen25HermesParser(),
    "qwen3_vl": Qwen3VLHermesParser(),
}
#: what the published templates leave out of a conversation's history
_QWEN_DROPS = (
    "reasoning of assistant turns before the last user query; an empty think block on the "
    "last assistant turn when it has no reasoning"
)


def get_parser(family: str) -> OutputParser:
    """The parser for a model family. Raises KeyError naming the known families."""
    try:
        return PARSERS[family]
    except KeyError:
        raise KeyError(f"unknown parser family {family!r}; known: {', '.join(PARSERS)}") from None


def _qwen_family(
    name: str, tokenizer_dir: Path | None, cache_dir: Path | None, tokenizer: Any = None
) -> ModelFamily:
    from capture_proxy.families.qwen3 import write_qwen3
    from capture_proxy.families.qwen3_coder import write_qwen3_coder

    if tokenizer_dir is not None:
        renderer = LocalRenderer.from_directory(tokenizer_dir)
    else:
        try:
            from capture_proxy.families.qwen_vocab import load_chat_template, load_qwen_tokenizer
        except ImportError as exc:
            raise RenderError(
                f"the built-in Qwen tokenizer needs the scripted extra ({exc}): "
                "pip install 'capture-proxy[scripted]', or give a tokenizer directory"
            ) from exc
        tok = tokenizer if tokenizer is not None else load_qwen_tokenizer(cache_dir)
        renderer = LocalRenderer(tok, load_chat_template(_QWEN_TEMPLATES[name]))
    text_of = write_qwen3 if name == "qwen3" else write_qwen3_coder
    im_end = renderer.token_id("<|im_end|>")
    if im_end is None:
        raise RenderError(f"the {name} tokenizer has no <|im_end|> token")

    def write(message: Mapping[str, Any]) -> list[int]:
        text = text_of(message)
        return [*renderer.tokenizer.encode(text, add_special_tokens=False), im_end]

    return ModelFamily(
        name,
        renderer,
        get_parser(name),
        "<|im_end|>",
        ("<|endoftext|>",),
        write,
        reasoning_tokens=("<think>", "</think>"),
        drops=_QWEN_DROPS,
    )


def _gpt_oss_family(cache_dir: Path | None, system_start_date: str | None) -> ModelFamily:
    try:
        from capture_proxy.families.gpt_oss import HarmonyRenderer, load_gpt_oss_encoding
        from capture_proxy.families.gpt_oss_parser import HarmonyParser
    except ImportError as exc:
        raise RenderError(
            f"the gpt_oss family needs openai-harmony ({exc}): pip install 'capture-proxy[harmony]'"
        ) from exc
    encoding = load_gpt_oss_encoding(cache_dir)
    renderer = HarmonyRenderer(encoding, start_date=system_start_date)
    return ModelFamily(
        "gpt_oss",
        renderer,
        HarmonyParser(encoding),
        "<|end|>",
        ("<|return|>", "<|call|>"),
        renderer.write_assistant,
        drops="the analysis (reasoning) of assistant turns before the last final answer",
    )


#: what the published Llama 3.3 template leaves out of a conversation's history
_LLAMA3_DROPS = (
    "leading and trailing whitespace of every message's content (trim); an assistant turn's "
    "content beside its tool call; it refuses more than one tool call per assistant turn"
)


def _llama3_family(tokenizer_dir: Path | None) -> ModelFamily:
    from capture_proxy.families.llama3 import EOM, EOT, write_llama3

    if tokenizer_dir is None:
        raise RenderError(
            "the llama3 family needs the model's tokenizer directory (family_tokenizers.llama3: "
            "its tokenizer.json and chat template); there is no built-in Llama template"
        )
    renderer = LocalRenderer.from_directory(tokenizer_dir)
    eot = renderer.token_id(EOT)
    if eot is None:
        raise RenderError(f"the llama3 tokenizer at {tokenizer_dir} has no {EOT} token")

    def write(message: Mapping[str, Any]) -> list[int]:
        text = write_llama3(message)
        return [*renderer.tokenizer.encode(text, add_special_tokens=False), eot]

    return ModelFamily(
        "llama3",
        renderer,
        get_parser("llama3"),
        EOT,
        (EOM, "<|end_of_text|>"),
        write,
        drops=_LLAMA3_DROPS,
    )


def load_family(
    name: str,
    *,
    tokenizer_dir: Path | None = None,
    cache_dir: Path | None = None,
    tokenizer: Any = None,
    system_start_date: str | None = None,
    vision: VisionProcessorConfig | None = None,
) -> ModelFamily:
    """The family ``name``. ``tokenizer_dir``: a local HF tokenizer directory with the model's
    own chat template (Qwen families; required for llama3 and qwen2_5); ``cache_dir``: where
    the gpt-oss vocabulary is converted to (default ``~/.cache/capture-proxy/encodings``);
    ``tokenizer``: a loaded built-in Qwen tokenizer to share; ``system_start_date``: gpt-oss's
    ``Current date:`` (``YYYY-MM-DD``, the serving vLLM's ``VLLM_SYSTEM_START_DATE``; None:
    today's local date at each render, as vLLM picks it); ``vision``: a vision-language
    family's image processor settings (qwen3_vl; default: the published ones). Raises
    RenderError (unknown family, tokenizer not loadable, llama3 or qwen2_5 without a tokenizer
    directory)."""
    if name in _QWEN_TEMPLATES:
        return _qwen_family(name, tokenizer_dir, None, tokenizer)
    if name == "gpt_oss":
        return _gpt_oss_family(cache_dir, system_start_date)
    if name == "llama3":
        return _llama3_family(tokenizer_dir)
    if name == "qwen2_5":
        return load_qwen2_5_family(tokenizer_dir)
    if name == "qwen3_vl":
        return load_qwen3_vl_family(tokenizer_dir, tokenizer=tokenizer, vision=vision)
    raise RenderError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")


def write_model_tokenizer(
    directory: Path,
    family: str = "qwen3",
    tokenizer: Any = None,
    chat_template: str | None = None,
) -> Path:
    """Write the built-in Qwen tokenizer with ``family``'s chat template (or ``chat_template``,
    e.g. a published one) as an HF tokenizer directory (``tokenizer.json``,
    ``tokenizer_config.json`` / ``chat_template.jinja``): what a model directory carries so that
    an engine rendering its template (vLLM's ``apply_chat_template``) gives the ids a
    ``LocalRenderer`` of that directory renders. Raises RenderError for a family without a
    jinja template (gpt_oss renders with harmony)."""
    if family not in _QWEN_TEMPLATES:
        raise RenderError(f"family {family!r} has no chat template to write")
    from capture_proxy.families.qwen_vocab import load_chat_template, load_qwen_tokenizer

    tok = tokenizer if tokenizer is not None else load_qwen_tokenizer()
    saved = tok.chat_template
    tok.chat_template = chat_template or load_chat_template(_QWEN_TEMPLATES[family])
    try:
        tok.save_pretrained(str(directory))
    finally:
        tok.chat_template = saved
    return directory


__all__ = [
    "FAMILIES",
    "PARSERS",
    "FamilyName",
    "ModelFamily",
    "get_parser",
    "load_family",
    "write_model_tokenizer",
]
