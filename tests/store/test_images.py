"""Images in the store (both stores): kept once per content, served by their SHA-256, carried
by the calls that name them, deleted with the last rollout that carries them."""

from __future__ import annotations

import hashlib

import pytest

from capture_proxy.core.images import PromptImage
from tests.factories import record
from tests.store.conftest import rows


def _image(data: bytes, width: int = 4, height: int = 3) -> PromptImage:
    return PromptImage(hashlib.sha256(data).hexdigest(), "image/png", width, height, data)


def _with_images(call_id: str, rollout: str, *images: PromptImage) -> object:
    rec = record(call_id, [1, 2, 3], [4, 5], rollout_id=rollout)
    entries = [
        {
            "sha256": i.sha256,
            "media_type": i.media_type,
            "width": i.width,
            "height": i.height,
            "prompt_start": None,
            "prompt_end": None,
            "processor": None,
        }
        for i in images
    ]
    return rec.replace(images=entries, image_data={i.sha256: i.data for i in images})


A = _image(b"\x89PNG first image bytes")
B = _image(b"\x89PNG second image bytes", 7, 5)


async def test_each_image_is_stored_once_however_many_calls_carry_it(store) -> None:
    await store.put_call(_with_images("c1", "r1", A))
    await store.put_call(_with_images("c2", "r1", A, B, A))
    await store.put_call(_with_images("c3", "r2", B))
    assert sorted(rows(store, "SELECT sha256, length(data) FROM images")) == sorted(
        [(bytes.fromhex(A.sha256), len(A.data)), (bytes.fromhex(B.sha256), len(B.data))]
    )
    assert len(rows(store, "SELECT * FROM call_images")) == 4
    found = await store.get_images([A.sha256, B.sha256, "0" * 64])
    assert found == {A.sha256: A, B.sha256: B}
    read = await store.get_call("c2")
    assert [e["sha256"] for e in read.images] == [A.sha256, B.sha256, A.sha256]
    assert read.image_data is None  # the bytes are the store's, read by sha256


async def test_a_deleted_rollout_takes_the_images_no_other_call_carries(store) -> None:
    await store.put_call(_with_images("c1", "r1", A, B))
    await store.put_call(_with_images("c2", "r2", B))
    await store.delete_rollout("r1")
    assert await store.get_images([A.sha256, B.sha256]) == {B.sha256: B}
    await store.delete_rollout("r2")
    assert rows(store, "SELECT count(*) FROM images") == [(0,)]
    assert rows(store, "SELECT count(*) FROM call_images") == [(0,)]


@pytest.mark.parametrize("store_kind", ["sqlite"])
async def test_a_record_naming_bytes_the_store_lacks_is_refused(store) -> None:
    rec = _with_images("c1", "r1", A).replace(image_data={})
    with pytest.raises(ValueError, match="whose bytes are unknown"):
        await store.put_call(rec)
    await store.put_call(_with_images("c2", "r1", A))
    await store.put_call(rec)  # held now: the call may name it without its bytes
    assert rows(store, "SELECT count(*) FROM images") == [(1,)]
