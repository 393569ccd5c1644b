"""Parsing a Responses request (``POST /v1/responses``) into the canonical conversation.

Owns the validation of a Responses body (errors name the field as a dotted path, e.g.
``input.3.content.0.type``: ``checks``) and its mapping to the canonical chat request (see
``fronts.base``) and to ``ResponsesOptions``: ``parse_request`` reads the fields in order, the
``input`` items by ``items``, the tools by ``tools``. Pure; must not encode answers
(``encode``, ``stream``).

- ``instructions`` becomes a leading system message, before the history
  ``previous_response_id`` stands for (``referenced_history``). As the API does, the
  instructions of the referenced response are not carried over: that history is its input
  items (``developer``/``system`` messages among them) and its output, without the system
  message its own ``instructions`` became.
- ``input``: a string (one user message) or items, see ``items`` (consecutive model-side
  items form one assistant message; images, files and items for state the proxy does not keep).
- ``tools``, ``tool_choice`` and ``parallel_tool_calls``: see ``tools`` (freeform tools
  become functions; namespaces and hosted tools are left out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from capture_proxy.core.conversation import ChatMessage, ChatRequest, kept_messages
from capture_proxy.core.fronts.base import Api, FrontRequest, is_int, is_number, tools_not_rendered
from capture_proxy.core.fronts.responses.checks import as_list, as_object, fail, string_member
from capture_proxy.core.fronts.responses.items import ResponsesMemo, input_messages
from capture_proxy.core.fronts.responses.options import ResponsesOptions
from capture_proxy.core.fronts.responses.tools import tool_fields
from capture_proxy.core.images import ImageCollector, ImageLimits
from capture_proxy.core.known_tools import KnownTools

if TYPE_CHECKING:
    from capture_proxy.core.known_bodies import ParsedBody


def referenced_response_id(body: Mapping[str, Any]) -> str | None:
    """The ``previous_response_id`` a request continues (None when it has none), for the
    adapter to resolve into canonical messages before ``parse``."""
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        fail("previous_response_id", "must be a non-empty string")
    return value


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
        new, _ = input_messages(raw_input, images)
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
    converted, checkpoints = input_messages(items, images, earlier)
    messages = [system, *converted] if system is not None else list(converted)  # (not the memo's)
    if not messages:
        fail("input", "holds no message to answer")
    return messages, ResponsesMemo(instructions, system, items, converted, checkpoints)


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
