"""The Messages front's conversion of a repeated history (``MessagesMemo``): a Claude Code-like
session read by ``known_bodies``, each request parsed with the earlier one's memo and without
any. The canonical request, the options (tool errors, reasoning hints) and the images are the
same both ways; the messages a request repeats are converted once (the same objects after)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from capture_proxy.core import chunk_scan
from capture_proxy.core.fronts.base import FrontRequest, seal_reasoning
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.fronts.messages.blocks import MessagesMemo
from capture_proxy.core.known_bodies import KnownBodies
from tests.core.fronts.memo_sessions import LIMITS, PNG

CODEC = MessagesCodec()


def _turn(i: int) -> list[dict[str, Any]]:
    """One agent step: the model's tool call (with reasoning sealed by an earlier call), and
    the result (an error every third step, an image every fourth)."""
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": f"toolu_{i}"}
    result["content"] = [{"type": "text", "text": f"file {i}:\n" + "line\n" * 20}]
    if i % 4 == 3:
        result["content"].append({"type": "image", "source": {"type": "base64",
                                  "media_type": "image/png", "data": PNG}})  # fmt: skip
    if i % 3 == 2:
        result["is_error"] = True
    thinking = seal_reasoning("call-" + "e" * 32, f"I read file {i}.")
    return [
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": thinking},
                {"type": "text", "text": f"Reading {i}."},
                {"type": "tool_use", "id": f"toolu_{i}", "name": "Read", "input": {"i": i}},
            ],
        },
        {"role": "user", "content": [result]},
    ]


def _session(calls: int) -> list[bytes]:
    """Claude Code's key order: the history first, then ``system``, ``tools``, ..."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read the files. ✓"}]
    tools = [{"name": "Read", "description": "Read a file.", "input_schema": {"type": "object"}}]
    out = []
    for i in range(calls):
        body = {"model": "m", "messages": messages, "system": "You are Claude Code.",
                "tools": tools, "max_tokens": 64, "stream": False}  # fmt: skip
        out.append(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())
        messages = [*messages, *_turn(i)]
    return out


def _seen(request: FrontRequest) -> tuple[Any, ...]:
    images = request.images
    return (
        json.dumps(request.chat, sort_keys=False),
        request.options,
        sorted(images.images) if images is not None else None,
        [p.path for p in images.pending] if images is not None else None,
    )


@pytest.mark.skipif(chunk_scan.SCAN_HISTORY is None, reason="the compiled scan is not built")
def test_a_session_converts_each_message_once() -> None:
    bodies = KnownBodies()
    earlier: FrontRequest | None = None
    earlier_memo: MessagesMemo | None = None
    for n, raw in enumerate(_session(9)):
        read = bodies.parse(raw, "rollout-1", "messages")
        with_memo = CODEC.parse(read.body, images=LIMITS, history=read)
        alone = CODEC.parse(json.loads(raw), images=LIMITS)
        assert _seen(with_memo) == _seen(alone)
        memo = read.kept.front_memo if read.kept is not None else None
        assert isinstance(memo, MessagesMemo)
        if earlier is not None and earlier_memo is not None and n >= 2:
            # what it repeats (all but its last turn) is the earlier conversion itself,
            # but the messages holding images, which are converted again
            before, now = earlier.chat["messages"], with_memo.chat["messages"]
            assert now[0] is before[0]  # (the system message)
            repeated = read.repeated
            assert repeated == len(json.loads(raw)["messages"]) - 2
            for i in range(repeated):
                kept = memo.outputs[i]
                has_image = "image" in json.dumps(read.body["messages"][i])
                assert (kept is None) == has_image
                if kept is not None:
                    assert kept is earlier_memo.outputs[i]
        earlier, earlier_memo = with_memo, memo
    # the options gathered from the kept conversions: tool errors of steps 2 and 5
    assert earlier is not None and earlier.options.tool_errors == ("toolu_2", "toolu_5")
    assert len(earlier.options.reasoning_hints) == 8
