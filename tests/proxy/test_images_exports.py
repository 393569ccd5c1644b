"""A session with images in every export: the npz archive (image refs and bytes), the Arrow
export (image columns the rows carry), ATIF (image content parts) and the viewer (the images
shown). The pixel input a trainer rebuilds from an export is the one from the stored bytes."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa

from capture_proxy import readers
from capture_proxy.core.export import MANIFEST_KEY
from capture_proxy.families.vision import rebuild_pixel_values
from tests.proxy.conftest import ON_BOTH_STORES, MakeStack
from tests.proxy.test_images import SETTINGS, A, B, chain_calls, run_session, sha


@ON_BOTH_STORES
async def test_the_npz_archive_holds_image_refs_and_each_image_once(make_stack: MakeStack):
    stack = await make_stack(**SETTINGS)
    await run_session(stack, "messages", "npz", stream=False)
    calls = await chain_calls(stack, "npz")
    leaf = calls[-1]
    resp = await stack.client.get("/captures/rollouts/npz/chains?format=npz")
    assert resp.status == 200
    chains = readers.load_chains(await resp.read())
    [sample] = list(chains)
    assert (
        sample.arrays["input_ids"].tolist()
        == leaf["prompt_token_ids"] + leaf["generation_token_ids"]
    )
    spans = [[e["prompt_start"], e["prompt_end"]] for e in leaf["images"]]
    assert sample.arrays["image_spans"].tolist() == spans
    assert sample.arrays["image_sha256"].tolist() == [sha(A), sha(B), sha(A)]
    assert sample.arrays["image_grid_thw"].tolist() == [
        e["processor"]["image_grid_thw"] for e in leaf["images"]
    ]
    assert list(sample.images) == leaf["images"]
    # the bytes once per archive, whatever number of places carry the image
    assert chains.images == {sha(A): A, sha(B): B}
    assert sorted(e["file"] for e in chains.manifest["images"].values()) == sorted(
        [f"images/{sha(A)}.png", f"images/{sha(B)}.png"]
    )
    for entry, (start, end) in zip(sample.images, spans, strict=True):
        pixels = rebuild_pixel_values(chains.images[entry["sha256"]], entry["processor"], "pil")
        t, h, w = entry["processor"]["image_grid_thw"]
        assert pixels.shape == (t * h * w, 3 * 2 * 16 * 16)
        assert pixels.shape[0] == (end - start) * 4  # merge_size 2: 4 patches per token
        assert set(sample.arrays["input_ids"][start:end].tolist()) == {151655}


async def test_the_arrow_export_rows_carry_their_images(make_stack: MakeStack):
    stack = await make_stack(**SETTINGS)
    await run_session(stack, "chat_completions", "arrow", stream=True)
    assert (await stack.client.post("/captures/rollouts/arrow/freeze")).status == 200
    resp = await stack.client.get("/captures/export")
    reader = pa.ipc.open_stream(io.BytesIO(await resp.read()))
    item = reader.read_next_batch_with_custom_metadata()
    manifest = json.loads(item.custom_metadata[MANIFEST_KEY.encode()])
    [row] = readers.ExportedRollout(manifest, item.batch).samples()
    npz = readers.load_chains(
        await (await stack.client.get("/captures/rollouts/arrow/chains?format=npz")).read()
    )
    [sample] = list(npz)
    assert row["input_ids"].tobytes() == sample.arrays["input_ids"].tobytes()
    assert row["image_sha256"] == [sha(A), sha(B), sha(A)]
    assert np.array_equal(row["image_spans"], sample.arrays["image_spans"])
    assert row["image_data"] == [A, B, A]
    assert row["image_media_type"] == ["image/png"] * 3
    processors = [json.loads(p) for p in row["image_processor"]]
    assert processors == [e["processor"] for e in sample.images]
    schema = item.batch.schema
    assert schema.field("image_data").type == pa.list_(pa.binary())


async def test_atif_and_the_viewer_show_the_images(make_stack: MakeStack):
    stack = await make_stack(**SETTINGS)
    await run_session(stack, "responses", "atif", stream=False)
    atif = await stack.get_json("/captures/rollouts/atif/atif")
    assert atif["schema_version"] == "ATIF-v1.6"
    user = atif["steps"][1]  # (after the instructions)
    assert user["source"] == "user"
    assert user["message"][1] == {
        "type": "image",
        "source": {"media_type": "image/png", "path": f"/captures/images/{sha(A)}"},
    }
    results = [r for s in atif["steps"] for r in (s.get("observation") or {}).get("results", [])]
    images = [
        p["source"]["path"]
        for r in results
        if isinstance(r["content"], list)
        for p in r["content"]
        if p["type"] == "image"
    ]
    assert images == [f"/captures/images/{sha(B)}", f"/captures/images/{sha(A)}"]
    last = [s for s in atif["steps"] if s.get("metrics")][-1]
    assert [e["sha256"] for e in last["metrics"]["extra"]["images"]] == [sha(A), sha(B), sha(A)]
    calls = await chain_calls(stack, "atif")
    page = await stack.client.get(f"/captures/ui/calls/{calls[-1]['call_id']}")
    html = await page.text()
    assert page.status == 200 and html.count(f'src="/captures/ui/images/{sha(A)}"') == 2
    shown = await stack.client.get(f"/captures/ui/images/{sha(B)}")
    assert shown.status == 200 and await shown.read() == B
