"""Image placeholder arithmetic of the Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors (pure, no I/O).

The interface a vision-language family offers the fronts and the record:

- :class:`VisionProcessorConfig` holds the processor settings of a model's
  ``preprocessor_config.json`` (``patch_size``, ``merge_size``, ``temporal_patch_size``,
  ``size.shortest_edge`` = min pixels, ``size.longest_edge`` = max pixels, ``image_mean``,
  ``image_std``, ``rescale_factor``).
- :func:`image_placeholder` gives, for one image of ``height`` x ``width`` pixels, the
  :class:`ImagePlaceholder`: resized size, ``image_grid_thw`` and the number of
  ``<|image_pad|>`` tokens the engine puts between ``<|vision_start|>`` and ``<|vision_end|>``.
  Its :meth:`ImagePlaceholder.processor_params` is the ``processor`` dict of a record's
  ``images`` entry (schema v4), enough for a trainer to rebuild ``pixel_values`` with
  :func:`rebuild_pixel_values` from the stored image bytes.

Source of the formulas: transformers 5.19 ``models/qwen2_vl/image_processing_qwen2_vl.py``
(``smart_resize``, ``patchify``), used unchanged by Qwen2.5-VL and Qwen3-VL and by vLLM 0.32's
``model_executor/models/qwen2_vl.py`` / ``qwen3_vl.py`` (``_get_vision_info``: the token count is
``grid_t * grid_h * grid_w // merge_size**2``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Qwen vocabulary ids (Qwen2.5 / Qwen3 tokenizers, tokenizer.json added tokens).
VISION_START_ID = 151652
VISION_END_ID = 151653
IMAGE_PAD_ID = 151655

MAX_ASPECT_RATIO = 200
#: The image processor implementation vLLM 0.32's Qwen2-VL / Qwen3-VL models run:
#: transformers' ``image_processing_qwen2_vl.Qwen2VLImageProcessor``, torchvision-backed
#: (``model_executor/models/qwen2_vl.py`` imports it). Its bicubic resize differs from Pillow's
#: by up to two intensity levels on some pixels (measured against vLLM's own pixel input, see
#: ``tests/realengine/test_vllm_images.py``), so the pixel input is rebuilt with it by default.
PIXEL_BACKEND = "torchvision"


@dataclass(frozen=True, slots=True)
class VisionProcessorConfig:
    """A Qwen-VL image processor's settings (``preprocessor_config.json``).

    ``min_pixels`` / ``max_pixels`` are ``size.shortest_edge`` / ``size.longest_edge`` (pixels,
    not edges, despite the names). Defaults are Qwen3-VL's published config.
    """

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_preprocessor_config(cls, config: dict[str, Any]) -> VisionProcessorConfig:
        """Read a ``preprocessor_config.json`` dict.

        Top-level ``min_pixels`` / ``max_pixels`` keys win over ``size``.
        """
        size = config.get("size") or {}
        defaults = cls()
        return cls(
            patch_size=int(config.get("patch_size", defaults.patch_size)),
            merge_size=int(config.get("merge_size", defaults.merge_size)),
            temporal_patch_size=int(
                config.get("temporal_patch_size", defaults.temporal_patch_size)
            ),
            min_pixels=int(
                config.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels
            ),
            max_pixels=int(
                config.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels
            ),
            image_mean=tuple(config.get("image_mean", defaults.image_mean)),  # type: ignore[arg-type]
            image_std=tuple(config.get("image_std", defaults.image_std)),  # type: ignore[arg-type]
            rescale_factor=float(config.get("rescale_factor", defaults.rescale_factor)),
        )


QWEN2_5_VL_PROCESSOR = VisionProcessorConfig(
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=3136,
    max_pixels=12845056,
    image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711),
)
QWEN3_VL_PROCESSOR = VisionProcessorConfig()


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The (height, width) the Qwen-VL processor resizes an image to; both multiples of ``factor``.

    Raises ValueError for an aspect ratio above 200 (the processor's own limit) or a size < 1.
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size must be at least 1x1, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class ImagePlaceholder:
    """One image's processed size, grid and placeholder count."""

    resized_height: int
    resized_width: int
    grid_thw: tuple[int, int, int]
    num_tokens: int
    config: VisionProcessorConfig

    def processor_params(self) -> dict[str, Any]:
        """The record's ``images[i].processor`` dict (JSON-ready)."""
        c = self.config
        return {
            "image_grid_thw": list(self.grid_thw),
            "resized_height": self.resized_height,
            "resized_width": self.resized_width,
            "patch_size": c.patch_size,
            "merge_size": c.merge_size,
            "temporal_patch_size": c.temporal_patch_size,
            "min_pixels": c.min_pixels,
            "max_pixels": c.max_pixels,
            "image_mean": list(c.image_mean),
            "image_std": list(c.image_std),
            "rescale_factor": c.rescale_factor,
            "resample": "bicubic",
            "backend": PIXEL_BACKEND,
        }

    def token_ids(self) -> list[int]:
        """``<|vision_start|>`` + ``num_tokens`` x ``<|image_pad|>`` + ``<|vision_end|>``."""
        return [VISION_START_ID, *([IMAGE_PAD_ID] * self.num_tokens), VISION_END_ID]


