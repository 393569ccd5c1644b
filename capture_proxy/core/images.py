"""Images in a captured call's prompt: how the fronts take them in and what the rest keeps of them.

Owns the canonical image part, the decoding and checking of an image the harness sent (base64
data, a ``data:`` URL, or a remote URL the adapter fetches when allowed), the limits a user sets
(``ImageLimits``), the collection of a request's images while its front parses it
(``ImageCollector`` -> ``RequestImages``) and the conversion back to the engine's chat form
(``engine_messages``). Pure: no I/O (a remote URL is left pending for the adapter to fetch, see
``proxy.images``); Pillow reads an image's size from its bytes in memory.

The canonical image part, in canonical messages and so in a record's ``request_messages`` (the
bytes are stored once per store, content-addressed; never inline in a record)::

    {"type": "image", "sha256": "<64 hex>", "media_type": "image/png", "width": 640,
     "height": 480}

plus ``"detail"`` (``auto`` | ``low`` | ``high``) when the harness sent one (chat, Responses;
vLLM ignores it). Images may stand in user messages and tool results only (the published
Qwen-VL templates render no image of a system or assistant message, while vLLM would still
send the image to the model's processor). The image's identity is ``sha256``, the SHA-256 of
its bytes: it takes part in the linking digests (``linking.digests``), so that two calls whose
images differ never link, whatever their tokens (an image's placeholder tokens depend only on
its size).

Errors: ``ImageRefused`` (an ``InvalidFrontRequest``: a 400 in the API's error shape) names the
field as the front's dotted path (``messages.2.content.0.source.data``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.core.front_errors import InvalidFrontRequest

#: Image formats accepted (Anthropic's four; OpenAI takes the same), by their magic bytes.
MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
#: Roles whose messages may carry images.
IMAGE_ROLES = frozenset({"user", "tool"})
DETAILS = frozenset({"auto", "low", "high"})


class ImageRefused(InvalidFrontRequest):
    """An image the request may not carry (limits, format, scheme, a role without images);
    ``param`` names the field."""


@dataclass(frozen=True)
class ImageLimits:
    """What a call may carry (settings ``image_max_bytes``, ``images_per_call_max``,
    ``image_url_schemes``, ``image_fetch_remote``). ``max_bytes``: decoded bytes per image;
    ``max_images``: image parts per call (a repeated image counts each time);
    ``url_schemes``: URL schemes allowed (``data``, ``http``, ``https``); ``fetch_remote``:
    the proxy fetches an ``http(s)`` URL itself (else such a URL is refused: the engine must
    see bytes the proxy stored)."""

    max_bytes: int = 20 * 1024 * 1024
    max_images: int = 100
    url_schemes: frozenset[str] = frozenset({"data", "https"})
    fetch_remote: bool = False


@dataclass(frozen=True, slots=True)
class PromptImage:
    """One image's bytes and what is known of them: ``sha256`` (hex of the bytes),
    ``media_type`` (from the magic bytes), ``width`` / ``height`` (pixels)."""

    sha256: str
    media_type: str
    width: int
    height: int
    data: bytes = field(repr=False)

    def part(self, detail: str | None = None) -> dict[str, Any]:
        """The canonical image part."""
        out: dict[str, Any] = {
            "type": "image",
            "sha256": self.sha256,
            "media_type": self.media_type,
            "width": self.width,
            "height": self.height,
        }
        if detail is not None:
            out["detail"] = detail
        return out

    def data_url(self) -> str:
        """``data:<media_type>;base64,<bytes>``: how the engine is sent the image."""
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode()}"

    def ref(self) -> dict[str, Any]:
        """The store's row of it, without the bytes."""
        return {
            "sha256": self.sha256,
            "media_type": self.media_type,
            "width": self.width,
            "height": self.height,
            "num_bytes": len(self.data),
        }


