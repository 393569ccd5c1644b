"""Tier 4, images: the proxy in front of the real vLLM 0.32 (CPU) serving a tiny random-weight
Qwen3-VL (``scripts/e2e-vllm-vl``), in both prompt modes, through all three APIs.

vLLM is the oracle: its ``/v1/chat/completions/render`` renders a conversation with the model's
template (the published Qwen3-VL one), expands each image with its processor and answers the
ids, each image's placeholder range (``mm_placeholders``) and the pixel input it built. Checked:
each call's prompt ids against vLLM's render of the same request (every call in backend-template
mode; in exact-token mode every call whose history is canonical, the forced chat session, and
each root), its images' spans against vLLM's placeholder ranges, the chain, each image's bytes
once in the store, the npz export, and the pixel input rebuilt from the stored bytes and the
record's processor params against vLLM's own (``vllm_pixels.py``, run by the VL venv).
Skipped unless the served model is ``qwen3-vl-tiny``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from capture_proxy import readers
from capture_proxy.core.image_spans import image_runs
from capture_proxy.core.images import engine_messages, prompt_image
from capture_proxy.families.vision import rebuild_pixel_values
from capture_proxy.store.sqlite import DB_FILE_NAME
from tests.proxy.test_images import A, B, data_url, png, sha
from tests.realengine.conftest import VLLM_MODEL, RealStack, _stack
from tests.realengine.test_vllm import SYSTEM, TOOL_CALL_TEXT, TOOLS, _as_harness

VL_MODEL = "qwen3-vl-tiny"
MODEL_DIR = os.environ.get("CAPTURE_PROXY_VLLM_MODEL_DIR", "")
#: the VL venv's Python (vLLM, torch, torchvision), for vLLM's pixel tensors
VL_PYTHON = os.environ.get("E2E_VLLM_PYTHON", "")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.realengine,
    pytest.mark.timeout(600),
    pytest.mark.skipif(VLLM_MODEL != VL_MODEL, reason=f"the served model is not {VL_MODEL}"),
]
C = png(48, 80, 3)  # a third size


def _settings(exact: bool) -> dict[str, Any]:
    settings: dict[str, Any] = {"image_processors": {VL_MODEL: MODEL_DIR}}
    if exact:
        settings.update(
            prompt_mode="exact_tokens",
            tokens_in_dialect="vllm_generate",
            tokenizer=Path(MODEL_DIR),
            model_families={VL_MODEL: "qwen3_vl"},
        )
    return settings


@pytest.fixture(params=["backend_template", "exact_tokens"])
async def vl(request, aiohttp_client, tmp_path):
    async for stack in _stack(
        aiohttp_client, tmp_path, **_settings(request.param == "exact_tokens")
    ):
        stack.store_dir = tmp_path / "store"  # type: ignore[attr-defined]
        stack.exact = request.param == "exact_tokens"  # type: ignore[attr-defined]
        yield stack


def render(real: RealStack, messages: list[Any], tools: Any = None) -> dict[str, Any]:
    """vLLM's render of a chat request (engine form: images as data: URLs)."""
    body: dict[str, Any] = {"model": real.model, "messages": messages}
    if tools:
        body["tools"] = tools
    resp = real.engine.post("/v1/chat/completions/render", json=body)
    resp.raise_for_status()
    return dict(resp.json())


def engine_form(record: dict[str, Any]) -> list[Any]:
    """A record's canonical messages as vLLM's chat endpoint takes them."""
    shas = {e["sha256"] for e in record["images"] or []}
    images = {s: prompt_image({sha(A): A, sha(B): B, sha(C): C}[s], "x") for s in shas}
    return engine_messages(record["request_messages"], images)


def check_images(
    record: dict[str, Any], rendered: dict[str, Any], expected: list[bytes], *, at: bool = True
) -> None:
    """The record's images: prompt order, bytes' addresses, spans = vLLM's ranges (``at``:
    where vLLM's render puts them too, i.e. the prompt is vLLM's render; else their lengths,
    at the prompt's own image runs)."""
    assert [e["sha256"] for e in record["images"]] == [sha(d) for d in expected]
    ranges = rendered["features"]["mm_placeholders"]["image"]
    spans = [(e["prompt_start"], e["prompt_end"]) for e in record["images"]]
    if at:
        assert spans == [(r["offset"], r["offset"] + r["length"]) for r in ranges]
    else:
        assert [end - start for start, end in spans] == [r["length"] for r in ranges]
        assert spans == image_runs(np.asarray(record["prompt_token_ids"]))


