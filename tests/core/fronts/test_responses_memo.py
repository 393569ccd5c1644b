"""The Responses front's conversion of a repeated input (``ResponsesMemo``): a Codex-like
session read by ``known_bodies``, each request parsed with the earlier one's memo and without
any. The canonical request and the images are the same both ways; the input a request repeats
is converted once, up to the last point where no assistant turn was open (a function call joins
the turn before it)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from capture_proxy.core import chunk_scan
from capture_proxy.core.fronts.base import FrontRequest
from capture_proxy.core.fronts.responses import ResponsesCodec
from capture_proxy.core.fronts.responses.items import ResponsesMemo
from capture_proxy.core.known_bodies import KnownBodies
from tests.core.fronts.memo_sessions import LIMITS, PNG

CODEC = ResponsesCodec()


def _turn(i: int) -> list[dict[str, Any]]:
    """One agent step as Codex sends it: reasoning, a message, a function call, its output."""
    return [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": f"Step {i}."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": f"Running {i}."}]},
        {"type": "function_call", "call_id": f"call_{i}", "name": "shell",
         "arguments": json.dumps({"command": ["ls", str(i)]})},
        {"type": "function_call_output", "call_id": f"call_{i}", "output": f"out {i}\n" * 8},
    ]  # fmt: skip


def _session(calls: int, instructions: bool, image_at: int | None) -> list[bytes]:
    """Codex's key order (``input`` after ``model`` and ``stream``, ``tools`` after it)."""
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are Codex. ✓"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "List the files."}]},
    ]  # fmt: skip
    out = []
    for i in range(calls):
        body: dict[str, Any] = {"model": "m", "stream": False, "input": items}
        if instructions:
            body["instructions"] = "Be brief."
        body["tools"] = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]
        out.append(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())
        items = [*items, *_turn(i)]
        if image_at == i:
            image = {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}
            items.append({"type": "message", "role": "user", "content": [image]})
    return out


def _seen(request: FrontRequest) -> tuple[Any, ...]:
    images = request.images
    return (
        json.dumps(request.chat),
        request.options,
        sorted(images.images) if images is not None else None,
    )


@pytest.mark.skipif(chunk_scan.SCAN_HISTORY is None, reason="the compiled scan is not built")
@pytest.mark.parametrize("instructions", [False, True])
@pytest.mark.parametrize("image_at", [None, 3])
def test_a_session_converts_its_input_once(instructions: bool, image_at: int | None) -> None:
    bodies = KnownBodies()
    earlier: FrontRequest | None = None
    for n, raw in enumerate(_session(8, instructions, image_at)):
        read = bodies.parse(raw, "rollout-1", "input")
        with_memo = CODEC.parse(read.body, images=LIMITS, history=read)
        alone = CODEC.parse(json.loads(raw), images=LIMITS)
        assert _seen(with_memo) == _seen(alone)
        memo = read.kept.front_memo if read.kept is not None else None
        assert isinstance(memo, ResponsesMemo)
        if earlier is not None and n >= 2:
            before, now = earlier.chat["messages"], with_memo.chat["messages"]
            # the messages up to the earlier request's last checkpoint are its very objects;
            # none is kept after an image (the call's image collector must see it)
            with_image = [k for k, m in enumerate(before) if "image" in json.dumps(m["content"])]
            resumed = with_image[0] if with_image else len(before)
            assert all(a is b for a, b in zip(now[:resumed], before[:resumed], strict=True))
            assert not any(a is b for a, b in zip(now[resumed:], before[resumed:], strict=False))
        earlier = with_memo
