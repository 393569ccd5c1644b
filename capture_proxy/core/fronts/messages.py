"""The Anthropic Messages front codec (``POST /v1/messages``, as Claude Code 2.1.328 sends it).

Owns the mapping between a Messages request and the canonical conversation (a chat body, see
``fronts.base``), the encoding of the canonical answer as a ``message`` or as its SSE events,
the ``count_tokens`` request and answer, and Anthropic's error shape. Pure: no I/O, no aiohttp.

Request mapping (errors name the field as a dotted path, e.g. ``messages.3.content.1.type``):

- ``system`` (a string or ``text`` blocks, joined with ``"\\n"``) -> one leading ``system``
  message. ``cache_control`` anywhere is ignored.
- a ``system`` message inside ``messages`` (Claude Code's ``# Environment`` block) -> a
  ``system`` message in its place (a string, or ``text`` blocks joined with ``"\\n"``).
- a ``user`` message -> its blocks in order: a run of ``text`` blocks -> one ``user`` message
  (joined with ``"\\n"``); each ``tool_result`` -> a ``tool`` message. Only text is captured:
  ``image``, ``document`` and any other block is refused.
- ``tool_result.is_error``: chat templates have no place for it, so the tool message's text
  says it: ``"Error: "`` (``TOOL_ERROR_PREFIX``) is put before the result text, and the ids are
  listed in ``MessagesOptions.tool_errors``. The model sees what the harness meant; the
  stored conversation shows exactly what the model saw.
- an ``assistant`` message -> one assistant message: ``text`` blocks -> ``content`` (joined;
  None when there is none but tool calls, else ``""``), ``thinking`` -> ``reasoning_content``
  (the text sealed in its ``signature`` when it is a value this proxy issued, since Claude
  Code's ``display: omitted`` leaves the visible text empty; else the visible text),
  ``redacted_thinking`` -> the sealed text when its ``data`` opens, else nothing;
  ``tool_use`` -> a tool call whose arguments are ``json.dumps(input, ensure_ascii=False)``.
  What ``encode`` emitted for an answer parses back to that answer's message (linking digests
  the content and the tool calls).
- ``tools``: custom tools -> chat function tools (``parameters`` = ``input_schema``); server
  tools (a ``type`` other than ``custom``, e.g. ``web_search_20250305``) cannot run behind an
  engine: left out of the chat tools, listed in ``MessagesOptions.server_tools`` and named by
  the call's ``tools_not_rendered`` diagnostic.
- ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` -> ``"auto"`` / ``"required"`` /
  ``{"type": "function", ...}`` / ``"none"``; ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``.
- ``stop_sequences`` -> ``stop``; ``temperature`` (0 to 1), ``top_p`` (above 0, at most 1),
  ``top_k`` (0 or more) as they are, each refused outside its range;
  ``thinking`` -> ``MessagesOptions.thinking`` and, when explicitly ``enabled`` / ``disabled``,
  ``chat_template_kwargs: {"enable_thinking": bool}`` (the vLLM chat-template kwarg that the
  Qwen3 templates read; ``adaptive`` leaves the template's default). ``metadata``,
  ``context_management``, ``service_tier`` and other fields are not sent to the engine (they
  stay in ``received``).

Answer mapping: a ``thinking`` block (the signature seals the call id and the reasoning text;
the visible text is ``""`` when the request asked ``display: omitted``), a ``text`` block, one
``tool_use`` block per tool call (ids unchanged). Tool-call arguments that are not a JSON
object (the engine's tool parser passed malformed model output through) cannot be an
Anthropic ``input``: they are sent wrapped as ``{"INVALID_JSON": "<raw text>"}``, the wrapping
Anthropic's fine-grained tool streaming docs suggest, and unwrapped again by ``parse`` so the
turn still digests as the model wrote it; empty arguments are ``{}``.

Streaming: each tool call's arguments are held until its block closes and sent as one
``input_json_delta`` (Anthropic's default tool streaming also buffers to validate the JSON), so
that the streamed blocks always equal ``encode``'s and a harness never receives JSON it cannot
parse. Text and thinking are forwarded as they arrive; the thinking block's
``signature_delta`` is sent when the block closes (it seals the whole text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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

#: Put before a tool result's text when the harness marked it ``is_error``.
TOOL_ERROR_PREFIX = "Error: "
#: The key that wraps tool-call arguments that are not a JSON object.
INVALID_JSON_KEY = "INVALID_JSON"

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


@dataclass(frozen=True)
class MessagesOptions:
    """What the encoder needs back, and what the request said that the engine does not see.

    ``thinking``: the request's ``thinking`` object; ``omit_thinking``: its ``display`` was
    ``omitted`` (thinking blocks carry ``""``, the signature still seals the text);
    ``server_tools``: tools left out of the chat tools; ``tool_errors``: ``tool_use_id`` of each
    ``tool_result`` marked ``is_error``; ``reasoning_hints``: call ids found in the thinking
    signatures this proxy issued (a hint, never a link); ``prefill``: the last message is an
    assistant turn (Anthropic continues it; a chat template renders it as a finished turn);
    ``count_tokens``: parsed from a ``count_tokens`` body."""

    thinking: dict[str, Any] | None = None
    omit_thinking: bool = False
    server_tools: tuple[dict[str, Any], ...] = ()
    tool_errors: tuple[str, ...] = ()
    reasoning_hints: tuple[str, ...] = ()
    prefill: bool = False
    count_tokens: bool = False


# -- validation helpers ------------------------------------------------------------------------


def _fail(path: str, what: str) -> InvalidFrontRequest:
    return InvalidFrontRequest(f"{path}: {what}", path)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _fail(path, f"must be a string, not {_type_name(value)}")
    return value


def _stop_sequence(value: Any, path: str) -> str:
    if not _str(value, path):
        raise _fail(path, "must not be empty (the engine refuses an empty stop string)")
    return value


def _obj(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, f"must be an object, not {_type_name(value)}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(path, f"must be an array, not {_type_name(value)}")
    return value


def _blocks(value: Any, path: str, what: str = "content blocks") -> list[Any]:
    """The blocks of a field that is a string (the caller takes that) or an array of blocks."""
    if not isinstance(value, list):
        raise _fail(path, f"must be a string or an array of {what}, not {_type_name(value)}")
    return value


def _int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, f"must be an integer, not {_type_name(value)}")
    return value


def _number(value: Any, path: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(path, f"must be a number, not {_type_name(value)}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, f"must be a boolean, not {_type_name(value)}")
    return value


def _block_type(block: Any, path: str) -> str:
    return _str(_obj(block, path).get("type"), f"{path}.type")


def _texts(blocks: list[Any], path: str) -> str:
    """``text`` blocks joined with ``"\\n"``; anything else is refused."""
    parts = []
    for j, block in enumerate(blocks):
        p = f"{path}.{j}"
        kind = _block_type(block, p)
        if kind != "text":
            raise _fail(f"{p}.type", f"only text can be captured, not {kind!r}")
        parts.append(_str(block.get("text"), f"{p}.text"))
    return "\n".join(parts)


# -- request -----------------------------------------------------------------------------------


class _Collected:
    """What parsing the messages found besides the canonical messages."""

    def __init__(self) -> None:
        self.tool_errors: list[str] = []
        self.reasoning_hints: list[str] = []


def _user_messages(content: Any, path: str, seen: _Collected) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    blocks = _blocks(content, f"{path}.content")
    if not blocks:
        raise _fail(f"{path}.content", "must not be empty")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        p = f"{path}.content.{j}"
        kind = _block_type(block, p)
        if kind == "text":
            texts.append(_str(block.get("text"), f"{p}.text"))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_message(block, p, seen))
        else:
            raise _fail(f"{p}.type", f"only text and tool_result can be captured, not {kind!r}")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_message(block: dict[str, Any], path: str, seen: _Collected) -> dict[str, Any]:
    tool_use_id = _str(block.get("tool_use_id"), f"{path}.tool_use_id")
    raw = block.get("content")
    if raw is None:
        text = ""
    elif isinstance(raw, str):
        text = raw
    else:
        text = _texts(_blocks(raw, f"{path}.content", "text blocks"), f"{path}.content")
    is_error = block.get("is_error")
    if is_error is not None and _bool(is_error, f"{path}.is_error"):
        seen.tool_errors.append(tool_use_id)
        text = TOOL_ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def _unwrap_arguments(value: dict[str, Any]) -> str:
    """Tool-call arguments text from a ``tool_use`` ``input``: the wrapping ``encode`` uses for
    arguments that are not a JSON object is undone."""
    if set(value) == {INVALID_JSON_KEY} and isinstance(value[INVALID_JSON_KEY], str):
        raw = value[INVALID_JSON_KEY]
        if not isinstance(_loads_or_none(raw), dict):
            return raw
    return json.dumps(value, ensure_ascii=False)


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _assistant_message(content: Any, path: str, seen: _Collected) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    blocks = _blocks(content, f"{path}.content")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        p = f"{path}.content.{j}"
        kind = _block_type(block, p)
        if kind == "text":
            texts.append(_str(block.get("text"), f"{p}.text"))
        elif kind == "thinking":
            visible = _str(block.get("thinking"), f"{p}.thinking")
            signature = block.get("signature")
            if signature is not None:
                _str(signature, f"{p}.signature")
            opened = open_reasoning(signature)
            if opened is not None:
                seen.reasoning_hints.append(opened[0])
                reasoning.append(opened[1])
            elif visible:
                reasoning.append(visible)
        elif kind == "redacted_thinking":
            opened = open_reasoning(_str(block.get("data"), f"{p}.data"))
            if opened is not None:
                seen.reasoning_hints.append(opened[0])
                reasoning.append(opened[1])
        elif kind == "tool_use":
            call_id = _str(block.get("id"), f"{p}.id")
            name = _str(block.get("name"), f"{p}.name")
            arguments = _unwrap_arguments(_obj(block.get("input"), f"{p}.input"))
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        else:
            raise _fail(
                f"{p}.type",
                f"only text, thinking and tool_use can be captured, not {kind!r}",
            )
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "\n".join(texts) if texts else (None if calls else ""),
    }
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _system_message(system: Any) -> dict[str, Any] | None:
    if system is None:
        return None
    if isinstance(system, str):
        text = system
    else:
        text = _texts(_blocks(system, "system", "text blocks"), "system")
    return {"role": "system", "content": text} if text else None


def _inline_system_message(content: Any, path: str) -> dict[str, Any]:
    """A ``role: "system"`` message inside ``messages`` (Claude Code 2.1.328 puts its
    ``# Environment`` block there, after the task) -> a ``system`` message in its place. Its
    content is a string or ``text`` blocks joined with ``"\\n"``: Claude Code sends it as a
    one-block list with ``cache_control`` first and as a plain string afterwards, which must
    give the same canonical message."""
    if isinstance(content, str):
        return {"role": "system", "content": content}
    blocks = _blocks(content, f"{path}.content", "text blocks")
    return {"role": "system", "content": _texts(blocks, f"{path}.content")}


def _tools(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat function tools, server tools)."""
    chat: list[dict[str, Any]] = []
    server: list[dict[str, Any]] = []
    for i, tool in enumerate(_list(raw, "tools")):
        p = f"tools.{i}"
        _obj(tool, p)
        kind = tool.get("type")
        if kind is not None and _str(kind, f"{p}.type") != "custom":
            server.append(tool)
            continue
        fn: dict[str, Any] = {"name": _str(tool.get("name"), f"{p}.name")}
        if tool.get("description") is not None:
            fn["description"] = _str(tool["description"], f"{p}.description")
        fn["parameters"] = _obj(tool.get("input_schema"), f"{p}.input_schema")
        chat.append({"type": "function", "function": fn})
    return chat, server


def _tool_choice(raw: Any, tool_names: Sequence[str], out: dict[str, Any]) -> None:
    choice = _obj(raw, "tool_choice")
    kind = _str(choice.get("type"), "tool_choice.type")
    if kind == "auto":
        value: Any = "auto"
    elif kind == "any":
        value = "required"
    elif kind == "tool":
        name = _str(choice.get("name"), "tool_choice.name")
        if name not in tool_names:
            raise _fail("tool_choice.name", f"{name!r} is not one of the (custom) tools")
        value = {"type": "function", "function": {"name": name}}
    elif kind == "none":
        value = "none"
    else:
        raise _fail("tool_choice.type", f"must be auto, any, tool or none, not {kind!r}")
    if kind == "any" and not tool_names:
        raise _fail("tool_choice.type", "any needs at least one (custom) tool")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and _bool(disable, "tool_choice.disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    if tool_names:
        out["tool_choice"] = value


def _thinking(raw: Any, out: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the thinking object, display omitted)."""
    thinking = _obj(raw, "thinking")
    kind = _str(thinking.get("type"), "thinking.type")
    if kind == "enabled":
        budget = _int(thinking.get("budget_tokens"), "thinking.budget_tokens")
        if budget < 1:
            raise _fail("thinking.budget_tokens", "must be positive")
        out["chat_template_kwargs"] = {"enable_thinking": True}
    elif kind == "disabled":
        out["chat_template_kwargs"] = {"enable_thinking": False}
    elif kind != "adaptive":
        raise _fail("thinking.type", f"must be enabled, disabled or adaptive, not {kind!r}")
    display = thinking.get("display")
    if display is not None:
        _str(display, "thinking.display")
    return thinking, display == "omitted"


def _parse(body: Any, *, count_tokens: bool) -> FrontRequest:
    _obj(body, "body")
    chat: dict[str, Any] = {"model": _str(body.get("model"), "model")}
    if not body.get("model"):
        raise _fail("model", "must not be empty")
    if not count_tokens:
        max_tokens = _int(body.get("max_tokens"), "max_tokens")
        if max_tokens < 1:
            raise _fail("max_tokens", "must be positive")

    raw_messages = _list(body.get("messages"), "messages")
    if not raw_messages:
        raise _fail("messages", "must not be empty")
    seen = _Collected()
    messages: list[dict[str, Any]] = []
    system = _system_message(body.get("system"))
    if system is not None:
        messages.append(system)
    for i, raw in enumerate(raw_messages):
        path = f"messages.{i}"
        message = _obj(raw, path)
        role = message.get("role")
        if role == "user":
            messages.extend(_user_messages(message.get("content"), path, seen))
        elif role == "assistant":
            messages.append(_assistant_message(message.get("content"), path, seen))
        elif role == "system":
            messages.append(_inline_system_message(message.get("content"), path))
        else:
            raise _fail(f"{path}.role", f"must be user, assistant or system, not {role!r}")
    chat["messages"] = messages
    if not count_tokens:
        chat["max_tokens"] = max_tokens

    server_tools: list[dict[str, Any]] = []
    names: list[str] = []
    if body.get("tools") is not None:
        tools, server_tools = _tools(body["tools"])
        if tools:
            chat["tools"] = tools
        names = [t["function"]["name"] for t in tools]
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], names, chat)

    stream = False
    if not count_tokens:
        if body.get("stop_sequences") is not None:
            stops = _list(body["stop_sequences"], "stop_sequences")
            chat["stop"] = [_stop_sequence(s, f"stop_sequences.{k}") for k, s in enumerate(stops)]
        if body.get("temperature") is not None:
            temperature = _number(body["temperature"], "temperature")
            if not 0 <= temperature <= 1:
                raise _fail("temperature", f"must be from 0 to 1, not {temperature}")
            chat["temperature"] = temperature
        if body.get("top_p") is not None:
            top_p = _number(body["top_p"], "top_p")
            if not 0 < top_p <= 1:
                # Anthropic documents [0, 1]; the engine (vLLM) refuses 0.
                raise _fail("top_p", f"must be greater than 0 and at most 1, not {top_p}")
            chat["top_p"] = top_p
        if body.get("top_k") is not None:
            top_k = _int(body["top_k"], "top_k")
            if top_k < 0:
                raise _fail("top_k", f"must be 0 or more, not {top_k}")
            chat["top_k"] = top_k
        if body.get("stream") is not None:
            stream = _bool(body["stream"], "stream")
        if stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}

    thinking: dict[str, Any] | None = None
    omit = False
    if body.get("thinking") is not None:
        thinking, omit = _thinking(body["thinking"], chat)

    options = MessagesOptions(
        thinking=thinking,
        omit_thinking=omit,
        server_tools=tuple(server_tools),
        tool_errors=tuple(seen.tool_errors),
        reasoning_hints=tuple(seen.reasoning_hints),
        prefill=raw_messages[-1].get("role") == "assistant",
        count_tokens=count_tokens,
    )
    if options.prefill and not count_tokens:
        # Anthropic continues a trailing assistant message (a prefill): vLLM's chat extras
        # ask the same of the template (and exact-token mode of its renderer).
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    received = {k: v for k, v in body.items() if k != "messages"}
    return FrontRequest(
        Api.MESSAGES, chat, stream, received, options, diagnostics=tools_not_rendered(server_tools)
    )


def parse_count_tokens(body: dict[str, Any]) -> FrontRequest:
    """``POST /v1/messages/count_tokens``: the same shapes as a Messages body, without
    ``max_tokens`` (ignored when present); sampling fields and ``stream`` are not read."""
    return _parse(body, count_tokens=True)


def encode_count_tokens(num_tokens: int) -> dict[str, Any]:
    """The ``count_tokens`` answer."""
    return {"input_tokens": num_tokens}


# -- answer ------------------------------------------------------------------------------------


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
    value = _loads_or_none(text)
    return value if isinstance(value, dict) else {INVALID_JSON_KEY: text}


def _tool_input_json(arguments: Any) -> str:
    """The ``partial_json`` text of a tool call: the arguments as the engine gave them when
    they are a JSON object, else the JSON of ``tool_input``."""
    if isinstance(arguments, str) and isinstance(_loads_or_none(arguments), dict):
        return arguments
    return json.dumps(tool_input(arguments), ensure_ascii=False)


def stop_reason(answer: Answer) -> str:
    """The Anthropic stop reason of a chat finish reason (``stop_sequence`` cannot be told
    apart: the canonical answer does not say which stop ended it)."""
    if answer.finish_reason == "length":
        return "max_tokens"
    if answer.message.get("tool_calls"):
        return "tool_use"
    return _STOP_REASONS.get(answer.finish_reason or "", "end_turn")


def _usage(answer: Answer) -> dict[str, int]:
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


def _tool_use_block(call_id: str, position: int, call: Mapping[str, Any]) -> dict[str, Any]:
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
        blocks.append(_tool_use_block(call_id, k, call))
    return blocks


def _options(request: FrontRequest) -> MessagesOptions:
    return request.options if isinstance(request.options, MessagesOptions) else MessagesOptions()


def _model(request: FrontRequest, answer: Answer) -> Any:
    return answer.model or request.chat.get("model")


def anthropic_error_body(message: str, error_type: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_type_for(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


class MessagesCodec:
    """Anthropic Messages (see the module docstring)."""

    api = Api.MESSAGES

    def parse(
        self,
        body: dict[str, Any],
        *,
        previous: list[dict[str, Any]] | None = None,
        known: KnownMessages | None = None,
    ) -> FrontRequest:
        return _parse(body, count_tokens=False)

    def parse_count_tokens(self, body: dict[str, Any]) -> FrontRequest:
        return parse_count_tokens(body)

    def encode_count_tokens(self, num_tokens: int) -> dict[str, Any]:
        return encode_count_tokens(num_tokens)

    def encode(self, request: FrontRequest, answer: Answer) -> dict[str, Any]:
        return {
            "id": message_id(answer.call_id),
            "type": "message",
            "role": "assistant",
            "model": _model(request, answer),
            "content": content_blocks(
                answer.call_id, answer.message, _options(request).omit_thinking
            ),
            "stop_reason": stop_reason(answer),
            "stop_sequence": None,
            "usage": _usage(answer),
        }

    def stream_encoder(self, request: FrontRequest, answer_head: Answer) -> MessagesStreamEncoder:
        return MessagesStreamEncoder(request, answer_head)

    def error_body(
        self, status: int, message: str, *, error_type: str, param: str | None, code: str | None
    ) -> dict[str, Any]:
        """Anthropic's shape; the type follows the status (``error_type`` is the OpenAI-style
        name the caller uses elsewhere); the param leads the message, as Anthropic's own
        messages name the field."""
        if param and param not in message:
            message = f"{param}: {message}"
        return anthropic_error_body(message, error_type_for(status))


# -- streaming ---------------------------------------------------------------------------------


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


class MessagesStreamEncoder:
    """Chat deltas in, Messages SSE events out: ``message_start`` and ``ping``; per block
    ``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` (a block closes
    when a delta of another kind, or of another tool call, starts); ``message_delta`` and
    ``message_stop`` in ``finish``. Tool-call fragments that arrive for a tool call whose block
    is closed are dropped (engines send each call's fragments together)."""

    def __init__(self, request: FrontRequest, head: Answer) -> None:
        self.call_id = head.call_id
        self.model = _model(request, head)
        self.omit = _options(request).omit_thinking
        self.head_usage = head.usage
        self.block: _Block | None = None
        self.next_index = 0
        self.tool_positions = 0  # tool blocks opened so far
        self.closed_tools: set[int] = set()

    # -- events

    def start(self) -> list[bytes]:
        usage = self.head_usage or {}
        message = {
            "id": message_id(self.call_id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": int(usage.get("prompt_tokens") or 0),
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
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
            partial = _tool_input_json("".join(block.text))
            out.append(self._delta(block, {"type": "input_json_delta", "partial_json": partial}))
        out.append(_event({"type": "content_block_stop", "index": block.index}))
        return out

    def _reasoning(self, text: str) -> list[bytes]:
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

    def _text(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        block = self.block
        if block is None or block.kind != "text":
            out += self._close()
            block = self._open("text")
            out.append(self._start(block, {"type": "text", "text": ""}))
        out.append(self._delta(block, {"type": "text_delta", "text": text}))
        return out

    def _tool_fragment(self, fragment: Mapping[str, Any], position: int) -> list[bytes]:
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

    def delta(
        self,
        delta: Mapping[str, Any],
        *,
        token_ids: list[int] | None = None,
        log_probs: list[float | None] | None = None,
    ) -> list[bytes]:
        out: list[bytes] = []
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            out += self._reasoning(reasoning)
        content = delta.get("content")
        if isinstance(content, str) and content:
            out += self._text(content)
        for k, fragment in enumerate(delta.get("tool_calls") or []):
            if isinstance(fragment, Mapping):
                out += self._tool_fragment(fragment, k)
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
        usage: dict[str, int] = {"output_tokens": _usage(answer)["output_tokens"]}
        if answer.usage:
            usage = {"input_tokens": _usage(answer)["input_tokens"], **usage}
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

    def error(self, message: str) -> bytes:
        return _event(anthropic_error_body(message, "api_error"))
