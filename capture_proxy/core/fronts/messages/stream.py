"""Streaming a Messages answer: chat deltas in, Anthropic's SSE events out.

Owns the blocks of one streamed answer and their events. Each tool call's arguments are held
until its block closes and sent as one ``input_json_delta`` (Anthropic's default tool streaming
also buffers to validate the JSON), so that the streamed blocks always equal ``encode``'s and a
harness never receives JSON it cannot parse. Text and thinking are forwarded as they arrive;
the thinking block's ``signature_delta`` is sent when the block closes (it seals the whole
text). Pure; the blocks themselves are ``encode``'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from capture_proxy.core.fronts.base import (
    Answer,
    FrontRequest,
    PartsStreamEncoder,
    answer_model,
    open_reasoning,
    seal_reasoning,
    sse_event,
)
from capture_proxy.core.fronts.messages.encode import (
    anthropic_error_body,
    content_blocks,
    fallback_tool_use_id,
    message_id,
    message_usage,
    options_of,
    stop_reason,
    tool_input_json,
)


def _event(data: dict[str, Any]) -> bytes:
    return sse_event(data, data["type"])


class _Block:
    """The open content block of a stream."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind  # "thinking" | "text" | "tool"
        self.index = index
        self.started = False
        self.text: list[str] = []  # thinking text, or a tool call's arguments
        self.chat_index: int | None = None
        self.tool_id: str | None = None
        self.name: str | None = None


