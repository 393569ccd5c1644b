"""Tier 3: the real Claude Code (2.1.328) reads a PNG with its ``Read`` tool through the proxy.

The scripted policy (``capture_proxy/policies/claude_code_image.json``) asks to ``Read
screenshot.png``; Claude Code opens the file and sends the image back as an ``image`` block in
the ``tool_result`` of the next request; the policy answers. Both calls are captured as one
chain, in both prompt modes: the second call's record holds the image (its bytes stored once,
content-addressed), its span of ``<|image_pad|>`` tokens in the prompt the engine saw (the
scripted engine expands it as vLLM's Qwen3-VL processor does) and the processor params.
Exact-token mode sends the engine token ids and the image over SGLang's ``/generate``
(``image_data``), which the scripted engine speaks.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from capture_proxy.core.image_spans import image_runs
from capture_proxy.families.vision import QWEN3_VL_PROCESSOR, image_placeholder
from capture_proxy.harnesses.claude_code import API_KEY, MODEL_ID, find_claude, run_claude
from capture_proxy.scripted_engine.policy import Policy
from tests.e2e.harness_stack import POLICIES, PROMPT_MODES, extends, harness_stack, run_harness

CLAUDE = find_claude()

pytestmark = [
    pytest.mark.claude_code,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        CLAUDE is None, reason="Claude Code not installed (run scripts/install-harnesses)"
    ),
]

POLICY_PATH = POLICIES / "claude_code_image.json"
ROLLOUT = "e2e-claude-code-image"
TASK = "Read screenshot.png and tell me what it shows."
RUN_TIMEOUT_S = 90


def _png(height: int, width: int) -> bytes:
    rng = np.random.default_rng(7)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _settings(prompt_mode: str) -> dict[str, Any]:
    settings: dict[str, Any] = {"image_processors": {MODEL_ID: "qwen3_vl"}}
    if prompt_mode == "exact_tokens":
        # /v1/completions takes no image: SGLang's /generate (image_data) does
        settings["tokens_in_dialect"] = "sglang_generate"
    return settings


@pytest.mark.parametrize("prompt_mode", PROMPT_MODES)
async def test_claude_code_reading_a_png_is_one_chain(
    qwen_tokenizer, tmp_path: Path, prompt_mode: str
):
    assert CLAUDE is not None
    policy = Policy.load(POLICY_PATH)
    project = (tmp_path / "project").resolve()
    project.mkdir()
    png = _png(120, 160)
    (project / "screenshot.png").write_bytes(png)
    async with harness_stack(
        qwen_tokenizer,
        tmp_path,
        policy=policy,
        prompt_mode=prompt_mode,
        proxy_token=API_KEY,
        settings=_settings(prompt_mode),
    ) as stack:
        t0 = time.monotonic()
        result = await run_harness(
            run_claude,
            CLAUDE,
            stack.capture_root(ROLLOUT),
            project,
            TASK,
            timeout_s=RUN_TIMEOUT_S,
            home_dir=tmp_path / "home",
        )
        assert result.ok, result.describe()
        assert policy.steps[-1].content in result.stdout, result.describe()

        body = await stack.get(f"/captures/rollouts/{ROLLOUT}/chains")
        assert body["unlinked_calls"] == [] and body["incomplete"] is False, body
        (chain,) = body["chains"]
        read, answer = chain["calls"]
        assert answer["parent_call_id"] == read["call_id"]
        assert answer["linking"]["verdict"] == "resolved", answer["linking"]
        assert extends(answer, read)
        assert read["images"] is None
        (image,) = answer["images"]
        # the image as Claude Code sent it, stored once, served by its address
        async with stack.session.get(f"{stack.root}/captures/images/{image['sha256']}") as resp:
            assert resp.status == 200, await resp.text()
            stored = await resp.read()
        with Image.open(io.BytesIO(stored)) as sent:
            size = sent.size
            pixels = np.asarray(sent.convert("RGB"))
        with Image.open(io.BytesIO(png)) as original:
            same_pixels = size == original.size and np.array_equal(
                pixels, np.asarray(original.convert("RGB"))
            )
        assert (image["width"], image["height"]) == size
        placeholder = image_placeholder(size[1], size[0], QWEN3_VL_PROCESSOR)
        assert image["processor"] == placeholder.processor_params()
        # its span: the <|image_pad|> run of the prompt the engine saw
        sent_prompt = stack.sent[1].prompt_token_ids
        assert answer["prompt_token_ids"] == sent_prompt
        assert [(image["prompt_start"], image["prompt_end"])] == image_runs(np.asarray(sent_prompt))
        assert image["prompt_end"] - image["prompt_start"] == placeholder.num_tokens
        detail = await stack.get(f"/captures/calls/{answer['call_id']}")
        tool = next(m for m in detail["request_messages"] if m["role"] == "tool")
        assert any(p.get("sha256") == image["sha256"] for p in tool["content"])
        print(
            f"\nclaude code image e2e [{prompt_mode}]: {time.monotonic() - t0:.1f}s; "
            f"image {size[0]}x{size[1]} ({len(stored)} bytes, same pixels as the file: "
            f"{same_pixels}, same bytes: {stored == png}), "
            f"span {image['prompt_start']}-{image['prompt_end']}"
        )
