"""The read API's images: ``GET /captures/images/<sha256>``, one stored image's bytes.

Owns the route that serves an image a call's record names (``CallRecord.images[i].sha256``,
the hex SHA-256 of the bytes; each image is stored once per store, whatever number of calls
carry it) with its media type. Guarded like the rest of ``/captures`` (``captures_token``).
Must not decide anything about images (``core.images``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from aiohttp import web

from capture_proxy.core.images import PromptImage
from capture_proxy.core.records import CallRecord
from capture_proxy.proxy.errors import BadRequest, NotFound
from capture_proxy.proxy.keys import STORE_KEY
from capture_proxy.rest.query import takes
from capture_proxy.store.base import CaptureStore

_SHA256 = re.compile(r"[0-9a-f]{64}")


async def get_image(request: web.Request) -> web.Response:
    """The image's bytes (``Content-Type``: its media type; cached forever: the address is
    the content). 400 for an address that is not 64 lower-case hex digits, 404 for one the
    store does not hold."""
    sha = request.match_info["sha256"]
    if not _SHA256.fullmatch(sha):
        raise BadRequest(
            "an image's address is the SHA-256 of its bytes: 64 lower-case hex digits",
            param="sha256",
            code="invalid_image_address",
        )
    found = await request.app[STORE_KEY].get_images([sha])
    image = found.get(sha)
    if image is None:
        raise NotFound(f"image {sha} not found", param="sha256", code="not_found")
    return web.Response(
        body=image.data,
        content_type=image.media_type,
        headers={"Cache-Control": "private, max-age=31536000, immutable"},
    )


async def images_of(store: CaptureStore, records: Iterable[CallRecord]) -> dict[str, PromptImage]:
    """The stored images the records carry, by sha256 (for an export that holds their
    bytes)."""
    shas = sorted({str(e["sha256"]) for r in records for e in r.images or []})
    return await store.get_images(shas) if shas else {}


def add_routes(app: web.Application) -> None:
    app.router.add_get("/captures/images/{sha256}", takes()(get_image))