def engine_pixels(rendered: dict[str, Any], record: dict[str, Any]) -> dict[str, np.ndarray]:
    """vLLM's pixel input for the rendered images and the rebuilt one (``vllm_pixels.py``)."""
    by_sha = {sha(d): d for d in (A, B, C)}
    images = [
        [base64.b64encode(by_sha[e["sha256"]]).decode(), e["processor"]] for e in record["images"]
    ]
    request = {"kwargs_data": rendered["features"]["kwargs_data"]["image"], "images": images}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [VL_PYTHON, str(Path(__file__).with_name("vllm_pixels.py"))],
        input=json.dumps(request).encode(),
        capture_output=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return dict(np.load(io.BytesIO(done.stdout)))


async def test_a_chat_session_with_images_is_one_exact_chain(vl) -> None:
    """Forced tool calls (canonical tokens): task + image A; a tool result with image B; one
    with image A again; an answer. One chain; every prompt is vLLM's render of its request."""
    rollout = "vl-chat"
    messages: list[Any] = [
        SYSTEM,
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, _url(A)]},
    ]
    call_ids = []
    for text, image in ((TOOL_CALL_TEXT, B), (TOOL_CALL_TEXT, A), ("Done.", None)):
        _, forced = vl.forced(text)
        body = {"model": vl.model, "messages": messages, "tools": TOOLS, "max_tokens": 64}
        resp = await vl.chat(rollout, {**body, **forced})
        assert resp.status == 200, await resp.text()
        call_ids.append(resp.headers["X-Capture-Call-Id"])
        message = (await resp.json())["choices"][0]["message"]
        turn = _as_harness(message)
        if turn.get("tool_calls") and not turn["content"]:
            # As the OpenAI SDKs echo it. (With content "" vLLM hands the Qwen3-VL template a
            # one-part list, which is true: the template puts a "\n" before the first tool
            # call that the model did not write, and backend-template mode refuses the link,
            # template_rerendered; exact-token mode keeps the model's own tokens either way.)
            turn["content"] = None
        messages.append(turn)
        for tc in message.get("tool_calls") or []:
            parts = [{"type": "text", "text": "a picture:"}, _url(image)]
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": parts})
    chains = await vl.get_json(f"/captures/rollouts/{rollout}/chains")
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [call_ids]
    calls = chains["chains"][0]["calls"]
    assert [c["parent_call_id"] for c in calls] == [None, *call_ids[:2]]
    expected = [[A], [A, B], [A, B, A]]
    for call, images in zip(calls, expected, strict=True):
        record = await vl.get_json(f"/captures/calls/{call['call_id']}")
        assert record["status"] == "complete" and record["diagnostics"] == [], record
        rendered = render(vl, engine_form(record), TOOLS)
        assert record["prompt_token_ids"] == rendered["token_ids"]  # both modes
        check_images(record, rendered, images)
    # each image's bytes once in the store, however many calls carry it
    with sqlite3.connect(vl.store_dir / DB_FILE_NAME) as db:
        rows = db.execute("SELECT hex(sha256), length(data) FROM images").fetchall()
    assert sorted(rows) == sorted([(sha(A).upper(), len(A)), (sha(B).upper(), len(B))])
    # the npz sample rebuilds the engine's pixel input exactly
    npz = readers.load_chains(
        await (await vl.client.get(f"/captures/rollouts/{rollout}/chains?format=npz")).read()
    )
    (sample,) = list(npz)
    leaf = await vl.get_json(f"/captures/calls/{call_ids[-1]}")
    assert list(sample.images) == leaf["images"]
    assert npz.images == {sha(A): A, sha(B): B}
    if VL_PYTHON:
        pixels = engine_pixels(render(vl, engine_form(leaf), TOOLS), leaf)
        for i, entry in enumerate(sample.images):
            engine = pixels[f"engine_{i}"]
            assert pixels[f"grid_{i}"].tolist() == entry["processor"]["image_grid_thw"]
            assert np.abs(pixels[f"rebuilt_{i}"] - engine).max() < 1e-6
            pil = rebuild_pixel_values(npz.images[entry["sha256"]], entry["processor"], "pil")
            # Pillow's bicubic resize: at most two intensity levels off (2/255 of the range,
            # 4/255 after normalising with std 0.5)
            assert (
                np.abs(pil - engine).max() <= 2 / 255 / min(entry["processor"]["image_std"]) + 1e-6
            )
    _report(vl, rollout, calls, expected)


