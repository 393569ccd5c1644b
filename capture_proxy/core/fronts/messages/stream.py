"""Streaming a Messages answer: chat deltas in, Anthropic's SSE events out.

Owns the blocks of one streamed answer and their events. Text and thinking are forwarded as
they arrive; the thinking block's ``signature_delta`` is sent when the block closes (it seals
the block's text). The ``tool_use`` blocks are sent whole by ``finish``, from the answer
(``encode``'s blocks): the engine's tool-call fragments are not forwarded. A tool call's input
is held until its block closes in any case (Anthropic's default tool streaming also buffers to
validate the JSON), and Anthropic's blocks come one after another, so a block opened while
the engine still sends text, reasoning or another call's fragments would either cut that
text off from the answer's one text block or miss the fragments that come after it. So the
tool uses the harness receives are the stored answer's, whatever order the engine's deltas
came in, and the text never waits for them. Pure; the blocks themselves are ``encode``'s.
"""

from __future__ import annotations

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
    message_id,
    message_usage,
    options_of,
    stop_reason,
    stop_sequence,
    tool_input_json,
    tool_use_block,
)


def _event(data: dict[str, Any]) -> bytes:
    return sse_event(data, data["type"])


class _Block:
    """The open content block of a stream."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind  # "thinking" | "text" | "tool_use"
        self.index = index
        self.text: list[str] = []  # a thinking block's text (its signature seals it)


class MessagesStreamEncoder(PartsStreamEncoder):
    """Chat deltas in, Messages SSE events out: ``message_start`` and ``ping``; per block
    ``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` (a thinking or
    text block closes when a delta of the other kind starts); the ``tool_use`` blocks (from
    the answer), ``message_delta`` and ``message_stop`` in ``finish``.

    When the engine's deltas come in the answer's order (reasoning, text, tool calls) the
    blocks equal ``encode``'s. When they interleave reasoning and text (harmony: analysis, a
    commentary preamble, analysis again), each change of kind opens a new block: the answer's
    reasoning (text) is its thinking (text) blocks' texts joined in order, which is how
    ``parse`` reads several blocks of a kind back (Anthropic's text blocks are one text, as
    its SDKs' ``get_final_text`` joins them), so the turn still digests as the answer."""

    def __init__(self, request: FrontRequest, head: Answer) -> None:
        self.request = request
        self.call_id = head.call_id
        self.model = answer_model(request, head)
        self.omit = options_of(request).omit_thinking
        #: ``message_start``'s usage: the prompt's tokens (known when the proxy built the prompt,
        #: exact-token mode; in backend-template mode this is written before the engine's first
        #: chunk, so 0 and ``message_delta`` says it), none generated yet
        self.start_usage = {**message_usage(head), "output_tokens": 0}
        if not head.usage and head.prompt_token_ids is not None:
            self.start_usage["input_tokens"] = len(head.prompt_token_ids)
        self.block: _Block | None = None
        self.next_index = 0

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
        return _event(
            {"type": "content_block_start", "index": block.index, "content_block": content_block}
        )

    def _delta(self, block: _Block, delta: dict[str, Any]) -> bytes:
        return _event({"type": "content_block_delta", "index": block.index, "delta": delta})

    def _close(self) -> list[bytes]:
        block = self.block
        if block is None:
            return []
        self.block = None
        out: list[bytes] = []
        if block.kind == "thinking":
            signature = seal_reasoning(self.call_id, "".join(block.text))
            out.append(self._delta(block, {"type": "signature_delta", "signature": signature}))
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
        """Nothing: the tool uses are sent whole by ``finish`` (the module docstring)."""
        return []

    def _whole_block(self, content_block: dict[str, Any]) -> list[bytes]:
        """A thinking or text block the deltas never carried, from the whole answer."""
        kind = content_block["type"]
        block = self._open(kind)
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
        else:
            out.append(self._start(block, {"type": "text", "text": ""}))
            out.append(self._delta(block, {"type": "text_delta", "text": content_block["text"]}))
        return out + self._close()

    def _tool_use(self, position: int, call: Mapping[str, Any]) -> list[bytes]:
        """The ``position``-th tool call of the answer as a whole ``tool_use`` block: its
        input in one ``input_json_delta``, the arguments as the engine gave them when they
        are a JSON object (``tool_input_json``)."""
        whole = tool_use_block(self.call_id, position, call)
        block = _Block("tool_use", self.next_index)  # never the open block: sent whole
        self.next_index += 1
        arguments = (call.get("function") or {}).get("arguments")
        partial = tool_input_json(arguments)
        return [
            self._start(block, {**whole, "input": {}}),
            self._delta(block, {"type": "input_json_delta", "partial_json": partial}),
            _event({"type": "content_block_stop", "index": block.index}),
        ]

    def finish(self, answer: Answer) -> list[bytes]:
        """Closes the open block; sends the answer's thinking and text whole when no delta
        carried anything (an answer made whole at the end), then its tool uses."""
        out = self._close()
        message = answer.message
        if self.next_index == 0:
            for content_block in content_blocks(self.call_id, message, self.omit):
                if content_block["type"] != "tool_use":
                    out += self._whole_block(content_block)
        for position, call in enumerate(message.get("tool_calls") or []):
            out += self._tool_use(position, call)
        usage: dict[str, int] = {"output_tokens": message_usage(answer)["output_tokens"]}
        if answer.usage:
            usage = {"input_tokens": message_usage(answer)["input_tokens"], **usage}
        out.append(
            _event(
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": stop_reason(self.request, answer),
                        "stop_sequence": stop_sequence(self.request, answer),
                    },
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
