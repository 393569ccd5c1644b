"""Encoding the canonical answer as a Responses ``response`` object, and its output items.

Owns the ``response`` object ``encode`` returns (and ``response.completed`` carries, with the
items the stream sent), the ids of its items (from the call id, so that streamed items and the
whole answer agree) and the items themselves: ``reasoning`` (the text as ``reasoning_text``
content, as a ``summary_text`` when ``reasoning.summary`` is set, sealed in
``encrypted_content`` when included), the assistant ``message``, and ``function_call`` /
``custom_tool_call`` items. A whole answer has one item of each kind (``output_items``); a
streamed one may have more, when the engine's deltas interleave kinds (``stream``): both parse
back into the same assistant message. Pure; must not parse requests (``parse``) or keep
stream state (``stream``).
"""

from __future__ import annotations

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
from capture_proxy.core.fronts.responses.options import ResponsesOptions


def options_of(request: FrontRequest) -> ResponsesOptions:
    """The request's ``ResponsesOptions`` (the defaults for a request of another front)."""
    return front_options(request, ResponsesOptions)


def answer_reasoning(message: Mapping[str, Any]) -> str:
    """The reasoning text of an answer message (``reasoning_content``, else vLLM's
    ``reasoning``); ``""`` when it has none."""
    text = message.get("reasoning_content")
    if text is None:
        text = message.get("reasoning")
    return text if isinstance(text, str) else ""


class ItemIds:
    """Item ids from the call id: one per kind of item (and per tool call), so that the
    streamed items and ``encode`` agree whatever order the deltas came in."""

    def __init__(self, call_id: str):
        self.base = call_id.removeprefix("call-")

    def response(self) -> str:
        return f"resp_{self.base}"

    def reasoning(self) -> str:
        return f"rs_{self.base}"

    def message(self) -> str:
        return f"msg_{self.base}"

    def call(self, index: int, name: Any, opts: ResponsesOptions) -> str:
        prefix = "ctc" if name in opts.custom_tools else "fc"
        return f"{prefix}_{self.base}_{index}"


def reasoning_item(item_id: str, call_id: str, text: str, opts: ResponsesOptions) -> dict[str, Any]:
    """A done ``reasoning`` item holding ``text`` (see the module docstring for where)."""
    item: dict[str, Any] = {
        "id": item_id,
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": text}] if opts.reasoning_summary else [],
        "content": [{"type": "reasoning_text", "text": text}],
    }
    if opts.encrypted_reasoning:
        item["encrypted_content"] = seal_reasoning(call_id, text)
    return item


def text_part(text: str) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant ``message`` item (``text`` None: the in-progress item, no part yet)."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [text_part(text)],
    }


def custom_tool_input(arguments: str) -> str:
    """The freeform input of a custom tool call whose chat arguments are ``{"input": ...}``;
    arguments of another shape are passed as they are."""
    value = loads_or_none(arguments)
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments


def call_item(
    item_id: str,
    call_id: str,
    name: str,
    arguments: str | None,
    opts: ResponsesOptions,
) -> dict[str, Any]:
    """A done call item (``arguments`` None: the in-progress item, no arguments yet)."""
    status = "in_progress" if arguments is None else "completed"
    if name in opts.custom_tools:
        text = "" if arguments is None else custom_tool_input(arguments)
        return {
            "id": item_id,
            "type": "custom_tool_call",
            "status": status,
            "call_id": call_id,
            "name": name,
            "input": text,
        }
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments or "",
    }


def response_usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The Responses ``usage`` of a chat usage (None when there is none)."""
    if not usage:
        return None
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }


def response_object(
    request: FrontRequest,
    answer: Answer,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete_details: dict[str, Any] | None,
) -> dict[str, Any]:
    """A ``response`` object; request fields are echoed as the API does (its defaults when
    the request left them out)."""
    got = request.received
    return {
        "id": ItemIds(answer.call_id).response(),
        "object": "response",
        "created_at": int(answer.created_at),
        "status": status,
        "error": None,
        "incomplete_details": incomplete_details,
        "instructions": got.get("instructions"),
        "max_output_tokens": got.get("max_output_tokens"),
        "model": answer_model(request, answer),
        "output": output,
        "parallel_tool_calls": got.get("parallel_tool_calls", True),
        "previous_response_id": got.get("previous_response_id"),
        "reasoning": got.get("reasoning") or {"effort": None, "summary": None},
        "store": got.get("store", True),
        "temperature": got.get("temperature"),
        "text": got.get("text") or {"format": {"type": "text"}},
        "tool_choice": got.get("tool_choice", "auto"),
        "tools": got.get("tools") or [],
        "top_p": got.get("top_p"),
        "truncation": got.get("truncation", "disabled"),
        "usage": usage,
        "metadata": got.get("metadata") or {},
    }


def output_items(request: FrontRequest, answer: Answer) -> list[dict[str, Any]]:
    """The output items of a whole answer: reasoning, message and call items in that order
    (the canonical answer keeps each kind's text whole, not the order the engine's deltas
    came in; a stream's items keep that order, ``stream``)."""
    ids = ItemIds(answer.call_id)
    opts = options_of(request)
    message = answer.message
    output: list[dict[str, Any]] = []
    reasoning = answer_reasoning(message)
    if reasoning:
        output.append(reasoning_item(ids.reasoning(), answer.call_id, reasoning, opts))
    content = message.get("content")
    if isinstance(content, str) and content:
        output.append(message_item(ids.message(), content, "completed"))
    for k, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        output.append(
            call_item(
                ids.call(k, fn.get("name"), opts),
                call.get("id") or "",
                fn.get("name") or "",
                fn.get("arguments") or "",
                opts,
            )
        )
    return output


def answered_response(
    request: FrontRequest, answer: Answer, output: list[dict[str, Any]]
) -> dict[str, Any]:
    """The ``response`` object of a finished ``answer`` with these output items;
    ``status: "incomplete"`` (``max_output_tokens``) when it was cut at the limit."""
    incomplete = answer.finish_reason == "length"
    return response_object(
        request,
        answer,
        status="incomplete" if incomplete else "completed",
        output=output,
        usage=response_usage(answer.usage),
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
    )


def encode_response(request: FrontRequest, answer: Answer) -> dict[str, Any]:
    """The whole ``response`` object of ``answer`` (``output_items``, ``answered_response``)."""
    return answered_response(request, answer, output_items(request, answer))
