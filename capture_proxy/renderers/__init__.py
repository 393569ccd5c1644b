"""Model families: one object per family holding its renderer, output parser and turn closers.

A family is what exact-token mode (``proxy.exact``) and the scripted engine need to know of a
model's chat format, in one place, so both render and parse with the same objects:

- ``qwen3``: ``templates/chatml_hermes.jinja``, Hermes ``<tool_call>{json}</tool_call>``,
  turn closed by ``<|im_end|>`` or ``<|endoftext|>``; the Qwen vocabulary of qwen-tokenizer.
- ``qwen3_coder``: ``templates/qwen3_coder.jinja``, XML ``<function=N><parameter=K>``,
  closed as Qwen3; the same vocabulary.
- ``gpt_oss``: ``openai-harmony`` renders and parses (tool calls are ``commentary`` messages
  to ``functions.NAME``), closed by ``<|return|>`` or ``<|call|>`` (``<|end|>`` is appended
  after a length stop); the o200k vocabulary of quicktok-v1.

A Qwen family may be given a local HF tokenizer directory (the real model's tokenizer and
chat template) instead of the built-in one. Nothing here touches a model hub.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from capture_proxy.core.parsers import OutputParser, get_parser
from capture_proxy.rendering import LocalRenderer, RenderError

FamilyName = Literal["qwen3", "qwen3_coder", "gpt_oss"]
FAMILIES: tuple[str, ...] = ("qwen3", "qwen3_coder", "gpt_oss")
_QWEN_TEMPLATES = {"qwen3": "keep_reasoning", "qwen3_coder": "qwen3_coder"}


@dataclass(frozen=True)
class ModelFamily:
    """``renderer``: chat messages -> prompt ids (also the tail after a continued turn);
    ``parser``: generated text / ids -> assistant message; ``end_of_turn_token``: what ends a
    turn in the render (appended after a length stop); ``close_tokens``: other sampled stop
    tokens that close the model's turn; ``write``: the ids the model samples for an assistant
    message, closing token included (the scripted engine's output)."""

    name: str
    renderer: Any  # LocalRenderer | HarmonyRenderer: render, render_sync, render_tail_sync
    parser: OutputParser
    end_of_turn_token: str
    close_tokens: tuple[str, ...]
    write: Callable[[Mapping[str, Any]], list[int]]

    def token_id(self, token: str) -> int:
        """The id of one of the family's tokens. Raises RenderError."""
        tid = self.renderer.token_id(token)
        if tid is None:
            raise RenderError(f"{token!r} is not one token of the {self.name} tokenizer")
        return int(tid)

    @property
    def end_of_turn_id(self) -> int:
        return self.token_id(self.end_of_turn_token)

    @property
    def close_ids(self) -> frozenset[int]:
        """Every sampled token that closes a turn (end of turn included)."""
        ids = {self.end_of_turn_id}
        for t in self.close_tokens:
            tid = self.renderer.token_id(t)
            if tid is not None:
                ids.add(int(tid))
        return frozenset(ids)


def _qwen_family(
    name: str, tokenizer_dir: Path | None, cache_dir: Path | None, tokenizer: Any = None
) -> ModelFamily:
    from capture_proxy.renderers.qwen import write_qwen3, write_qwen3_coder

    if tokenizer_dir is not None:
        renderer = LocalRenderer.from_directory(tokenizer_dir)
    else:
        try:
            from capture_proxy.tokenizer import load_chat_template, load_qwen_tokenizer
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

    return ModelFamily(name, renderer, get_parser(name), "<|im_end|>", ("<|endoftext|>",), write)


def _gpt_oss_family(cache_dir: Path | None) -> ModelFamily:
    try:
        from capture_proxy.core.parsers.harmony import HarmonyParser
        from capture_proxy.renderers.harmony import HarmonyRenderer, load_gpt_oss_encoding
    except ImportError as exc:
        raise RenderError(
            f"the gpt_oss family needs openai-harmony ({exc}): pip install 'capture-proxy[harmony]'"
        ) from exc
    encoding = load_gpt_oss_encoding(cache_dir)
    renderer = HarmonyRenderer(encoding)
    return ModelFamily(
        "gpt_oss",
        renderer,
        HarmonyParser(encoding),
        "<|end|>",
        ("<|return|>", "<|call|>"),
        renderer.write_assistant,
    )


def load_family(
    name: str,
    *,
    tokenizer_dir: Path | None = None,
    cache_dir: Path | None = None,
    tokenizer: Any = None,
) -> ModelFamily:
    """The family ``name``. ``tokenizer_dir``: a local HF tokenizer directory with the model's
    own chat template (Qwen families); ``cache_dir``: where the gpt-oss vocabulary is converted
    to (default ``~/.cache/capture-proxy/encodings``); ``tokenizer``: a loaded built-in Qwen
    tokenizer to share. Raises RenderError (unknown family, tokenizer not loadable)."""
    if name in _QWEN_TEMPLATES:
        return _qwen_family(name, tokenizer_dir, None, tokenizer)
    if name == "gpt_oss":
        return _gpt_oss_family(cache_dir)
    raise RenderError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")


def write_model_tokenizer(directory: Path, family: str = "qwen3", tokenizer: Any = None) -> Path:
    """Write the built-in Qwen tokenizer with ``family``'s chat template as an HF tokenizer
    directory (``tokenizer.json``, ``tokenizer_config.json`` with ``chat_template``): what a
    model directory carries so that an engine rendering its template (vLLM's
    ``apply_chat_template``) gives the ids ``load_family(family)`` renders. Raises RenderError
    for a family without a jinja template (gpt_oss renders with harmony)."""
    if family not in _QWEN_TEMPLATES:
        raise RenderError(f"family {family!r} has no chat template to write")
    from capture_proxy.tokenizer import load_chat_template, load_qwen_tokenizer

    tok = tokenizer if tokenizer is not None else load_qwen_tokenizer()
    saved = tok.chat_template
    tok.chat_template = load_chat_template(_QWEN_TEMPLATES[family])
    try:
        tok.save_pretrained(str(directory))
    finally:
        tok.chat_template = saved
    return directory


__all__ = ["FAMILIES", "FamilyName", "ModelFamily", "load_family", "write_model_tokenizer"]
