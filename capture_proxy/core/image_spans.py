"""Where a call's images stand in its prompt: the record's ``images`` list (pure).

Owns the reading of an expanded prompt's image placeholder runs (Qwen-VL:
``<|vision_start|>`` then N x ``<|image_pad|>`` then ``<|vision_end|>``, N from the image's size,
``families.vision``) and their pairing, one for one in prompt order, with the request's canonical
image parts (``core.images``): each image's entry of ``CallRecord.images``::

    {"sha256", "media_type", "width", "height", "prompt_start", "prompt_end", "processor"}

``prompt_start`` / ``prompt_end``: the half-open span of its ``<|image_pad|>`` tokens in
``prompt_token_ids`` (the placeholder tokens vLLM's processor expands; vLLM's own
``PlaceholderRange`` is ``offset = prompt_start``, ``length = prompt_end - prompt_start``);
``processor``: ``ImagePlaceholder.processor_params`` (grid, resize and normalisation settings),
with which ``families.vision.rebuild_pixel_values`` rebuilds the pixel input from the stored
bytes. Both modes use it: the engine's expanded ids (backend-template mode) and the proxy's own
(exact-token mode). Must not do I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture_proxy.core.images import PromptImage, image_parts
from capture_proxy.core.records import Diagnostic, DiagnosticKind
from capture_proxy.families.vision import (
    IMAGE_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    VisionProcessorConfig,
    image_placeholder,
)


def image_runs(prompt_token_ids: np.ndarray) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of the ``<|image_pad|>`` runs that stand between a
    ``<|vision_start|>`` and a ``<|vision_end|>`` in ``prompt_token_ids``, in order (a
    ``<|vision_start|>`` followed by other tokens, e.g. a video's pads, is no image run)."""
    ids = np.asarray(prompt_token_ids)
    runs = []
    for start in np.flatnonzero(ids == VISION_START_ID).tolist():
        first = start + 1
        rest = ids[first:]
        not_pad = np.flatnonzero(rest != IMAGE_PAD_ID)
        end = first + (int(not_pad[0]) if not_pad.size else int(rest.shape[0]))
        if end > first and end < ids.shape[0] and int(ids[end]) == VISION_END_ID:
            runs.append((first, end))
    return runs


@dataclass(frozen=True)
class RecordImages:
    """What a record keeps of its images: ``entries`` (``CallRecord.images``, None when the
    call has none), ``data`` (sha256 -> bytes, for the store), ``diagnostics`` and whether the
    spans could not be found (``unaligned``: the call's training data is incomplete)."""

    entries: list[dict[str, Any]] | None
    data: dict[str, bytes]
    diagnostics: tuple[Diagnostic, ...] = ()
    unaligned: bool = False


def ordered_images(
    messages: Sequence[Mapping[str, Any]], images: Mapping[str, PromptImage]
) -> list[PromptImage]:
    """The request's images in prompt order (an image sent twice stands twice). Raises
    KeyError for a part whose bytes ``images`` lacks."""
    return [images[str(p.get("sha256"))] for m in messages for p in image_parts(m)]


def record_images(
    messages: Sequence[Mapping[str, Any]],
    images: Mapping[str, PromptImage],
    prompt_token_ids: np.ndarray,
    config: VisionProcessorConfig | None,
) -> RecordImages:
    """The record's images for a prompt of ``prompt_token_ids`` rendered from ``messages``.
    An empty prompt (a call that failed before the engine) gives the entries without spans
    and no diagnostic; a prompt whose runs do not pair with the images gives them without
    spans, ``image_spans_unaligned`` and ``unaligned``."""
    ordered = ordered_images(messages, images)
    if not ordered:
        return RecordImages(None, {})
    data = {image.sha256: image.data for image in ordered}
    runs = image_runs(prompt_token_ids) if prompt_token_ids.shape[0] else []
    entries = []
    diagnostics: list[Diagnostic] = []
    aligned = len(runs) == len(ordered)
    for index, image in enumerate(ordered):
        entry: dict[str, Any] = {
            "sha256": image.sha256,
            "media_type": image.media_type,
            "width": image.width,
            "height": image.height,
            "prompt_start": None,
            "prompt_end": None,
            "processor": None,
        }
        if config is not None:
            placeholder = image_placeholder(image.height, image.width, config)
            entry["processor"] = placeholder.processor_params()
        if aligned:
            start, end = runs[index]
            entry["prompt_start"], entry["prompt_end"] = start, end
            if config is not None and end - start != placeholder.num_tokens:
                diagnostics.append(
                    Diagnostic(
                        DiagnosticKind.IMAGE_TOKENS_MISMATCH,
                        {
                            "image": index,
                            "sha256": image.sha256,
                            "expected": placeholder.num_tokens,
                            "found": end - start,
                        },
                    )
                )
        entries.append(entry)
    unaligned = bool(prompt_token_ids.shape[0]) and not aligned
    if unaligned:
        diagnostics.append(
            Diagnostic(
                DiagnosticKind.IMAGE_SPANS_UNALIGNED,
                {"images": len(ordered), "placeholder_runs": len(runs)},
            )
        )
    return RecordImages(entries, data, tuple(diagnostics), unaligned)
