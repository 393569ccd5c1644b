"""The OpenAI Responses API front (``POST /v1/responses``), as Codex CLI sends it.

Owns the mapping between a Responses request and the canonical conversation (a chat body, see
``base``), and between the canonical answer and a ``response`` object, whole or as the API's
SSE events. Pure: no I/O, no aiohttp.

Request (``parse``):

- ``instructions`` becomes a leading system message (replacing the leading system message of
  the history ``previous_response_id`` stands for, when the adapter resolved one).
- ``input`` items: ``message`` items (``developer``/``system`` -> system), ``function_call``
  and ``custom_tool_call`` (freeform: arguments ``{"input": <text>}``), their outputs (tool
  messages), ``reasoning`` (-> ``reasoning_content``). Consecutive model-side items
  (reasoning, assistant message, calls) form ONE assistant message, exactly the message the
  proxy's answer was, so that linking finds the call it continues. Only text is captured:
  images and files are refused, naming the field; so are items that stand for state the proxy
  does not keep (``item_reference``) or calls of tools it never offers (hosted tools).
- ``tools``: ``function`` tools pass; ``custom`` (freeform) tools become a function with one
  string parameter ``input``; ``namespace`` and hosted tools (``web_search``, ...) cannot be
  rendered by a local engine and are left out (``ResponsesOptions.unrendered_tools``, named by
  the call's ``tools_not_rendered`` diagnostic).

Reasoning, and how Codex hands it back: Codex sends ``store: false`` and
``include: ["reasoning.encrypted_content"]`` and replays every ``reasoning`` output item on
the next request as it received it (``summary``, ``encrypted_content`` and, when it holds
``reasoning_text`` parts, ``content``; never the item id). So a reasoning item carries the
reasoning text three ways: ``encrypted_content`` (``seal_reasoning``, only when included, as
the API does), ``content`` (``reasoning_text``, always, as open-weight models' reasoning is
shown by vLLM), and ``summary`` (the whole text as one ``summary_text``, only when
``reasoning.summary`` is set: Codex shows summaries as the model's reasoning). ``parse``
prefers the sealed text, then ``content``, then ``summary``.

Streaming: Codex (codex-rs ``sse/responses.rs``) builds its history from
``response.output_item.done`` items and ends a turn on ``response.completed`` (it reads only
the response's ``id`` and ``usage``); it needs ``response.created``, takes text from
``response.output_text.delta``, reasoning from ``response.reasoning_summary_text.delta``
(with ``summary_index``) or ``response.reasoning_text.delta`` (with ``content_index``),
and treats ``response.failed`` as a (retryable) error. It ignores ``error`` events and fails
the turn on ``response.incomplete``; so an answer cut at the token limit ends with
``response.completed`` whose response has ``status: "incomplete"``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from capture_proxy.core.fronts.base import (
    Answer,
    Api,
    FrontRequest,
    InvalidFrontRequest,
    open_reasoning,
    seal_reasoning,
    sse_event,
    tools_not_rendered,
)
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.requests import arguments_problem

#: The chat parameters a freeform (``custom``) tool is offered under.
CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}

#: The ``include`` value that asks for ``encrypted_content`` on reasoning items.
ENCRYPTED_REASONING = "reasoning.encrypted_content"

_TEXT_PARTS = frozenset({"input_text", "output_text"})
_MODEL_ITEMS = frozenset({"reasoning", "function_call", "custom_tool_call"})
_TOOL_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TOOL_CHOICES = frozenset({"auto", "none", "required"})


@dataclass(frozen=True)
class ResponsesOptions:
    """What the encoder needs back from the request (``FrontRequest.options``)."""

    #: names of freeform tools: a call of one is answered as a ``custom_tool_call``
    custom_tools: frozenset[str] = frozenset()
    #: the tools left out of the chat tools, as sent: namespaces, hosted tools
    unrendered_tools: tuple[Mapping[str, Any], ...] = ()
    #: the request's ``reasoning`` object (``effort``, ``summary``) and ``include`` list
    reasoning: Mapping[str, Any] | None = None
    include: tuple[str, ...] = ()

    @property
    def encrypted_reasoning(self) -> bool:
        """Whether reasoning items carry ``encrypted_content`` (the client included it)."""
        return ENCRYPTED_REASONING in self.include

    @property
    def reasoning_summary(self) -> bool:
        """Whether reasoning items carry the text as a summary (``reasoning.summary`` set)."""
        summary = (self.reasoning or {}).get("summary")
        return isinstance(summary, str) and summary not in ("", "none")


def _fail(param: str, message: str) -> NoReturn:
    raise InvalidFrontRequest(f"'{param}' {message}", param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _string(obj: Mapping[str, Any], key: str, path: str, *, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            _fail(f"{path}.{key}" if path else key, "is required")
        return None
    if not isinstance(value, str):
        _fail(f"{path}.{key}" if path else key, f"must be a string, got {type(value).__name__}")
    return value


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        _fail(path, f"must be an object, got {type(value).__name__}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        _fail(path, f"must be an array, got {type(value).__name__}")
    return value


def referenced_response_id(body: Mapping[str, Any]) -> str | None:
    """The ``previous_response_id`` a request continues (None when it has none), for the
    adapter to resolve into canonical messages before ``parse``."""
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        _fail("previous_response_id", "must be a non-empty string")
    return value


# -- parse -------------------------------------------------------------------------------------


def _part_texts(parts: Any, path: str, allowed: frozenset[str]) -> list[str]:
    """The texts of a list of content parts; anything but text is refused, naming it."""
    texts = []
    for i, raw in enumerate(_list(parts, path)):
        part = _object(raw, f"{path}.{i}")
        kind = part.get("type")
        if kind in allowed:
            texts.append(_string(part, "text", f"{path}.{i}") or "")
        elif kind == "refusal":
            texts.append(_string(part, "refusal", f"{path}.{i}") or "")
        else:
            _fail(
                f"{path}.{i}.type",
                f"is {kind!r}: only text content can be captured "
                f"({', '.join(sorted(allowed))} or refusal parts)",
            )
    return texts


def _content_text(value: Any, path: str, allowed: frozenset[str]) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        _fail(path, "is required")
    if not isinstance(value, list):
        _fail(path, f"must be a string or an array of content parts, got {type(value).__name__}")
    return "\n".join(_part_texts(value, path, allowed))


def _reasoning_text(item: Mapping[str, Any], path: str) -> str:
    """The reasoning an item stands for: our sealed value's text, else the ``content``
    reasoning texts, else the summary texts."""
    sealed = item.get("encrypted_content")
    if sealed is not None and not isinstance(sealed, str):
        _fail(f"{path}.encrypted_content", "must be a string")
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
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any] | None:
        reasoning = "".join(self.reasoning)
        if not (self.has_message or reasoning or self.tool_calls):
            return None
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.texts) if self.has_message else None,
        }
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _custom_arguments(text: str) -> str:
    return json.dumps({"input": text}, ensure_ascii=False)


def _input_messages(items: list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    turn = _Turn()

    def close_turn() -> None:
        nonlocal turn
        message = turn.message()
        if message is not None:
            messages.append(message)
        turn = _Turn()

    for i, raw in enumerate(items):
        path = f"input.{i}"
        item = _object(raw, path)
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if not isinstance(kind, str):
            _fail(f"{path}.type", "is required (a string)")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                _fail(f"{path}.role", "must be one of 'system', 'developer', 'user', 'assistant'")
            text = _content_text(item.get("content"), f"{path}.content", _TEXT_PARTS)
            if role == "assistant":
                turn.has_message = True
                turn.texts.append(text)
                continue
            close_turn()
            messages.append({"role": _ROLES[role], "content": text})
        elif kind == "reasoning":
            text = _reasoning_text(item, path)
            if text:
                turn.reasoning.append(text)
        elif kind == "function_call":
            arguments = _string(item, "arguments", path) or ""
            problem = arguments_problem(arguments)
            if problem is not None:
                _fail(f"{path}.arguments", problem.removeprefix("tool call arguments "))
            turn.tool_calls.append(
                _tool_call(
                    _string(item, "call_id", path) or "",
                    _string(item, "name", path) or "",
                    arguments,
                )
            )
        elif kind == "custom_tool_call":
            turn.tool_calls.append(
                _tool_call(
                    _string(item, "call_id", path) or "",
                    _string(item, "name", path) or "",
                    _custom_arguments(_string(item, "input", path) or ""),
                )
            )
        elif kind in _TOOL_OUTPUTS:
            close_turn()
            call_id = _string(item, "call_id", path) or ""
            output = _content_text(item.get("output"), f"{path}.output", _TEXT_PARTS)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "item_reference":
            _fail(
                f"{path}.type",
                "is 'item_reference': the proxy keeps no stored items to refer to; send the "
                "item itself (as Codex does with store: false)",
            )
        else:
            _fail(
                f"{path}.type",
                f"is {kind!r}: this item cannot be captured (only messages, reasoning, "
                "function and custom tool calls and their outputs can)",
            )
    close_turn()
    return messages


def _tools(
    raw: Any,
) -> tuple[list[dict[str, Any]], frozenset[str], tuple[Mapping[str, Any], ...]]:
    """Chat function tools, the names of freeform tools, the tools left out."""
    tools: list[dict[str, Any]] = []
    custom: set[str] = set()
    unrendered: list[Mapping[str, Any]] = []
    for i, entry in enumerate(_list(raw, "tools")):
        path = f"tools.{i}"
        tool = _object(entry, path)
        kind = tool.get("type")
        if not isinstance(kind, str):
            _fail(f"{path}.type", "is required (a string)")
        if kind in ("function", "custom"):
            name = _string(tool, "name", path) or ""
            function: dict[str, Any] = {"name": name}
            description = _string(tool, "description", path, required=False)
            if description is not None:
                function["description"] = description
            if kind == "function":
                parameters = tool.get("parameters")
                if parameters is None:
                    parameters = {"type": "object", "properties": {}}
                function["parameters"] = dict(_object(parameters, f"{path}.parameters"))
                strict = tool.get("strict")
                if strict is not None:
                    if not isinstance(strict, bool):
                        _fail(f"{path}.strict", "must be a boolean")
                    function["strict"] = strict
            else:
                function["parameters"] = copy.deepcopy(CUSTOM_TOOL_PARAMETERS)
                custom.add(name)
            tools.append({"type": "function", "function": function})
        else:
            unrendered.append(tool)
    return tools, frozenset(custom), tuple(unrendered)


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        if value not in _TOOL_CHOICES:
            _fail("tool_choice", "must be 'auto', 'none', 'required' or a function choice")
        return value
    choice = _object(value, "tool_choice")
    if choice.get("type") in ("function", "custom"):
        return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
    _fail(
        "tool_choice.type",
        f"is {choice.get('type')!r}: only a function or custom tool can be forced "
        "(hosted tools are not run by the engine)",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = _object(text, "text").get("format")
    if fmt is None:
        return None
    fmt = _object(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema: dict[str, Any] = {
            "name": _string(fmt, "name", "text.format"),
            "schema": dict(_object(fmt.get("schema"), "text.format.schema")),
        }
        description = _string(fmt, "description", "text.format", required=False)
        if description is not None:
            schema["description"] = description
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    _fail("text.format.type", "must be 'text', 'json_object' or 'json_schema'")


def _with_instructions(
    previous: list[dict[str, Any]], instructions: str | None
) -> list[dict[str, Any]]:
    messages = [dict(m) for m in previous]
    if instructions is None:
        return messages
    system = {"role": "system", "content": instructions}
    if messages and messages[0].get("role") == "system":
        return [system, *messages[1:]]
    return [system, *messages]


class ResponsesCodec:
    """The Responses API front codec (stateless; ``RESPONSES_CODEC`` is its instance)."""

    api = Api.RESPONSES

    def parse(
        self,
        body: dict[str, Any],
        *,
        previous: list[dict[str, Any]] | None = None,
        known: KnownMessages | None = None,
    ) -> FrontRequest:
        model = body.get("model")
        if model is None:
            _fail("model", "is required")
        if not isinstance(model, str):
            _fail("model", f"must be a string, got {type(model).__name__}")
        reference = referenced_response_id(body)
        instructions = _string(body, "instructions", "", required=False)
        raw_input = body.get("input")
        if raw_input is None and reference is None:
            _fail("input", "is required (or previous_response_id)")
        if raw_input is None:
            new: list[dict[str, Any]] = []
        elif isinstance(raw_input, str):
            new = [{"role": "user", "content": raw_input}]
        elif isinstance(raw_input, list):
            new = _input_messages(raw_input)
        else:
            _fail("input", f"must be a string or an array of items, got {type(raw_input).__name__}")
        messages = _with_instructions(previous or [], instructions) + new
        if not messages:
            _fail("input", "holds no message to answer")

        chat: dict[str, Any] = {"model": model, "messages": messages}
        custom: frozenset[str] = frozenset()
        unrendered: tuple[Mapping[str, Any], ...] = ()
        if body.get("tools") is not None:
            tools, custom, unrendered = _tools(body["tools"])
            if tools:
                chat["tools"] = tools
        if body.get("tool_choice") is not None:
            choice = _tool_choice(body["tool_choice"])
            if "tools" in chat:
                chat["tool_choice"] = choice
        parallel = body.get("parallel_tool_calls")
        if parallel is not None:
            if not isinstance(parallel, bool):
                _fail("parallel_tool_calls", "must be a boolean")
            if "tools" in chat:
                chat["parallel_tool_calls"] = parallel
        limit = body.get("max_output_tokens")
        if limit is not None:
            if not _is_int(limit) or limit < 1:
                _fail("max_output_tokens", "must be a positive integer")
            chat["max_tokens"] = limit
        temperature = body.get("temperature")
        if temperature is not None:
            if not _is_number(temperature):
                _fail("temperature", "must be a number")
            if not 0 <= temperature <= 2:
                _fail("temperature", f"must be from 0 to 2, not {temperature}")
            chat["temperature"] = temperature
        top_p = body.get("top_p")
        if top_p is not None:
            if not _is_number(top_p):
                _fail("top_p", "must be a number")
            if not 0 < top_p <= 1:
                # OpenAI documents [0, 1]; the engine (vLLM) refuses 0.
                _fail("top_p", f"must be greater than 0 and at most 1, not {top_p}")
            chat["top_p"] = top_p
        if body.get("text") is not None:
            response_format = _response_format(body["text"])
            if response_format is not None:
                chat["response_format"] = response_format
        reasoning = body.get("reasoning")
        if reasoning is not None:
            reasoning = _object(reasoning, "reasoning")
            for key in ("effort", "summary"):
                _string(reasoning, key, "reasoning", required=False)
        include: list[str] = []
        if body.get("include") is not None:
            for i, value in enumerate(_list(body["include"], "include")):
                if not isinstance(value, str):
                    _fail(f"include.{i}", "must be a string")
                include.append(value)
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            _fail("stream", "must be a boolean")
        chat["stream"] = stream
        if stream:
            chat["stream_options"] = {"include_usage": True}

        received = {k: v for k, v in body.items() if k != "input"}
        options = ResponsesOptions(
            custom_tools=custom,
            unrendered_tools=unrendered,
            reasoning=dict(reasoning) if reasoning is not None else None,
            include=tuple(include),
        )
        return FrontRequest(
            api=Api.RESPONSES,
            chat=chat,
            stream=stream,
            received=received,
            options=options,
            diagnostics=tools_not_rendered(unrendered),
        )

    def encode(self, request: FrontRequest, answer: Answer) -> dict[str, Any]:
        ids = _Ids(answer.call_id)
        opts = _options(request)
        message = answer.message
        output: list[dict[str, Any]] = []
        reasoning = _answer_reasoning(message)
        if reasoning:
            output.append(_reasoning_item(ids.reasoning(), answer.call_id, reasoning, opts))
        content = message.get("content")
        if isinstance(content, str) and content:
            output.append(_message_item(ids.message(), content, "completed"))
        for k, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function") or {}
            output.append(
                _call_item(
                    ids.call(k, fn.get("name"), opts),
                    call.get("id") or "",
                    fn.get("name") or "",
                    fn.get("arguments") or "",
                    opts,
                )
            )
        incomplete = answer.finish_reason == "length"
        return _response(
            request,
            answer,
            status="incomplete" if incomplete else "completed",
            output=output,
            usage=_usage(answer.usage),
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        )

    def stream_encoder(self, request: FrontRequest, answer_head: Answer) -> ResponsesStream:
        return ResponsesStream(self, request, answer_head)

    def error_body(
        self, status: int, message: str, *, error_type: str, param: str | None, code: str | None
    ) -> dict[str, Any]:
        return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


RESPONSES_CODEC = ResponsesCodec()


# -- encode ------------------------------------------------------------------------------------


def _options(request: FrontRequest) -> ResponsesOptions:
    opts = request.options
    return opts if isinstance(opts, ResponsesOptions) else ResponsesOptions()


def _answer_reasoning(message: Mapping[str, Any]) -> str:
    text = message.get("reasoning_content")
    if text is None:
        text = message.get("reasoning")
    return text if isinstance(text, str) else ""


class _Ids:
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


def _reasoning_item(
    item_id: str, call_id: str, text: str, opts: ResponsesOptions
) -> dict[str, Any]:
    item: dict[str, Any] = {
        "id": item_id,
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": text}] if opts.reasoning_summary else [],
        "content": [{"type": "reasoning_text", "text": text}],
    }
    if opts.encrypted_reasoning:
        item["encrypted_content"] = seal_reasoning(call_id, text)
    return item


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [_text_part(text)],
    }


def custom_tool_input(arguments: str) -> str:
    """The freeform input of a custom tool call whose chat arguments are ``{"input": ...}``;
    arguments of another shape are passed as they are."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments


def _call_item(
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


def _usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
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


def _response(
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
        "id": _Ids(answer.call_id).response(),
        "object": "response",
        "created_at": int(answer.created_at),
        "status": status,
        "error": None,
        "incomplete_details": incomplete_details,
        "instructions": got.get("instructions"),
        "max_output_tokens": got.get("max_output_tokens"),
        "model": answer.model or request.chat.get("model"),
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


# -- streaming ---------------------------------------------------------------------------------


@dataclass
class _Open:
    """The item being streamed for text or reasoning."""

    kind: str  # "text" | "reasoning"
    item_id: str
    output_index: int
    parts: list[str] = field(default_factory=list)


@dataclass
class _Call:
    """One tool call of the answer, by its chat ``index``."""

    index: int
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    item_id: str = ""
    output_index: int = -1  # -1: no item added yet
    done: bool = False


class ResponsesStream:
    """Chat deltas in, Responses SSE events out (see the module docstring for what Codex
    reads). A text or reasoning item is closed when a delta of another kind arrives; tool
    call items (several may interleave) when the answer finishes: text or reasoning that
    comes while calls stream is held and sent after them. A call's item is added when its
    arguments start (its name is whole by then); a freeform tool's input is sent whole when
    its call closes, unwrapped from ``{"input": ...}``. Codex keeps the done items as the
    turn, so the deltas must add up to the answer; parts of the answer no delta carried are
    streamed by ``finish``."""

    def __init__(self, codec: ResponsesCodec, request: FrontRequest, head: Answer):
        self.codec = codec
        self.request = request
        self.head = head
        self.opts = _options(request)
        self.ids = _Ids(head.call_id)
        self.seq = 0
        self.outputs = 0
        self.open: _Open | None = None
        self.calls: dict[int, _Call] = {}
        self.seen: set[str] = set()  # kinds that had an item ("text", "reasoning")
        #: text and reasoning that came while a call's arguments streamed: sent after the
        #: calls close (parse gathers a turn's items by kind, so the order does not matter)
        self.held: list[tuple[str, str]] = []

    # -- events ----------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(data, kind)

    def _shell(self, status: str) -> dict[str, Any]:
        return _response(
            self.request, self.head, status=status, output=[], usage=None, incomplete_details=None
        )

    def start(self) -> list[bytes]:
        response = self._shell("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def delta(
        self,
        delta: Mapping[str, Any],
        *,
        token_ids: list[int] | None = None,
        log_probs: list[float | None] | None = None,
    ) -> list[bytes]:
        out: list[bytes] = []
        reasoning = delta.get("reasoning_content")
        if reasoning is None:
            reasoning = delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out += self._text_delta("reasoning", reasoning)
        content = delta.get("content")
        if isinstance(content, str) and content:
            out += self._text_delta("text", content)
        for raw in delta.get("tool_calls") or []:
            if isinstance(raw, Mapping):
                out += self._call_delta(raw)
        return out

    def finish(self, answer: Answer) -> list[bytes]:
        """Streams what the answer holds and no delta carried (an answer made whole at the
        end), closes what is open, and ends with ``response.completed`` = ``encode``."""
        out = self._close_calls()
        held, self.held = self.held, []
        for kind, text in held:
            out += self._text_delta(kind, text)
        message = answer.message
        reasoning = _answer_reasoning(message)
        if reasoning and "reasoning" not in self.seen:
            out += self._text_delta("reasoning", reasoning)
        content = message.get("content")
        if isinstance(content, str) and content and "text" not in self.seen:
            out += self._text_delta("text", content)
        for k, call in enumerate(message.get("tool_calls") or []):
            if k not in self.calls:
                fn = call.get("function") or {}
                out += self._call_delta(
                    {
                        "index": k,
                        "id": call.get("id"),
                        "function": {"name": fn.get("name"), "arguments": fn.get("arguments")},
                    }
                )
        out += self._close_text()
        out += self._close_calls()
        completed = self.codec.encode(self.request, answer)
        out.append(self._event("response.completed", response=completed))
        return out

    def error(self, message: str) -> bytes:
        """An ``error`` event (the API's) and ``response.failed`` (what Codex acts on: it
        retries a failed response whose code it does not know)."""
        error = {"code": "server_error", "message": message}
        failed = self._shell("failed")
        failed["error"] = error
        return self._event("error", param=None, **error) + self._event(
            "response.failed", response=failed
        )

    # -- text and reasoning ----------------------------------------------------------------

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        if any(c.output_index >= 0 and not c.done for c in self.calls.values()):
            self.held.append((kind, text))
            return []
        out: list[bytes] = []
        if self.open is not None and self.open.kind != kind:
            out += self._close_text()
        if self.open is None:
            out += self._open_text(kind)
        opened = self.open
        assert opened is not None
        opened.parts.append(text)
        where = {"item_id": opened.item_id, "output_index": opened.output_index}
        if kind == "text":
            out.append(
                self._event(
                    "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
                )
            )
        elif self.opts.reasoning_summary:
            out.append(
                self._event(
                    "response.reasoning_summary_text.delta", **where, summary_index=0, delta=text
                )
            )
        else:
            out.append(
                self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)
            )
        return out

    def _open_text(self, kind: str) -> list[bytes]:
        index = self.outputs
        self.outputs += 1
        item_id = self.ids.message() if kind == "text" else self.ids.reasoning()
        if kind in self.seen:  # a second item of a kind: the deltas came interleaved
            item_id = f"{item_id}_{index}"
        self.seen.add(kind)
        self.open = _Open(kind, item_id, index)
        where = {"item_id": item_id, "output_index": index}
        if kind == "text":
            item = _message_item(item_id, None, "in_progress")
            return [
                self._event("response.output_item.added", output_index=index, item=item),
                self._event(
                    "response.content_part.added", **where, content_index=0, part=_text_part("")
                ),
            ]
        added = [
            self._event(
                "response.output_item.added",
                output_index=index,
                item={"id": item_id, "type": "reasoning", "summary": []},
            )
        ]
        if self.opts.reasoning_summary:
            added.append(
                self._event(
                    "response.reasoning_summary_part.added",
                    **where,
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
            )
        return added

    def _close_text(self) -> list[bytes]:
        opened = self.open
        if opened is None:
            return []
        self.open = None
        text = "".join(opened.parts)
        where = {"item_id": opened.item_id, "output_index": opened.output_index}
        if opened.kind == "text":
            part = _text_part(text)
            item = _message_item(opened.item_id, text, "completed")
            return [
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self._event("response.content_part.done", **where, content_index=0, part=part),
                self._event(
                    "response.output_item.done", output_index=opened.output_index, item=item
                ),
            ]
        out = []
        if self.opts.reasoning_summary:
            out += [
                self._event(
                    "response.reasoning_summary_text.done", **where, summary_index=0, text=text
                ),
                self._event(
                    "response.reasoning_summary_part.done",
                    **where,
                    summary_index=0,
                    part={"type": "summary_text", "text": text},
                ),
            ]
        else:
            out.append(
                self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        item = _reasoning_item(opened.item_id, self.head.call_id, text, self.opts)
        out.append(
            self._event("response.output_item.done", output_index=opened.output_index, item=item)
        )
        return out

    # -- tool calls ------------------------------------------------------------------------

    def _call_delta(self, raw: Mapping[str, Any]) -> list[bytes]:
        index = raw.get("index", 0)
        if not _is_int(index):
            index = 0
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = _Call(index)
        elif call.done:  # more of a call after the answer finished: nothing to add it to
            return []
        if isinstance(raw.get("id"), str) and raw["id"]:
            call.call_id = raw["id"]
        fn = raw.get("function") or {}
        if isinstance(fn.get("name"), str):
            call.name += fn["name"]
        arguments = fn.get("arguments")
        if not isinstance(arguments, str) or not arguments:
            return []
        out: list[bytes] = []
        if call.output_index < 0:
            out += self._add_call(call)
        call.arguments.append(arguments)
        if call.name not in self.opts.custom_tools:
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.item_id,
                    output_index=call.output_index,
                    delta=arguments,
                )
            )
        return out

    def _add_call(self, call: _Call) -> list[bytes]:
        out = self._close_text()
        call.output_index = self.outputs
        self.outputs += 1
        call.item_id = self.ids.call(call.index, call.name, self.opts)
        item = _call_item(call.item_id, call.call_id, call.name, None, self.opts)
        out.append(
            self._event("response.output_item.added", output_index=call.output_index, item=item)
        )
        return out

    def _close_calls(self) -> list[bytes]:
        out: list[bytes] = []
        for index in sorted(self.calls):
            call = self.calls[index]
            if call.done:
                continue
            if call.output_index < 0:
                out += self._add_call(call)
            call.done = True
            arguments = "".join(call.arguments)
            item = _call_item(call.item_id, call.call_id, call.name, arguments, self.opts)
            where = {"item_id": call.item_id, "output_index": call.output_index}
            if item["type"] == "custom_tool_call":
                if item["input"]:
                    out.append(
                        self._event(
                            "response.custom_tool_call_input.delta", **where, delta=item["input"]
                        )
                    )
                out.append(
                    self._event(
                        "response.custom_tool_call_input.done", **where, input=item["input"]
                    )
                )
            else:
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        **where,
                        name=call.name,
                        arguments=arguments,
                    )
                )
            out.append(
                self._event("response.output_item.done", output_index=call.output_index, item=item)
            )
        return out