def sniff_media_type(data: bytes) -> str | None:
    """The media type of ``data`` by its magic bytes (one of ``MEDIA_TYPES``), else None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def prompt_image(data: bytes, path: str, declared: str | None = None) -> PromptImage:
    """A ``PromptImage`` of ``data`` (the bytes as the harness sent them). Raises ImageRefused
    naming ``path`` when the bytes are no PNG, JPEG, GIF or WebP image, differ from the
    ``declared`` media type, or cannot be read."""
    media_type = sniff_media_type(data)
    if media_type is None:
        raise ImageRefused(
            f"'{path}' is not a PNG, JPEG, GIF or WebP image ({len(data)} bytes)", path
        )
    if declared is not None and declared != media_type:
        raise ImageRefused(f"'{path}' says {declared!r} but the image is {media_type}", path)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageRefused(f"'{path}' cannot be read as {media_type}: {exc}", path) from exc
    if width < 1 or height < 1:
        raise ImageRefused(f"'{path}' has no pixels ({width}x{height})", path)
    return PromptImage(hashlib.sha256(data).hexdigest(), media_type, width, height, data)


def decode_base64(text: str, path: str, max_bytes: int) -> bytes:
    """Strict base64 (no stray characters) of at most ``max_bytes`` decoded bytes. Raises
    ImageRefused naming ``path``."""
    if len(text) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageRefused(f"'{path}' is larger than {max_bytes} bytes (image_max_bytes)", path)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageRefused(f"'{path}' is not base64: {exc}", path) from exc
    if len(data) > max_bytes:
        raise ImageRefused(f"'{path}' is larger than {max_bytes} bytes (image_max_bytes)", path)
    return data


def url_scheme(url: str) -> str:
    """The scheme of ``url`` in lower case (``data``, ``https``, ...), or ``""``."""
    head, sep, _ = url.partition(":")
    return head.lower() if sep and head.isascii() and head.replace("+", "").isalnum() else ""


def parse_data_url(url: str, path: str, max_bytes: int) -> tuple[bytes, str | None]:
    """(bytes, declared media type) of a ``data:<type>;base64,<data>`` URL. Raises
    ImageRefused naming ``path``."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageRefused(f"'{path}' is not a data URL (data:<type>;base64,<data>)", path)
    params = head[5:].split(";")
    if params[-1].lower() != "base64":
        raise ImageRefused(f"'{path}': only base64 data URLs carry images", path)
    declared = params[0].lower() or None
    return decode_base64(payload, path, max_bytes), declared


@dataclass
class PendingImage:
    """A remote image the adapter fetches before the call (``image_fetch_remote``): its URL,
    the canonical part to fill (``fill``) and the field it came from."""

    url: str
    part: dict[str, Any]
    path: str

    def fill(self, image: PromptImage) -> None:
        """Make the part the canonical part of ``image`` (the bytes the engine will see)."""
        detail = self.part.get("detail")
        self.part.clear()
        self.part.update(image.part(detail))


@dataclass(frozen=True)
class RequestImages:
    """A request's images: ``images`` the distinct ones by first appearance (sha256 ->
    image), ``pending`` the remote URLs still to fetch, ``paths`` every image part's field in
    prompt order, ``count`` the image parts."""

    images: Mapping[str, PromptImage]
    pending: tuple[PendingImage, ...] = ()
    paths: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.paths)


