"""A Responses request's ``input`` items as canonical chat messages.

Owns the validation of the items (errors name the field as a dotted path, e.g.
``input.3.content.0.type``, ``checks``) and their mapping, and ``ResponsesMemo``, what the
next request of the session takes again of their conversion. Pure.

``message`` items (``developer``/``system`` -> system), ``function_call`` and
``custom_tool_call`` (freeform: arguments ``{"input": <text>}``), their outputs (tool
messages), ``reasoning`` (-> ``reasoning_content``: the sealed text, then ``content``, then
``summary``). Consecutive model-side items (reasoning, assistant message, calls) form ONE
assistant message, exactly the message the proxy's answer was, so that linking finds the call
it continues. ``input_image`` parts of user messages and of tool-call outputs are images
(``image_url``: a ``data:`` URL or a remote one, ``core.images``; a ``file_id`` is refused: the
proxy keeps no uploaded files); files are refused, naming the field; so are items that stand
for state the proxy does not keep (``item_reference``) or calls of tools it never offers
(hosted tools).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.core.conversation import ChatMessage, ChatToolCall, Role, tool_call
from capture_proxy.core.fronts.base import open_reasoning
from capture_proxy.core.fronts.responses.checks import as_list, as_object, fail, string_member
from capture_proxy.core.images import ImageCollector, detail_of, joined_content
from capture_proxy.core.requests import arguments_problem

_TEXT_PARTS = frozenset({"input_text", "output_text"})
_TOOL_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})
_ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


def _part_texts(parts: Any, path: str, allowed: frozenset[str], first: int = 0) -> list[str]:
    """The texts of a list of content parts (numbered from ``first`` in errors); anything but
    text is refused, naming it."""
    texts = []
    for i, raw in enumerate(as_list(parts, path), start=first):
        part = as_object(raw, f"{path}.{i}")
        kind = part.get("type")
        if not isinstance(kind, str):
            fail(f"{path}.{i}.type", "is required (a string)")
        if kind in allowed:
            texts.append(string_member(part, "text", f"{path}.{i}") or "")
        elif kind == "refusal":
            texts.append(string_member(part, "refusal", f"{path}.{i}") or "")
        else:
            fail(
                f"{path}.{i}.type",
                f"is {kind!r}: only text content can be captured "
                f"({', '.join(sorted(allowed))} or refusal parts)",
            )
    return texts


def _image_part(part: Mapping[str, Any], path: str, role: str, images: ImageCollector) -> Any:
    """An ``input_image`` part's canonical image part."""
    detail = detail_of(part.get("detail"), f"{path}.detail")
    if part.get("image_url") is None and part.get("file_id") is not None:
        fail(
            f"{path}.file_id", "cannot be read: the proxy keeps no uploaded files (send image_url)"
        )
    return images.url(part.get("image_url"), f"{path}.image_url", role, detail=detail)


def _content_parts(value: Any, path: str, role: str, images: ImageCollector) -> Any:
    """A user message's or a tool output's content: a string, or text and ``input_image``
    parts (``core.images.joined_content``)."""
    if isinstance(value, str):
        return value
    if value is None:
        fail(path, "is required")
    if not isinstance(value, list):
        fail(path, f"must be a string or an array of content parts, got {type(value).__name__}")
    parts: list[Any] = []
    for i, raw in enumerate(value):
        part = as_object(raw, f"{path}.{i}")
        if part.get("type") == "input_image":
            parts.append(_image_part(part, f"{path}.{i}", role, images))
        else:
            parts.extend(_part_texts([raw], path, _TEXT_PARTS, first=i))
    return joined_content(parts)


def _content_text(value: Any, path: str, allowed: frozenset[str]) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        fail(path, "is required")
    if not isinstance(value, list):
        fail(path, f"must be a string or an array of content parts, got {type(value).__name__}")
    return "\n".join(_part_texts(value, path, allowed))


def _reasoning_text(item: Mapping[str, Any], path: str) -> str:
    """The reasoning an item stands for: our sealed value's text, else the ``content``
    reasoning texts, else the summary texts."""
    sealed = item.get("encrypted_content")
    if sealed is not None and not isinstance(sealed, str):
        fail(f"{path}.encrypted_content", "must be a string")
    opened = open_reasoning(sealed)
    if opened is not None:
        return opened[1]
    content = item.get("content")
    if content is not None:
        texts = _part_texts(content, f"{path}.content", frozenset({"reasoning_text", "text"}))
        if any(texts):
            return "".join(texts)
    summary = item.get("summary")
    if summary is None:
        return ""
    return "\n".join(_part_texts(summary, f"{path}.summary", frozenset({"summary_text"})))


@dataclass
class _Turn:
    """The model-side items of one assistant turn, gathered until a non-model item."""

    texts: list[str] = field(default_factory=list)
    has_message: bool = False
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ChatToolCall] = field(default_factory=list)

    def message(self) -> ChatMessage | None:
        reasoning = "".join(self.reasoning)
        if not (self.has_message or reasoning or self.tool_calls):
            return None
        message: ChatMessage = {
            "role": "assistant",
            "content": "".join(self.texts) if self.has_message else None,
        }
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def _custom_arguments(text: str) -> str:
    return json.dumps({"input": text}, ensure_ascii=False)