class MessagesStreamEncoder(PartsStreamEncoder):
    """Chat deltas in, Messages SSE events out: ``message_start`` and ``ping``; per block
    ``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` (a block closes
    when a delta of another kind, or of another tool call, starts); ``message_delta`` and
    ``message_stop`` in ``finish``. Tool-call fragments that arrive for a tool call whose block
    is closed are dropped (engines send each call's fragments together)."""

    def __init__(self, request: FrontRequest, head: Answer) -> None:
        self.call_id = head.call_id
        self.model = answer_model(request, head)
        self.omit = options_of(request).omit_thinking
        #: ``message_start``'s usage: the prompt's tokens, none generated yet
        self.start_usage = {**message_usage(head), "output_tokens": 0}
        self.block: _Block | None = None
        self.next_index = 0
        self.tool_positions = 0  # tool blocks opened so far
        self.closed_tools: set[int] = set()

    # -- events

    def start(self) -> list[bytes]:
        message = {
            "id": message_id(self.call_id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.start_usage,
        }
        return [_event({"type": "message_start", "message": message}), _event({"type": "ping"})]

    def _open(self, kind: str) -> _Block:
        block = _Block(kind, self.next_index)
        self.next_index += 1
        self.block = block
        return block

    def _start(self, block: _Block, content_block: dict[str, Any]) -> bytes:
        block.started = True
        return _event(
            {"type": "content_block_start", "index": block.index, "content_block": content_block}
        )

    def _delta(self, block: _Block, delta: dict[str, Any]) -> bytes:
        return _event({"type": "content_block_delta", "index": block.index, "delta": delta})

    def _start_tool(self, block: _Block) -> bytes:
        position = self.tool_positions
        self.tool_positions += 1
        tool_id = block.tool_id or fallback_tool_use_id(self.call_id, position)
        return self._start(
            block, {"type": "tool_use", "id": tool_id, "name": block.name or "", "input": {}}
        )

    def _close(self) -> list[bytes]:
        block = self.block
        if block is None:
            return []
        self.block = None
        out: list[bytes] = []
        if block.kind == "thinking":
            signature = seal_reasoning(self.call_id, "".join(block.text))
            out.append(self._delta(block, {"type": "signature_delta", "signature": signature}))
        elif block.kind == "tool":
            if block.chat_index is not None:
                self.closed_tools.add(block.chat_index)
            if not block.started:
                out.append(self._start_tool(block))
            partial = tool_input_json("".join(block.text))
            out.append(self._delta(block, {"type": "input_json_delta", "partial_json": partial}))
        out.append(_event({"type": "content_block_stop", "index": block.index}))
        return out

    def reasoning_part(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        block = self.block
        if block is None or block.kind != "thinking":
            out += self._close()
            block = self._open("thinking")
            out.append(self._start(block, {"type": "thinking", "thinking": "", "signature": ""}))
        block.text.append(text)
        if not self.omit:
            out.append(self._delta(block, {"type": "thinking_delta", "thinking": text}))
        return out

    def text_part(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        block = self.block
        if block is None or block.kind != "text":
            out += self._close()
            block = self._open("text")
            out.append(self._start(block, {"type": "text", "text": ""}))
        out.append(self._delta(block, {"type": "text_delta", "text": text}))
        return out

    def tool_call_part(self, fragment: Mapping[str, Any], position: int) -> list[bytes]:
        out: list[bytes] = []
        raw_index = fragment.get("index")
        chat_index = raw_index if isinstance(raw_index, int) else position
        block = self.block
        if block is None or block.kind != "tool" or block.chat_index != chat_index:
            if chat_index in self.closed_tools:
                return out
            out += self._close()
            block = self._open("tool")
            block.chat_index = chat_index
        fn = fragment.get("function") or {}
        if isinstance(fragment.get("id"), str) and fragment["id"] and block.tool_id is None:
            block.tool_id = fragment["id"]
        if isinstance(fn.get("name"), str) and fn["name"] and block.name is None:
            block.name = fn["name"]
        if isinstance(fn.get("arguments"), str):
            block.text.append(fn["arguments"])
        if not block.started and block.name is not None:
            out.append(self._start_tool(block))
        return out

    def _whole_block(self, content_block: dict[str, Any]) -> list[bytes]:
        """A block the deltas never carried, from the whole answer."""
        kind = content_block["type"]
        block = self._open("tool" if kind == "tool_use" else kind)
        out = []
        if kind == "thinking":
            text = open_reasoning(content_block["signature"])
            block.text.append(text[1] if text else "")
            out.append(self._start(block, {"type": "thinking", "thinking": "", "signature": ""}))
            if content_block["thinking"]:
                out.append(
                    self._delta(
                        block, {"type": "thinking_delta", "thinking": content_block["thinking"]}
                    )
                )
        elif kind == "text":
            out.append(self._start(block, {"type": "text", "text": ""}))
            out.append(self._delta(block, {"type": "text_delta", "text": content_block["text"]}))
        else:
            block.tool_id = content_block["id"]
            block.name = content_block["name"]
            block.text.append(json.dumps(content_block["input"], ensure_ascii=False))
        return out + self._close()

    def finish(self, answer: Answer) -> list[bytes]:
        """Closes the open block; blocks of the answer the deltas never carried (nothing was
        streamed at all, or tool calls known only at the end) are sent whole first."""
        out = self._close()
        blocks = content_blocks(self.call_id, answer.message, self.omit)
        if self.next_index == 0:
            missing = blocks
        else:
            tools = [b for b in blocks if b["type"] == "tool_use"]
            missing = tools[self.tool_positions :]
        for content_block in missing:
            out += self._whole_block(content_block)
        usage: dict[str, int] = {"output_tokens": message_usage(answer)["output_tokens"]}
        if answer.usage:
            usage = {"input_tokens": message_usage(answer)["input_tokens"], **usage}
        out.append(
            _event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(answer), "stop_sequence": None},
                    "usage": usage,
                }
            )
        )
        out.append(_event({"type": "message_stop"}))
        return out

    def error(self, message: str, *, code: str | None = None) -> bytes:
        """Anthropic's ``error`` event: ``api_error`` for the engine's failure; a proxy error
        a retry may cure (``code`` given) is ``overloaded_error``, the type of its 503."""
        error_type = "api_error" if code is None else "overloaded_error"
        return _event(anthropic_error_body(message, error_type))