class ImageCollector:
    """Takes a request's images in while its front parses it (``limits``: what it may carry;
    None: images are refused, naming the field)."""

    def __init__(self, limits: ImageLimits | None) -> None:
        self.limits = limits
        self.images: dict[str, PromptImage] = {}
        self.pending: list[PendingImage] = []
        self.paths: list[str] = []

    def _admit(self, path: str, role: str) -> ImageLimits:
        if self.limits is None:
            raise ImageRefused(f"'{path}': images are not accepted here", path)
        if role not in IMAGE_ROLES:
            raise ImageRefused(
                f"'{path}': images can stand in user messages and tool results only, "
                f"not in a {role} message",
                path,
            )
        if len(self.paths) >= self.limits.max_images:
            raise ImageRefused(
                f"'{path}': more than {self.limits.max_images} images in one call "
                "(images_per_call_max)",
                path,
            )
        self.paths.append(path)
        return self.limits

    def _keep(self, image: PromptImage) -> PromptImage:
        return self.images.setdefault(image.sha256, image)

    def base64(
        self, data: Any, media_type: Any, path: str, role: str, *, detail: str | None = None
    ) -> dict[str, Any]:
        """An image sent as base64 text with its media type (Anthropic ``source.type:
        base64``): its canonical part. ``path``: the field of ``data``."""
        limits = self._admit(path, role)
        if not isinstance(data, str):
            raise ImageRefused(f"'{path}' must be a string (base64)", path)
        declared = media_type.lower() if isinstance(media_type, str) else None
        image = prompt_image(decode_base64(data, path, limits.max_bytes), path, declared)
        return self._keep(image).part(detail)

    def url(self, url: Any, path: str, role: str, *, detail: str | None = None) -> dict[str, Any]:
        """An image sent as a URL (``data:`` or remote): its canonical part (a remote one is
        filled once the adapter fetched it). Raises ImageRefused for a scheme not in
        ``image_url_schemes``, or a remote URL while ``image_fetch_remote`` is off."""
        limits = self._admit(path, role)
        if not isinstance(url, str) or not url:
            raise ImageRefused(f"'{path}' must be a non-empty string (a URL)", path)
        scheme = url_scheme(url)
        if scheme not in ("data", "http", "https"):
            raise ImageRefused(f"'{path}': {scheme or 'this'} URLs cannot carry images", path)
        if scheme not in limits.url_schemes:
            allowed = ", ".join(sorted(limits.url_schemes)) or "none"
            raise ImageRefused(
                f"'{path}': {scheme} URLs are not allowed (image_url_schemes: {allowed})", path
            )
        if scheme == "data":
            data, declared = parse_data_url(url, path, limits.max_bytes)
            return self._keep(prompt_image(data, path, declared)).part(detail)
        if not limits.fetch_remote:
            raise ImageRefused(
                f"'{path}': the proxy does not fetch remote images (image_fetch_remote is "
                "off); send the image as base64 data",
                path,
            )
        part: dict[str, Any] = {"type": "image", "url": url}
        if detail is not None:
            part["detail"] = detail
        self.pending.append(PendingImage(url, part, path))
        return part

    def result(self) -> RequestImages | None:
        """The request's images, or None when it has none."""
        if not self.paths:
            return None
        return RequestImages(dict(self.images), tuple(self.pending), tuple(self.paths))


def joined_content(parts: Sequence[str | dict[str, Any]]) -> Any:
    """Texts and canonical image parts as a message's content: without images, the texts
    joined with ``"\\n"`` (a string, as text-only content always was); with images, a list
    of parts in order, each run of texts one ``{"type": "text", "text"}`` part joined with
    ``"\\n"``."""
    if all(isinstance(p, str) for p in parts):
        return "\n".join(p for p in parts if isinstance(p, str))
    out: list[Any] = []
    run: list[str] = []
    for part in parts:
        if isinstance(part, str):
            run.append(part)
            continue
        if run:
            out.append({"type": "text", "text": "\n".join(run)})
            run = []
        out.append(part)
    if run:
        out.append({"type": "text", "text": "\n".join(run)})
    return out


def detail_of(value: Any, path: str) -> str | None:
    """A ``detail`` field: None, or one of ``auto``, ``low``, ``high``."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in DETAILS:
        raise ImageRefused(f"'{path}' must be 'auto', 'low' or 'high'", path)
    return value


def is_image_part(part: Any) -> bool:
    """A canonical image part."""
    return isinstance(part, Mapping) and part.get("type") == "image"


def image_parts(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The canonical image parts of one message, in order (none for string content)."""
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [p for p in content if is_image_part(p)]


def image_shas(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ``sha256`` of every canonical image part of ``messages``, in prompt order."""
    return [str(p.get("sha256")) for m in messages for p in image_parts(m)]


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(image_parts(m) for m in messages)


def _engine_part(part: Mapping[str, Any], images: Mapping[str, PromptImage]) -> dict[str, Any]:
    image = images.get(str(part.get("sha256")))
    if image is None:
        raise KeyError(f"image {part.get('sha256')} is not among the call's images")
    url: dict[str, Any] = {"url": image.data_url()}
    if part.get("detail") is not None:
        url["detail"] = part["detail"]
    return {"type": "image_url", "image_url": url}


def engine_messages(
    messages: Sequence[Mapping[str, Any]], images: Mapping[str, PromptImage]
) -> list[Any]:
    """The messages as the engine's chat endpoint takes them (vLLM 0.32: an image as an
    ``image_url`` part with a ``data:`` URL): messages with image parts are copied with those
    parts replaced, the others passed as they are. Raises KeyError for a part whose bytes
    ``images`` lacks."""
    out: list[Any] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            parts = [_engine_part(p, images) if is_image_part(p) else p for p in content]
            out.append({**message, "content": parts})
        else:
            out.append(message)
    return out
