"""A captured call's images, between the front's parse and the call's flow (adapter).

Owns what needs I/O or the settings: the image policy built once from the settings
(``ImagePolicy``: limits, each model's image processor from ``image_processors``), fetching the
remote images the front left pending (``image_fetch_remote``; bounded size and time, no
redirects), reading from the store the images a Responses ``previous_response_id`` history
names, and refusing images for a model with no image processor. The decisions about an image
are ``core.images``'s; the flow gets the request with every image's bytes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from capture_proxy.config import Settings
from capture_proxy.core.flow.exact_images import IMAGE_DIALECTS
from capture_proxy.core.fronts.base import FrontRequest
from capture_proxy.core.images import (
    ImageLimits,
    ImageRefused,
    PromptImage,
    RequestImages,
    image_parts,
    prompt_image,
)
from capture_proxy.families.vision import (
    QWEN2_5_VL_PROCESSOR,
    QWEN3_VL_PROCESSOR,
    VisionProcessorConfig,
    image_placeholder,
)
from capture_proxy.store.base import CaptureStore

NAMED_PROCESSORS = {"qwen3_vl": QWEN3_VL_PROCESSOR, "qwen2_5_vl": QWEN2_5_VL_PROCESSOR}


def load_processor(name: str) -> VisionProcessorConfig:
    """A named processor (``qwen3_vl``, ``qwen2_5_vl``), else the settings in a
    ``preprocessor_config.json`` (the file, or a model directory holding it). Raises
    ValueError naming what cannot be read."""
    if name in NAMED_PROCESSORS:
        return NAMED_PROCESSORS[name]
    path = Path(name)
    if path.is_dir():
        path = path / "preprocessor_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read image processor settings from {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return VisionProcessorConfig.from_preprocessor_config(config)


@dataclass(frozen=True)
class ImagePolicy:
    """What a call's images may be and how they are processed (from the settings)."""

    limits: ImageLimits | None
    fetch_timeout_s: float = 10.0
    processors: Mapping[str, VisionProcessorConfig] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings) -> ImagePolicy:
        """Raises ValueError when a processor's settings cannot be read."""
        limits = None
        if settings.images_per_call_max > 0:
            limits = ImageLimits(
                max_bytes=settings.image_max_bytes,
                max_images=settings.images_per_call_max,
                url_schemes=frozenset(settings.image_url_schemes),
                fetch_remote=settings.image_fetch_remote,
            )
        processors = {m: load_processor(n) for m, n in settings.image_processors.items()}
        return cls(limits, settings.image_fetch_timeout_s, processors)

    def processor_for(self, model: str | None) -> VisionProcessorConfig | None:
        return self.processors.get(model or "")


#: The app's image policy (set by the composition root).
IMAGES_KEY = web.AppKey("image_policy", ImagePolicy)
#: The session remote images are fetched with (only with ``image_fetch_remote``): its own,
#: never the engine's (which carries the engine's credential and the routing key).
IMAGE_SESSION_KEY = web.AppKey("image_fetch_session", aiohttp.ClientSession)


def make_fetch_session() -> aiohttp.ClientSession:
    """A session for remote images: no default headers, no cookies, a small pool."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=64),
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
    )


async def fetch_image(
    session: aiohttp.ClientSession, url: str, path: str, limits: ImageLimits, timeout_s: float
) -> PromptImage:
    """GET one remote image (no redirects, at most ``limits.max_bytes``). Raises ImageRefused
    naming ``path`` when it cannot be had."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    data = bytearray()
    try:
        async with session.get(url, timeout=timeout, allow_redirects=False) as resp:
            if resp.status != 200:
                raise ImageRefused(f"'{path}': fetching the image answered {resp.status}", path)
            async for chunk in resp.content.iter_chunked(64 * 1024):
                data += chunk
                if len(data) > limits.max_bytes:  # stop reading: never hold more
                    raise ImageRefused(
                        f"'{path}' is larger than {limits.max_bytes} bytes (image_max_bytes)",
                        path,
                    )
    except ImageRefused:
        raise
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ImageRefused(
            f"'{path}': the image could not be fetched: {type(exc).__name__}", path
        ) from exc
    return prompt_image(bytes(data), path)


def _referenced(parsed: FrontRequest) -> list[str]:
    """The sha256 of every canonical image part of the request's messages (in order)."""
    messages: list[Any] = list(parsed.chat.get("messages") or [])
    return [str(p.get("sha256")) for m in messages for p in image_parts(m) if "sha256" in p]


def refuse_images_without_dialect(parsed: FrontRequest, dialect: str) -> None:
    """An exact-token call with images needs a tokens-in dialect that takes them
    (``flow.exact_images.IMAGE_DIALECTS``). Raises ImageRefused naming the first image."""
    found = parsed.images
    if found is None or dialect in IMAGE_DIALECTS:
        return
    where = found.paths[0] if found.paths else "previous_response_id"
    raise ImageRefused(
        f"'{where}': exact_tokens with tokens_in_dialect {dialect} cannot send images (vLLM's "
        "/v1/completions takes none): use vllm_generate or sglang_generate",
        where,
    )


async def complete_images(
    parsed: FrontRequest,
    policy: ImagePolicy,
    session: aiohttp.ClientSession | None,
    store: CaptureStore,
) -> FrontRequest:
    """``parsed`` with every image's bytes: pending remote ones fetched, the ones only the
    history names (``previous_response_id``) read from the store. Raises ImageRefused when the
    model has no image processor, an image cannot be fetched or is unknown to the store, or
    its shape is one the processor refuses (aspect ratio above 200)."""
    found = parsed.images
    images: dict[str, PromptImage] = dict(found.images) if found is not None else {}
    paths = found.paths if found is not None else ()
    if found is not None and policy.limits is not None and found.pending:
        assert session is not None, "image_fetch_remote without its session"
        for pending in found.pending:
            image = await fetch_image(
                session, pending.url, pending.path, policy.limits, policy.fetch_timeout_s
            )
            images.setdefault(image.sha256, image)
            pending.fill(images[image.sha256])
    missing = [sha for sha in dict.fromkeys(_referenced(parsed)) if sha not in images]
    if missing:
        for sha, image in (await store.get_images(missing)).items():
            images[sha] = image
        unknown = [sha for sha in missing if sha not in images]
        if unknown:
            raise ImageRefused(
                f"'previous_response_id': its history names image {unknown[0]}, which the "
                "store does not hold",
                "previous_response_id",
            )
    if not images:
        return parsed
    model = parsed.chat.get("model")
    config = policy.processor_for(model)
    where = paths[0] if paths else "previous_response_id"
    if config is None:
        raise ImageRefused(
            f"'{where}': model {model!r} has no image processor (setting image_processors), so "
            "its images' tokens cannot be captured",
            where,
        )
    for image in images.values():
        try:
            image_placeholder(image.height, image.width, config)
        except ValueError as exc:
            raise ImageRefused(f"'{where}': {exc}", where) from exc
    return dataclasses.replace(parsed, images=RequestImages(images, (), paths))