def _url(data: bytes | None) -> dict[str, Any]:
    assert data is not None
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def _report(vl: Any, rollout: str, calls: list[Any], expected: list[list[bytes]]) -> None:
    mode = "exact_tokens" if vl.exact else "backend_template"
    links = sum(1 for c in calls if c["parent_call_id"] is not None)
    print(
        f"\n[{mode}] {rollout}: calls={len(calls)} images={sum(map(len, expected))} "
        f"spans_checked={sum(map(len, expected))} links={links}",
        file=sys.stderr,
    )


def _anthropic(data: bytes) -> dict[str, Any]:
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_messages_and_responses_sessions_with_images(vl, api: str) -> None:
    """Free text (the random model's own tokens): a task with image A, then a user turn with
    image C, then one with image B. Every call's images against vLLM's ranges; the roots'
    prompts (and in backend-template mode every prompt) against vLLM's render; links only
    where the tokens extend."""
    rollout = f"vl-{api}"
    path = f"/ng-rollout/{rollout}/training-token-capture/v1/{api}"
    history: list[Any] = []
    call_ids = []
    for text, image in (("What is it?", A), ("And this?", C), ("Last one.", B)):
        if api == "messages":
            history.append(
                {"role": "user", "content": [{"type": "text", "text": text}, _anthropic(image)]}
            )
            body: dict[str, Any] = {"model": vl.model, "max_tokens": 6, "messages": history}
        else:
            content = [
                {"type": "input_text", "text": text},
                {"type": "input_image", "image_url": data_url(image)},
            ]
            history.append({"type": "message", "role": "user", "content": content})
            body = {"model": vl.model, "max_output_tokens": 6, "input": history}
        resp = await vl.client.post(path, json={**body, "temperature": 0})
        assert resp.status == 200, await resp.text()
        call_ids.append(resp.headers["X-Capture-Call-Id"])
        answer = await resp.json()
        if api == "messages":
            history.append({"role": "assistant", "content": answer["content"]})
        else:
            history += [{k: v for k, v in item.items() if k != "id"} for item in answer["output"]]
    expected = [[A], [A, C], [A, C, B]]
    calls = []
    for call_id, images in zip(call_ids, expected, strict=True):
        record = await vl.get_json(f"/captures/calls/{call_id}")
        # (free text: in backend-template mode the model's turn may render back otherwise,
        # a refused link; in exact-token mode the engine's echo matched the proxy's ids)
        kinds = {d["kind"] for d in record["diagnostics"]}
        assert record["status"] == "complete" and kinds <= {"parent_digest_mismatch"}, record
        assert not (vl.exact and kinds)
        rendered = render(vl, engine_form(record))
        # exact-token children hold the model's own tokens, which vLLM's render of the text
        # need not reproduce: their images are checked at their own runs
        is_render = not vl.exact or record["parent_call_id"] is None
        check_images(record, rendered, images, at=is_render)
        if is_render:
            assert record["prompt_token_ids"] == rendered["token_ids"]
        calls.append(record)
    by_id = {c["call_id"]: c for c in calls}
    for call in calls:
        parent = by_id.get(call["parent_call_id"] or "")
        if parent is not None:  # a link only where the tokens (and the images) extend
            head = parent["prompt_token_ids"] + parent["generation_token_ids"]
            assert call["prompt_token_ids"][: len(head)] == head
    if vl.exact:  # the model's own tokens: one chain whatever it wrote
        assert [c["parent_call_id"] for c in calls] == [None, *call_ids[:2]]
    _report(vl, rollout, calls, expected)