def _tool_call(item: Mapping[str, Any], path: str, kind: str) -> ChatToolCall:
    """A ``function_call`` (its arguments checked as JSON) or ``custom_tool_call`` item as
    the canonical tool call (a custom tool's input wrapped as ``{"input": ...}``); fields
    read in the order they always were (a function call's arguments first)."""
    if kind == "function_call":
        arguments = string_member(item, "arguments", path) or ""
        problem = arguments_problem(arguments)
        if problem is not None:
            fail(f"{path}.arguments", problem.removeprefix("tool call arguments "))
        return tool_call(
            string_member(item, "call_id", path) or "",
            string_member(item, "name", path) or "",
            arguments,
        )
    call_id = string_member(item, "call_id", path) or ""
    name = string_member(item, "name", path) or ""
    return tool_call(call_id, name, _custom_arguments(string_member(item, "input", path) or ""))


@dataclass(slots=True, eq=False)
class ResponsesMemo:
    """The conversion of one request's input, for the next request of its session
    (``known_bodies``: an item it repeats is the same object): ``instructions`` and
    ``system``, the message they became; ``sources`` its input items (its own list, never
    changed), ``messages`` what they became, and ``checkpoints``: ``(items read, messages
    made)`` where no assistant turn was open and no image had been taken, from which the
    conversion goes on as from the start (a function call joins the assistant turn before
    it, so items do not convert one by one)."""

    instructions: str | None
    system: ChatMessage | None
    sources: list[Any]
    messages: list[ChatMessage]
    checkpoints: list[tuple[int, int]]


def _resumed(
    items: list[Any], earlier: ResponsesMemo | None
) -> tuple[int, list[ChatMessage], list[tuple[int, int]]]:
    """Where the conversion of ``items`` goes on from: the latest of ``earlier``'s
    checkpoints whose items are all this request's very objects (items read, the messages
    made, the checkpoints up to it); the start when none."""
    if earlier is None:
        return 0, [], [(0, 0)]
    same = 0
    for a, b in zip(earlier.sources, items, strict=False):
        if a is not b:
            break
        same += 1
    checkpoints = earlier.checkpoints
    for k in range(len(checkpoints) - 1, -1, -1):
        at, made = checkpoints[k]
        if at <= same:
            return at, earlier.messages[:made], checkpoints[: k + 1]
    return 0, [], [(0, 0)]


def input_messages(
    items: list[Any], images: ImageCollector, earlier: ResponsesMemo | None = None
) -> tuple[list[ChatMessage], list[tuple[int, int]]]:
    """The canonical messages of ``items`` and their checkpoints (``ResponsesMemo``), going on
    from ``earlier``'s where this request repeats its items."""
    start, messages, checkpoints = _resumed(items, earlier)
    turn = _Turn()

    def close_turn() -> None:
        nonlocal turn
        message = turn.message()
        if message is not None:
            messages.append(message)
        turn = _Turn()

    for i in range(start, len(items)):
        path = f"input.{i}"
        item = as_object(items[i], path)
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if not isinstance(kind, str):
            fail(f"{path}.type", "is required (a string)")
        if kind == "message":
            role = item.get("role")
            # An object or array role is unhashable: test the type before the lookup.
            if not isinstance(role, str) or role not in _ROLES:
                fail(f"{path}.role", "must be one of 'system', 'developer', 'user', 'assistant'")
            if role == "assistant":
                text = _content_text(item.get("content"), f"{path}.content", _TEXT_PARTS)
                turn.has_message = True
                turn.texts.append(text)
                continue
            close_turn()
            content = _content_parts(item.get("content"), f"{path}.content", role, images)
            messages.append({"role": _ROLES[role], "content": content})
            if not images.paths:
                checkpoints.append((i + 1, len(messages)))
        elif kind == "reasoning":
            text = _reasoning_text(item, path)
            if text:
                turn.reasoning.append(text)
        elif kind in ("function_call", "custom_tool_call"):
            turn.tool_calls.append(_tool_call(item, path, kind))
        elif kind in _TOOL_OUTPUTS:
            close_turn()
            call_id = string_member(item, "call_id", path) or ""
            output = _content_parts(item.get("output"), f"{path}.output", "tool", images)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            if not images.paths:
                checkpoints.append((i + 1, len(messages)))
        elif kind == "item_reference":
            fail(
                f"{path}.type",
                "is 'item_reference': the proxy keeps no stored items to refer to; send the "
                "item itself (as Codex does with store: false)",
            )
        else:
            fail(
                f"{path}.type",
                f"is {kind!r}: this item cannot be captured (only messages, reasoning, "
                "function and custom tool calls and their outputs can)",
            )
    close_turn()
    return messages, checkpoints
