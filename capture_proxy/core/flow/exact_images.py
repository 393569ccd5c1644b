"""An exact-token prompt with images, as the engine's tokens-in endpoint takes it (sans-io).

Owns the one difference images make to an exact-token call's engine request: the proxy's
prompt holds each image's placeholder expanded (the ids the engine will see, and the record
keeps: ``<|vision_start|>`` N x ``<|image_pad|>`` ``<|vision_end|>``), while the engine's
processor expands the placeholders itself, so it is sent one ``<|image_pad|>`` per image and
the images in prompt order:

- ``vllm_generate`` (vLLM 0.32 ``/inference/v1/generate``): ``content_parts`` =
  ``[{"type": "image_url", "url": <data: URL>}]`` (``entrypoints/scale_out/token_in_token_out/
  serving.py``: parsed into the prompt's ``multi_modal_data``, then the model's processor
  expands each image token), with ``return_token_ids``: the engine answers the expanded prompt
  ids (checked id for id against the proxy's by ``TokensInAssembler``) and
  ``mm_placeholders``.
- ``sglang_generate`` (SGLang ``/generate``): ``image_data`` = the data URLs, in prompt order
  (SGLang's native API; its processors expand the image token; not checked against SGLang
  here: SGLang does not install on a CPU-only machine).
- ``vllm_completions``: vLLM's ``/v1/completions`` takes no multimodal input
  (``CompletionRequest`` has ``prompt`` and ``prompt_embeds`` only): refused before the call
  (``proxy.call_handler``).

Must not import aiohttp or asyncio or do any I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture_proxy.core.image_spans import image_runs, ordered_images
from capture_proxy.core.images import PromptImage
from capture_proxy.core.tokens_in_assembly import prompt_ids_json
from capture_proxy.families.base import RenderError

#: Tokens-in dialects that take images, and the body field they take them in.
IMAGE_DIALECTS = frozenset({"vllm_generate", "sglang_generate"})


@dataclass(frozen=True)
class EnginePrompt:
    """What the engine is sent for a prompt with images: its ids with one ``<|image_pad|>``
    per image (JSON text) and the body fields that carry the images."""

    prompt_json: bytes
    fields: dict[str, Any]


def collapse_image_runs(prompt_ids: np.ndarray, runs: list[tuple[int, int]]) -> np.ndarray:
    """``prompt_ids`` with each run ``[start, end)`` of image pads cut to its first token."""
    if not runs:
        return prompt_ids
    keep = np.ones(prompt_ids.shape[0], dtype=bool)
    for start, end in runs:
        keep[start + 1 : end] = False
    return prompt_ids[keep]


def engine_prompt(
    messages: list[Any],
    images: Mapping[str, PromptImage] | None,
    dialect: str,
    prompt_ids: np.ndarray,
) -> EnginePrompt | None:
    """The engine's prompt and image fields for a call of ``messages`` (None when it has no
    image). Raises RenderError when the prompt's placeholder runs do not pair with the images
    or the dialect takes no image."""
    ordered = ordered_images(messages, images or {}) if images else []
    if not ordered:
        return None
    if dialect not in IMAGE_DIALECTS:
        raise RenderError(
            f"tokens_in_dialect {dialect} takes no images (vllm_generate or sglang_generate do)"
        )
    runs = image_runs(prompt_ids)
    if len(runs) != len(ordered):
        raise RenderError(
            f"the exact-token prompt holds {len(runs)} image placeholders for {len(ordered)} images"
        )
    collapsed = collapse_image_runs(prompt_ids, runs)
    urls = [image.data_url() for image in ordered]
    if dialect == "vllm_generate":
        fields: dict[str, Any] = {
            "content_parts": [{"type": "image_url", "url": url} for url in urls],
            "return_token_ids": True,
        }
    else:
        fields = {"image_data": urls}
    return EnginePrompt(prompt_ids_json(collapsed), fields)