def image_placeholder(height: int, width: int, config: VisionProcessorConfig) -> ImagePlaceholder:
    """Placeholder info for one still image of ``height`` x ``width`` pixels (grid_t = 1)."""
    factor = config.patch_size * config.merge_size
    rh, rw = smart_resize(height, width, factor, config.min_pixels, config.max_pixels)
    grid = (1, rh // config.patch_size, rw // config.patch_size)
    return ImagePlaceholder(
        rh, rw, grid, grid[0] * grid[1] * grid[2] // config.merge_size**2, config
    )


def processor_config_from_params(params: dict[str, Any]) -> VisionProcessorConfig:
    """The :class:`VisionProcessorConfig` stored in a record's ``processor`` dict."""
    return VisionProcessorConfig(
        patch_size=int(params["patch_size"]),
        merge_size=int(params["merge_size"]),
        temporal_patch_size=int(params["temporal_patch_size"]),
        min_pixels=int(params["min_pixels"]),
        max_pixels=int(params["max_pixels"]),
        image_mean=tuple(params["image_mean"]),  # type: ignore[arg-type]
        image_std=tuple(params["image_std"]),  # type: ignore[arg-type]
        rescale_factor=float(params["rescale_factor"]),
    )


def rebuild_pixel_values(
    image_bytes: bytes, params: dict[str, Any], backend: str | None = None
) -> np.ndarray:
    """Rebuild an image's ``pixel_values`` from its stored bytes and ``processor`` params.

    Returns float32 of shape (grid_h * grid_w, 3 * temporal_patch_size * patch_size**2), the
    rows the HF Qwen-VL image processor emits for this image. ``backend`` (default: the
    params' ``backend``, else ``pil``): ``torchvision``, transformers' torchvision-backed
    ``Qwen2VLImageProcessor``, what vLLM 0.32 runs (needs torch and torchvision: the pixel
    input the engine had, to 1e-7); ``pil``, this module's numpy port of the Pillow backend
    (``Qwen2VLImageProcessorPil``; Pillow only; its resize differs from torchvision's by up to
    two intensity levels on some pixels). Raises ValueError if the image does not resize.
    """
    if (backend or params.get("backend") or "pil") == "torchvision":
        return _rebuild_with_torchvision(image_bytes, params)
    import io

    from PIL import Image

    config = processor_config_from_params(params)
    with Image.open(io.BytesIO(image_bytes)) as img:
        rgb = img.convert("RGB")
    rh, rw = int(params["resized_height"]), int(params["resized_width"])
    again = image_placeholder(rgb.height, rgb.width, config)
    if (again.resized_height, again.resized_width) != (rh, rw):
        raise ValueError(
            f"image resizes to {again.resized_height}x{again.resized_width}, stored {rh}x{rw}"
        )
    resized = rgb.resize((rw, rh), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) * np.float32(
        config.rescale_factor
    )
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    arr = (arr - mean) / std
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = rh // p, rw // p
    patches = arr.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(
        patches[:, :, :, :, :, None, :, :], (*patches.shape[:5], t, *patches.shape[5:])
    )
    return np.ascontiguousarray(patches.reshape(gh * gw, 3 * t * p * p), dtype=np.float32)


def expand_image_pads(
    token_ids: Sequence[int], sizes: Sequence[tuple[int, int]], config: VisionProcessorConfig
) -> list[int]:
    """``token_ids`` with the k-th ``<|image_pad|>`` (a Qwen-VL chat template renders one per
    image, between ``<|vision_start|>`` and ``<|vision_end|>``) repeated to the number of
    tokens image k of ``sizes`` (``(height, width)``, in prompt order) takes: what vLLM 0.32's
    Qwen2-VL / Qwen3-VL processor does to a rendered prompt (``_get_prompt_updates``: a
    ``PromptReplacement`` whose target is the image token, wherever it stands). Raises
    ValueError when the prompt holds another number of image tokens than ``sizes`` has
    images, or an image's size is one the processor refuses."""
    out: list[int] = []
    k = 0
    for token in token_ids:
        if token == IMAGE_PAD_ID:
            if k >= len(sizes):
                raise ValueError(
                    f"the prompt holds more image placeholders than the {len(sizes)} images"
                )
            height, width = sizes[k]
            out.extend([IMAGE_PAD_ID] * image_placeholder(height, width, config).num_tokens)
            k += 1
        else:
            out.append(token)
    if k != len(sizes):
        raise ValueError(f"the prompt holds {k} image placeholders for {len(sizes)} images")
    return out


def image_sizes(messages: Sequence[Any]) -> list[tuple[int, int]]:
    """``(height, width)`` of every image part of ``messages``, in order: the proxy's
    canonical part (``core.images``: ``width`` and ``height``), or an ``image_url`` part with a
    base64 ``data:`` URL (as an engine gets it; its size read from the bytes, with Pillow).
    Raises ValueError for an image part whose size cannot be known."""
    import base64
    import io

    from PIL import Image

    sizes = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image" and "width" in part and "height" in part:
                sizes.append((int(part["height"]), int(part["width"])))
            elif part.get("type") in ("image", "image_url"):
                url = (part.get("image_url") or {}).get("url", "")
                head, _, data = str(url).partition(",")
                if not (head.startswith("data:") and head.endswith(";base64")):
                    raise ValueError("an image part without its size or a base64 data: URL")
                with Image.open(io.BytesIO(base64.b64decode(data))) as img:
                    width, height = img.size
                sizes.append((height, width))
    return sizes


def _rebuild_with_torchvision(image_bytes: bytes, params: dict[str, Any]) -> np.ndarray:
    """``rebuild_pixel_values`` with transformers' torchvision-backed processor."""
    import io

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    config = processor_config_from_params(params)
    processor = Qwen2VLImageProcessor(
        patch_size=config.patch_size,
        merge_size=config.merge_size,
        temporal_patch_size=config.temporal_patch_size,
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
        rescale_factor=config.rescale_factor,
    )
    with Image.open(io.BytesIO(image_bytes)) as img:
        rgb = img.convert("RGB")
    out = processor(images=[rgb], return_tensors="np")
    grid = [int(x) for x in np.asarray(out["image_grid_thw"])[0]]
    if grid != list(params["image_grid_thw"]):
        raise ValueError(f"image processes to grid {grid}, stored {params['image_grid_thw']}")
    return np.ascontiguousarray(np.asarray(out["pixel_values"]), dtype=np.float32)
