"""Qwen3-VL Instruct (vision-language, Hermes JSON tool calls, no reasoning): the family object.

Owns the ``ModelFamily`` of Qwen3-VL-*-Instruct: the published chat template
(``templates/qwen3_vl.jinja``, vendored as ``tests/fixtures/chat_templates/qwen3_vl_instruct.jinja``
with its provenance; or the model's own from its tokenizer directory), the Qwen vocabulary
(Qwen3-VL's tokenizer is Qwen3's: ``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653,
``<|image_pad|>`` 151655), and each image's placeholder expanded as vLLM 0.32's Qwen3-VL
processor does (``vision.expand_image_pads``, with the model's image processor settings,
``image_processors``). vLLM renders the template with openai-format content (an image part is
``{"type": "image"}``, ``vllm_messages``); the template renders it as
``<|vision_start|><|image_pad|><|vision_end|>`` and the processor repeats the ``<|image_pad|>``
``grid_t * grid_h * grid_w / merge_size**2`` times.

An assistant turn renders as Qwen2.5's (content, then Hermes ``<tool_call>`` blocks, no think
block: the Instruct template reads no reasoning), so the writer and parser are ``qwen2_5``'s:
vLLM serves Qwen3-VL-Instruct with ``--tool-call-parser hermes`` and no reasoning parser.

Pure: no aiohttp; reads its template file (or the tokenizer directory) when loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from capture_proxy.families.base import ModelFamily, RenderError
from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.families.qwen2_5 import (
    END_OF_TEXT,
    IM_END,
    Qwen25HermesParser,
    Qwen25HermesStream,
    write_qwen2_5,
)
from capture_proxy.families.vision import QWEN3_VL_PROCESSOR, VisionProcessorConfig

TEMPLATE = Path(__file__).parent / "templates" / "qwen3_vl.jinja"
#: what the published template leaves out of a conversation's history
DROPS = "all reasoning (the Instruct template renders none); images of a system message"


class Qwen3VLHermesParser(Qwen25HermesParser):
    """vLLM's ``hermes`` tool calls, no reasoning (as ``qwen2_5``)."""

    family = "qwen3_vl"

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> Qwen25HermesStream:
        return Qwen25HermesStream(id_seed)


def load_qwen3_vl_family(
    tokenizer_dir: Path | None = None,
    *,
    tokenizer: Any = None,
    vision: VisionProcessorConfig | None = None,
) -> ModelFamily:
    """The qwen3_vl family: the model's tokenizer directory (its ``tokenizer.json`` and chat
    template), else the built-in Qwen tokenizer (``tokenizer``: a loaded one to share) with
    the published template. ``vision``: the model's image processor settings (default: the
    published Qwen3-VL ones). Raises RenderError when the tokenizer cannot be loaded or has no
    ``<|im_end|>``."""
    config = vision or QWEN3_VL_PROCESSOR
    if tokenizer_dir is not None:
        renderer = LocalRenderer.from_directory(tokenizer_dir)
        renderer.vision = config
    else:
        try:
            from capture_proxy.families.qwen_vocab import load_qwen_tokenizer
        except ImportError as exc:
            raise RenderError(
                f"the built-in Qwen tokenizer needs the scripted extra ({exc}): "
                "pip install 'capture-proxy[scripted]', or give a tokenizer directory"
            ) from exc
        tok = tokenizer if tokenizer is not None else load_qwen_tokenizer()
        renderer = LocalRenderer(tok, TEMPLATE.read_text(encoding="utf-8"), config)
    im_end = renderer.token_id(IM_END)
    if im_end is None:
        raise RenderError(f"the qwen3_vl tokenizer has no {IM_END} token")

    def write(message: Mapping[str, Any]) -> list[int]:
        text = write_qwen2_5(message)
        return [*renderer.tokenizer.encode(text, add_special_tokens=False), im_end]

    return ModelFamily(
        "qwen3_vl", renderer, Qwen3VLHermesParser(), IM_END, (END_OF_TEXT,), write, drops=DROPS
    )
