"""Encoding the canonical answer as an Anthropic ``message``, and Anthropic's error shape.

Owns the ``content`` blocks of an answer and the ``message`` around them, the ``count_tokens``
answer and the error body. Pure; must not parse requests (``parse``) or keep stream state
(``stream``).

A ``thinking`` block (the signature seals the call id and the reasoning text; the visible text
is ``""`` when the request asked ``display: omitted``), a ``text`` block, one ``tool_use`` block
per tool call (ids unchanged). Tool-call arguments that are not a JSON object (the engine's
tool parser passed malformed model output through) cannot be an Anthropic ``input``: they are
sent wrapped as ``{"INVALID_JSON": "<raw text>"}``, the wrapping Anthropic's fine-grained tool
streaming docs suggest, and unwrapped again by ``parse`` so the turn still digests as the
model wrote it; empty arguments are ``{}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from capture_proxy.core.fronts.base import (
    Answer,
    FrontRequest,
    answer_model,
    front_options,
    loads_or_none,
    seal_reasoning,
)
from capture_proxy.core.fronts.messages.blocks import INVALID_JSON_KEY
from capture_proxy.core.fronts.messages.options import MessagesOptions

#: Anthropic error types by HTTP status (docs "HTTP errors"; SDK ``ErrorType``: 402 billing,
#: 504 ``timeout_error``, 529 ``overloaded_error``). Other 4xx: ``invalid_request_error``,
#: other 5xx: ``api_error``.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def message_id(call_id: str) -> str:
    """``msg_`` + the call id's hex (``call-<hex>``)."""
    return "msg_" + call_id.removeprefix("call-")


def fallback_tool_use_id(call_id: str, position: int) -> str:
    """An id for a tool call the engine gave none (stable, so it comes back equal)."""
    return f"toolu_{call_id.removeprefix('call-')}_{position}"


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as an Anthropic ``input`` object (see the module docstring)."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None:
        return {}
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    if not text.strip():
        return {}
    value = loads_or_none(text)
    return value if isinstance(value, dict) else {INVALID_JSON_KEY: text}


def tool_input_json(arguments: Any) -> str:
    """The ``partial_json`` text of a tool call: the arguments as the engine gave them when
    they are a JSON object, else the JSON of ``tool_input``."""
    if isinstance(arguments, str) and isinstance(loads_or_none(arguments), dict):
        return arguments
    return json.dumps(tool_input(arguments), ensure_ascii=False)


def stop_sequence(request: FrontRequest, answer: Answer) -> str | None:
    """The request's ``stop_sequences`` entry that ended the answer: the engine's stop reason
    when it is one of them and the answer stopped (not at the length limit, not for a tool
    call); None otherwise."""
    matched = answer.stop_reason
    if answer.finish_reason != "stop" or answer.message.get("tool_calls"):
        return None
    stops = request.chat.get("stop")
    if isinstance(matched, str) and isinstance(stops, list) and matched in stops:
        return matched
    return None


def stop_reason(request: FrontRequest, answer: Answer) -> str:
    """The Anthropic stop reason of a chat finish reason; ``stop_sequence`` when one of the
    request's stop sequences ended it (``stop_sequence``)."""
    if answer.finish_reason == "length":
        return "max_tokens"
    if answer.message.get("tool_calls"):
        return "tool_use"
    if stop_sequence(request, answer) is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(answer.finish_reason or "", "end_turn")


def message_usage(answer: Answer) -> dict[str, int]:
    """The ``usage`` of a ``message``: prompt and generated token counts of the chat usage
    (0 when the engine gave none), no cache counts (the proxy caches nothing)."""
    usage = answer.usage or {}
    return {
        "input_tokens": int(usage.get("prompt_tokens") or 0),
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def _thinking_block(call_id: str, text: str, omit: bool) -> dict[str, Any]:
    return {
        "type": "thinking",
        "thinking": "" if omit else text,
        "signature": seal_reasoning(call_id, text),
    }


def tool_use_block(call_id: str, position: int, call: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tool_use`` block of the ``position``-th tool call of an answer."""
    fn = call.get("function") or {}
    return {
        "type": "tool_use",
        "id": call.get("id") or fallback_tool_use_id(call_id, position),
        "name": fn.get("name") or "",
        "input": tool_input(fn.get("arguments")),
    }


def content_blocks(call_id: str, message: Mapping[str, Any], omit: bool) -> list[dict[str, Any]]:
    """The ``content`` of the answer message: thinking, text, tool uses."""
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        blocks.append(_thinking_block(call_id, reasoning, omit))
    text = _text_of(message.get("content"))
    if text:
        blocks.append({"type": "text", "text": text})
    for k, call in enumerate(message.get("tool_calls") or []):
        blocks.append(tool_use_block(call_id, k, call))
    return blocks


def options_of(request: FrontRequest) -> MessagesOptions:
    """The request's ``MessagesOptions`` (the defaults for a request of another front)."""
    return front_options(request, MessagesOptions)


def anthropic_error_body(message: str, error_type: str) -> dict[str, Any]:
    """Anthropic's error shape ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_type_for(status: int) -> str:
    """The Anthropic error type of an HTTP ``status`` (``ERROR_TYPES``)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def encode_message(request: FrontRequest, answer: Answer) -> dict[str, Any]:
    """The whole ``message`` of ``answer``."""
    return {
        "id": message_id(answer.call_id),
        "type": "message",
        "role": "assistant",
        "model": answer_model(request, answer),
        "content": content_blocks(
            answer.call_id, answer.message, options_of(request).omit_thinking
        ),
        "stop_reason": stop_reason(request, answer),
        "stop_sequence": stop_sequence(request, answer),
        "usage": message_usage(answer),
    }


def encode_count_tokens(num_tokens: int) -> dict[str, Any]:
    """The ``count_tokens`` answer."""
    return {"input_tokens": num_tokens}
