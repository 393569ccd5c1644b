"""Reading an answer as a harness of each API reads it: the canonical assistant message.

Owns the client side of the three wire APIs, for replays of recorded traffic (what did the
recorded server answer?) and for tests: a whole body or an SSE stream in, the canonical
assistant message out (``content``, ``reasoning_content``, ``tool_calls``). The model-side part
is read back through the front codec's own ``parse`` (the output items or content blocks as a
harness sends them back), so what a replay answers is exactly what a harness would continue
from. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from capture_proxy.core.assembly import CallContext, ChatCaptureAssembler
from capture_proxy.core.conversation import ChatMessage, open_dict
from capture_proxy.core.fronts.base import Api
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.fronts.responses import ResponsesCodec
from capture_proxy.core.sse import SSEStreamDecoder

#: Where each API's model calls go, after ``/v1``-less base URLs (harness base URLs end in
#: ``/v1``).
API_PATHS = {
    Api.CHAT_COMPLETIONS: "/v1/chat/completions",
    Api.RESPONSES: "/v1/responses",
    Api.MESSAGES: "/v1/messages",
}


def api_of_path(path: str) -> Api | None:
    """The API of a request path (query string allowed, capture prefix allowed)."""
    bare = path.split("?", 1)[0]
    for api, suffix in API_PATHS.items():
        if bare.endswith(suffix):
            return api
    return None


def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """``(event name, parsed data)`` of each SSE block; ``[DONE]`` is kept as the string."""
    decoder = SSEStreamDecoder()
    out: list[tuple[str | None, Any]] = []
    for event in [*decoder.feed(raw), *decoder.close()]:
        data: Any = event.data if event.data == "[DONE]" else json.loads(event.data)
        out.append((event.event or None, data))
    return out


def _chat_message(events: Iterable[tuple[str | None, Any]]) -> dict[str, Any]:
    ctx = CallContext("answer", "answer", 0.0, True, "/v1/chat/completions", {})
    assembler = ChatCaptureAssembler(ctx)
    for _, data in events:
        if isinstance(data, dict):
            assembler.add_chunk(data)
    return assembler.assembled_message()


def _responses_message(output: list[Any]) -> dict[str, Any]:
    parsed = ResponsesCodec().parse({"model": "answer", "input": output})
    return _last_assistant(parsed.chat["messages"])


def _messages_message(content: list[Any]) -> dict[str, Any]:
    body = {
        "model": "answer",
        "max_tokens": 1,
        "messages": [{"role": "assistant", "content": content}],
    }
    return _last_assistant(MessagesCodec().parse(body).chat["messages"])


def _last_assistant(messages: list[ChatMessage]) -> dict[str, Any]:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return open_dict(message)
    return {"role": "assistant", "content": None}


def _messages_stream_content(events: Iterable[tuple[str | None, Any]]) -> list[dict[str, Any]]:
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, list[str]] = {}
    for _, data in events:
        if not isinstance(data, dict):
            continue
        kind = data.get("type")
        if kind == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            dtype = delta.get("type")
            if dtype == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif dtype == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta["thinking"]
            elif dtype == "signature_delta":
                block["signature"] = block.get("signature", "") + delta["signature"]
            elif dtype == "input_json_delta":
                partial.setdefault(data["index"], []).append(delta["partial_json"])
    for index, parts in partial.items():
        text = "".join(parts)
        blocks[index]["input"] = json.loads(text) if text else {}
    return [blocks[i] for i in sorted(blocks)]


def answer_message(api: Api, raw: bytes, content_type: str) -> dict[str, Any]:
    """The canonical assistant message of one answer of ``api`` (a JSON body, or an SSE stream
    when ``content_type`` is ``text/event-stream``). Raises ValueError when it holds none."""
    stream = content_type.startswith("text/event-stream")
    if api is Api.CHAT_COMPLETIONS:
        if stream:
            return _chat_message(sse_events(raw))
        choices = json.loads(raw).get("choices") or []
        if not choices:
            raise ValueError("chat completion without choices")
        return dict(choices[0]["message"])
    if api is Api.RESPONSES:
        if stream:
            done = [d for e, d in sse_events(raw) if isinstance(d, dict)]
            completed = [d for d in done if d.get("type") == "response.completed"]
            if completed:
                return _responses_message(completed[-1]["response"]["output"])
            items = [d["item"] for d in done if d.get("type") == "response.output_item.done"]
            if not items:
                raise ValueError("Responses stream without output items")
            return _responses_message(items)
        return _responses_message(json.loads(raw)["output"])
    if stream:
        return _messages_message(_messages_stream_content(sse_events(raw)))
    return _messages_message(json.loads(raw)["content"])
