"""Parsing a Responses request (``POST /v1/responses``) into the canonical conversation.

Owns the validation of a Responses body (errors name the field as a dotted path, e.g.
``input.3.content.0.type``) and its mapping to the canonical chat request (see ``fronts.base``)
and to ``ResponsesOptions``. Pure; must not encode answers (``encode``, ``stream``).

- ``instructions`` becomes a leading system message, before the history
  ``previous_response_id`` stands for (``referenced_history``). As the API does, the
  instructions of the referenced response are not carried over: that history is its input
  items (``developer``/``system`` messages among them) and its output, without the system
  message its own ``instructions`` became.
- ``input`` items: ``message`` items (``developer``/``system`` -> system), ``function_call``
  and ``custom_tool_call`` (freeform: arguments ``{"input": <text>}``), their outputs (tool
  messages), ``reasoning`` (-> ``reasoning_content``: the sealed text, then ``content``, then
  ``summary``). Consecutive model-side items (reasoning, assistant message, calls) form ONE
  assistant message, exactly the message the proxy's answer was, so that linking finds the
  call it continues. ``input_image`` parts of user messages and of tool-call outputs are
  images (``image_url``: a ``data:`` URL or a remote one, ``core.images``; a ``file_id`` is
  refused: the proxy keeps no uploaded files); files are refused, naming the field; so are
  items that stand for state the proxy does not keep (``item_reference``) or calls of tools it
  never offers (hosted tools).
- ``tools``, ``tool_choice`` and ``parallel_tool_calls``: see ``tools`` (freeform tools
  become functions; namespaces and hosted tools are left out).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from capture_proxy.core.conversation import (
    ChatMessage,
    ChatRequest,
    ChatToolCall,
    Role,
    kept_messages,
    tool_call,
)
from capture_proxy.core.fronts.base import (
    Api,
    FrontRequest,
    is_int,
    is_number,
    open_reasoning,
    tools_not_rendered,
)
from capture_proxy.core.fronts.responses.checks import as_list, as_object, fail, string_member
from capture_proxy.core.fronts.responses.options import ResponsesOptions
from capture_proxy.core.fronts.responses.tools import tool_fields
from capture_proxy.core.images import ImageCollector, ImageLimits, detail_of, joined_content
from capture_proxy.core.known_tools import KnownTools
from capture_proxy.core.requests import arguments_problem

if TYPE_CHECKING:
    from capture_proxy.core.known_bodies import ParsedBody

_TEXT_PARTS = frozenset({"input_text", "output_text"})
_TOOL_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})
_ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


def referenced_response_id(body: Mapping[str, Any]) -> str | None:
    """The ``previous_response_id`` a request continues (None when it has none), for the
    adapter to resolve into canonical messages before ``parse``."""
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        fail("previous_response_id", "must be a non-empty string")
    return value


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


def _input_messages(
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


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = as_object(text, "text").get("format")
    if fmt is None:
        return None
    fmt = as_object(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema: dict[str, Any] = {
            "name": string_member(fmt, "name", "text.format"),
            "schema": dict(as_object(fmt.get("schema"), "text.format.schema")),
        }
        description = string_member(fmt, "description", "text.format", required=False)
        if description is not None:
            schema["description"] = description
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    fail("text.format.type", "must be 'text', 'json_object' or 'json_schema'")


def referenced_history(
    request_messages: Sequence[Mapping[str, Any]],
    response_message: Mapping[str, Any],
    request_received: Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    """The canonical messages a response stands for when a later request names it by
    ``previous_response_id``: its request's messages less the system message its
    ``instructions`` became (``_input`` put it first; the API does not carry instructions
    over to the next response), then its answer. ``request_received``: that request's body
    as received (``CallRecord.request_received``), which says whether it had
    ``instructions``; None (a record from before bodies were kept): the messages as stored."""
    messages = [dict(message) for message in request_messages]
    if (
        request_received is not None
        and isinstance(request_received.get("instructions"), str)
        and messages
        and messages[0].get("role") == "system"
    ):
        messages = messages[1:]
    return [*messages, dict(response_message)]


def _with_instructions(
    previous: list[dict[str, Any]], instructions: str | None
) -> list[ChatMessage]:
    """``instructions`` (a system message) first, then the referenced history as it is: its
    own system messages are input items the API keeps (``referenced_history``)."""
    messages = kept_messages(previous)
    if instructions is None:
        return messages
    return [{"role": "system", "content": instructions}, *messages]


def _input(
    body: Mapping[str, Any],
    previous: list[dict[str, Any]] | None,
    images: ImageCollector,
    earlier: ResponsesMemo | None = None,
) -> tuple[list[ChatMessage], ResponsesMemo | None]:
    """The canonical messages: the referenced history, ``instructions``, then ``input``; and
    their ``ResponsesMemo`` where ``input`` is an array and no history is referenced (None
    else), going on from ``earlier``'s."""
    reference = referenced_response_id(body)
    instructions = string_member(body, "instructions", "", required=False)
    raw_input = body.get("input")
    if raw_input is None and reference is None:
        fail("input", "is required (or previous_response_id)")
    if raw_input is None:
        new: list[ChatMessage] = []
    elif isinstance(raw_input, str):
        new = [{"role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        if previous is None and reference is None:
            return _input_items(raw_input, instructions, images, earlier)
        new, _ = _input_messages(raw_input, images)
    else:
        fail("input", f"must be a string or an array of items, got {type(raw_input).__name__}")
    messages = _with_instructions(previous or [], instructions) + new
    if not messages:
        fail("input", "holds no message to answer")
    return messages, None


def _input_items(
    items: list[Any],
    instructions: str | None,
    images: ImageCollector,
    earlier: ResponsesMemo | None,
) -> tuple[list[ChatMessage], ResponsesMemo]:
    """``_input`` of an array of items without a referenced history, with its memo."""
    if earlier is not None and instructions is not None and instructions == earlier.instructions:
        system = earlier.system
    else:
        system = None if instructions is None else {"role": "system", "content": instructions}
    converted, checkpoints = _input_messages(items, images, earlier)
    messages = [system, *converted] if system is not None else list(converted)  # (not the memo's)
    if not messages:
        fail("input", "holds no message to answer")
    return messages, ResponsesMemo(instructions, system, items, converted, checkpoints)


def _sampling_fields(body: Mapping[str, Any], chat: ChatRequest) -> None:
    """Sets ``max_tokens``, ``temperature``, ``top_p`` and ``response_format`` of ``chat``."""
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not is_int(limit) or limit < 1:
            fail("max_output_tokens", "must be a positive integer")
        chat["max_tokens"] = limit
    temperature = body.get("temperature")
    if temperature is not None:
        if not is_number(temperature):
            fail("temperature", "must be a number")
        if not 0 <= temperature <= 2:
            fail("temperature", f"must be from 0 to 2, not {temperature}")
        chat["temperature"] = temperature
    top_p = body.get("top_p")
    if top_p is not None:
        if not is_number(top_p):
            fail("top_p", "must be a number")
        if not 0 < top_p <= 1:
            # OpenAI documents [0, 1]; the engine (vLLM) refuses 0.
            fail("top_p", f"must be greater than 0 and at most 1, not {top_p}")
        chat["top_p"] = top_p
    if body.get("text") is not None:
        response_format = _response_format(body["text"])
        if response_format is not None:
            chat["response_format"] = response_format


def _reasoning_fields(body: Mapping[str, Any]) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """The ``reasoning`` object (``effort`` and ``summary`` checked) and the ``include`` list."""
    reasoning = body.get("reasoning")
    if reasoning is not None:
        reasoning = as_object(reasoning, "reasoning")
        for key in ("effort", "summary"):
            string_member(reasoning, key, "reasoning", required=False)
    include: list[str] = []
    if body.get("include") is not None:
        for i, value in enumerate(as_list(body["include"], "include")):
            if not isinstance(value, str):
                fail(f"include.{i}", "must be a string")
            include.append(value)
    return (dict(reasoning) if reasoning is not None else None), tuple(include)


def _stream(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        fail("stream", "must be a boolean")
    return stream


def parse_request(
    body: dict[str, Any],
    previous: list[dict[str, Any]] | None = None,
    images: ImageLimits | None = None,
    known_tools: KnownTools | None = None,
    history: ParsedBody | None = None,
) -> FrontRequest:
    """A Responses body as a ``FrontRequest`` (``options``: ``ResponsesOptions``).
    ``previous``: the canonical messages ``previous_response_id`` stands for
    (``referenced_history``: without that response's instructions); ``images``: what
    images it may carry (None: refused); ``known_tools``: facts of earlier requests' tools (a
    tools value is converted once, ``convert_tools``); ``history``: the body as
    ``known_bodies`` read it (the conversion of the input it repeats is taken from its
    ``front_memo``, and this one's kept). Raises InvalidFrontRequest naming the first bad
    field, in the order the fields are read below, ImageRefused (``core.images``)."""
    model = body.get("model")
    if model is None:
        fail("model", "is required")
    if not isinstance(model, str):
        fail("model", f"must be a string, got {type(model).__name__}")
    if body.get("background") is True:
        fail(
            "background",
            "true is not supported: the proxy answers in the request, and keeps no response "
            "to poll or cancel",
        )
    collector = ImageCollector(images)
    earlier = history.front_memo(ResponsesMemo) if history is not None else None
    messages, memo = _input(body, previous, collector, earlier)
    if history is not None:
        history.keep_front_memo(memo)
    chat: ChatRequest = {"model": model, "messages": messages}
    converted = tool_fields(body, chat, known_tools)
    custom, unrendered = converted.extra
    _sampling_fields(body, chat)
    reasoning, include = _reasoning_fields(body)
    stream = _stream(body)
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}
    options = ResponsesOptions(
        custom_tools=custom, unrendered_tools=unrendered, reasoning=reasoning, include=include
    )
    return FrontRequest(
        api=Api.RESPONSES,
        chat=chat,
        stream=stream,
        received={k: v for k, v in body.items() if k != "input"},
        options=options,
        tools_facts=converted.chat_facts,
        received_tools_facts=converted.raw_facts,
        diagnostics=tools_not_rendered(unrendered),
        images=collector.result(),
    )
