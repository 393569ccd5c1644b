"""A Messages request's ``system`` and ``messages``, their content blocks, as canonical chat
messages.

Owns the validation of the messages and their blocks (errors name the field as a dotted path,
e.g. ``messages.3.content.1.type``, ``checks``), their mapping, what it records beside them
(``Collected``: the tool errors, reasoning hints and images), and ``MessagesMemo``, what the
next request of the session takes again of their conversion. Pure.

- ``system`` (a string or ``text`` blocks, joined with ``"\\n"``) -> one leading ``system``
  message. ``cache_control`` anywhere is ignored.
- a ``system`` message inside ``messages`` (Claude Code's ``# Environment`` block) -> a
  ``system`` message in its place (a string, or ``text`` blocks joined with ``"\\n"``).
- a ``user`` message -> its blocks in order: a run of ``text`` and ``image`` blocks -> one
  ``user`` message (text only: the texts joined with ``"\\n"``; with images: a list of parts,
  each run of texts joined with ``"\\n"`` into one text part, each image a canonical image part,
  ``core.images``); each ``tool_result`` -> a ``tool`` message (its ``text`` and ``image``
  content blocks, the same way). An ``image`` block's ``source`` is ``base64`` (``media_type``,
  ``data``) or ``url``; a ``file`` source, ``document`` and any other block is refused.
- ``tool_result.is_error``: chat templates have no place for it, so the tool message's text
  says it: ``"Error: "`` (``TOOL_ERROR_PREFIX``) is put before the result text, and the ids are
  listed in ``MessagesOptions.tool_errors``. The model sees what the harness meant; the
  stored conversation shows exactly what the model saw.
- an ``assistant`` message -> one assistant message: ``text`` blocks -> ``content`` (joined
  with ``""``: an answer's text blocks are one text, as Anthropic's SDKs' ``get_final_text``
  joins them, and a stream whose engine interleaved reasoning and text splits the answer's
  text where its kind changed; None when there is none but tool calls, else ``""``),
  ``thinking`` -> ``reasoning_content`` (joined with ``""`` likewise; each block's text is the
  one sealed in its ``signature`` when it is a value this proxy issued, since Claude Code's
  ``display: omitted`` leaves the visible text empty; else the visible text),
  ``redacted_thinking`` -> the sealed text when its ``data`` opens, else nothing;
  ``tool_use`` -> a tool call whose arguments are ``json.dumps(input, ensure_ascii=False)``
  (an ``{"INVALID_JSON": <text>}`` input, ``encode``'s wrapping, is unwrapped). What ``encode``
  emitted for an answer parses back to that answer's message (linking digests the content and
  the tool calls).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from capture_proxy.core.conversation import ChatMessage, ChatToolCall, tool_call
from capture_proxy.core.fronts.base import loads_or_none, open_reasoning
from capture_proxy.core.fronts.messages.checks import as_blocks, as_bool, as_object, as_str, fail
from capture_proxy.core.images import ImageCollector, ImageLimits, ImageRefused, joined_content

#: Put before a tool result's text when the harness marked it ``is_error``.
TOOL_ERROR_PREFIX = "Error: "
#: The key that wraps tool-call arguments that are not a JSON object.
INVALID_JSON_KEY = "INVALID_JSON"


def _block_type(block: Any, path: str) -> str:
    return as_str(as_object(block, path).get("type"), f"{path}.type")


def _texts(blocks: list[Any], path: str) -> str:
    """``text`` blocks joined with ``"\\n"``; anything else is refused."""
    parts = []
    for j, block in enumerate(blocks):
        p = f"{path}.{j}"
        kind = _block_type(block, p)
        if kind != "text":
            raise fail(f"{p}.type", f"only text can be captured, not {kind!r}")
        parts.append(as_str(block.get("text"), f"{p}.text"))
    return "\n".join(parts)


class Collected:
    """What parsing the messages found besides the canonical messages."""

    def __init__(self, images: ImageLimits | None = None) -> None:
        self.tool_errors: list[str] = []
        self.reasoning_hints: list[str] = []
        self.images = ImageCollector(images)


def _image_part(block: dict[str, Any], path: str, role: str, seen: Collected) -> dict[str, Any]:
    """An ``image`` block's canonical part (``source``: ``base64`` or ``url``); an image
    ``core.images`` refuses is named in this front's error style (``path: what``)."""
    source = as_object(block.get("source"), f"{path}.source")
    kind = as_str(source.get("type"), f"{path}.source.type")
    try:
        if kind == "base64":
            media_type = as_str(source.get("media_type"), f"{path}.source.media_type")
            return seen.images.base64(source.get("data"), media_type, f"{path}.source.data", role)
        if kind == "url":
            return seen.images.url(source.get("url"), f"{path}.source.url", role)
    except ImageRefused as exc:
        param = exc.param or path
        text = str(exc).removeprefix(f"'{param}'").removeprefix(":").strip()
        raise fail(param, text) from exc
    raise fail(
        f"{path}.source.type",
        f"must be base64 or url, not {kind!r} (the proxy keeps no uploaded files)",
    )


def _user_messages(content: Any, path: str, seen: Collected) -> list[ChatMessage]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    blocks = as_blocks(content, f"{path}.content")
    if not blocks:
        raise fail(f"{path}.content", "must not be empty")
    out: list[ChatMessage] = []
    parts: list[str | dict[str, Any]] = []
    for j, block in enumerate(blocks):
        p = f"{path}.content.{j}"
        kind = _block_type(block, p)
        if kind == "text":
            parts.append(as_str(block.get("text"), f"{p}.text"))
        elif kind == "image":
            parts.append(_image_part(block, p, "user", seen))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": joined_content(parts)})
                parts = []
            out.append(_tool_message(block, p, seen))
        else:
            raise fail(
                f"{p}.type", f"only text, image and tool_result can be captured, not {kind!r}"
            )
    if parts:
        out.append({"role": "user", "content": joined_content(parts)})
    return out


def _tool_content(raw: Any, path: str, seen: Collected) -> Any:
    """A ``tool_result``'s content: a string, or ``text`` and ``image`` blocks."""
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    parts: list[str | dict[str, Any]] = []
    for j, block in enumerate(as_blocks(raw, path, "text and image blocks")):
        p = f"{path}.{j}"
        kind = _block_type(block, p)
        if kind == "text":
            parts.append(as_str(block.get("text"), f"{p}.text"))
        elif kind == "image":
            parts.append(_image_part(block, p, "tool", seen))
        else:
            raise fail(f"{p}.type", f"only text and image can be captured, not {kind!r}")
    return joined_content(parts)


def _tool_message(block: dict[str, Any], path: str, seen: Collected) -> ChatMessage:
    tool_use_id = as_str(block.get("tool_use_id"), f"{path}.tool_use_id")
    content = _tool_content(block.get("content"), f"{path}.content", seen)
    is_error = block.get("is_error")
    if is_error is not None and as_bool(is_error, f"{path}.is_error"):
        seen.tool_errors.append(tool_use_id)
        if isinstance(content, str):
            content = TOOL_ERROR_PREFIX + content
        else:
            content = [{"type": "text", "text": TOOL_ERROR_PREFIX}, *content]
    return {"role": "tool", "tool_call_id": tool_use_id, "content": content}


def _unwrap_arguments(value: dict[str, Any]) -> str:
    """Tool-call arguments text from a ``tool_use`` ``input``: the wrapping ``encode`` uses for
    arguments that are not a JSON object is undone."""
    if set(value) == {INVALID_JSON_KEY} and isinstance(value[INVALID_JSON_KEY], str):
        raw = value[INVALID_JSON_KEY]
        if not isinstance(loads_or_none(raw), dict):
            return raw
    return json.dumps(value, ensure_ascii=False)


def _assistant_message(content: Any, path: str, seen: Collected) -> ChatMessage:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    blocks = as_blocks(content, f"{path}.content")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ChatToolCall] = []
    for j, block in enumerate(blocks):
        p = f"{path}.content.{j}"
        kind = _block_type(block, p)
        if kind == "text":
            texts.append(as_str(block.get("text"), f"{p}.text"))
        elif kind == "thinking":
            visible = as_str(block.get("thinking"), f"{p}.thinking")
            signature = block.get("signature")
            if signature is not None:
                as_str(signature, f"{p}.signature")
            opened = open_reasoning(signature)
            if opened is not None:
                seen.reasoning_hints.append(opened[0])
                reasoning.append(opened[1])
            elif visible:
                reasoning.append(visible)
        elif kind == "redacted_thinking":
            opened = open_reasoning(as_str(block.get("data"), f"{p}.data"))
            if opened is not None:
                seen.reasoning_hints.append(opened[0])
                reasoning.append(opened[1])
        elif kind == "tool_use":
            call_id = as_str(block.get("id"), f"{p}.id")
            name = as_str(block.get("name"), f"{p}.name")
            arguments = _unwrap_arguments(as_object(block.get("input"), f"{p}.input"))
            calls.append(tool_call(call_id, name, arguments))
        else:
            raise fail(
                f"{p}.type",
                f"only text, thinking and tool_use can be captured, not {kind!r}",
            )
    message: ChatMessage = {
        "role": "assistant",
        "content": "".join(texts) if texts else (None if calls else ""),
    }
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _system_message(system: Any) -> ChatMessage | None:
    if system is None:
        return None
    if isinstance(system, str):
        text = system
    else:
        text = _texts(as_blocks(system, "system", "text blocks"), "system")
    return {"role": "system", "content": text} if text else None


def _inline_system_message(content: Any, path: str) -> ChatMessage:
    """A ``role: "system"`` message inside ``messages`` (Claude Code 2.1.328 puts its
    ``# Environment`` block there, after the task) -> a ``system`` message in its place. Its
    content is a string or ``text`` blocks joined with ``"\\n"``: Claude Code sends it as a
    one-block list with ``cache_control`` first and as a plain string afterwards, which must
    give the same canonical message."""
    if isinstance(content, str):
        return {"role": "system", "content": content}
    blocks = as_blocks(content, f"{path}.content", "text blocks")
    return {"role": "system", "content": _texts(blocks, f"{path}.content")}


#: What one message became: its canonical messages, and the tool-error ids and reasoning hints
#: its conversion recorded (``Collected``)
_Converted = tuple[list[ChatMessage], tuple[str, ...], tuple[str, ...]]


@dataclass(slots=True, eq=False)
class MessagesMemo:
    """The conversion of one request's history, for the next request of its session
    (``known_bodies``: a message it repeats is the same object): ``system`` its ``system``
    value and ``system_message`` what that became; ``sources`` its messages (its own list,
    never changed) and ``outputs[i]`` what ``sources[i]`` became (None: not kept, as it held
    images, which the call's image collector must see). A message's conversion depends on its
    value only (its index names it in errors, and a message that converted has none)."""

    system: Any
    system_message: ChatMessage | None
    sources: list[Any]
    outputs: list[_Converted | None]


def _converted(raw: Any, path: str, seen: Collected) -> list[ChatMessage]:
    message = as_object(raw, path)
    role = message.get("role")
    if role == "user":
        return _user_messages(message.get("content"), path, seen)
    if role == "assistant":
        return [_assistant_message(message.get("content"), path, seen)]
    if role == "system":
        return [_inline_system_message(message.get("content"), path)]
    raise fail(f"{path}.role", f"must be user, assistant or system, not {role!r}")


def canonical_messages(
    body: dict[str, Any],
    raw_messages: list[Any],
    seen: Collected,
    earlier: MessagesMemo | None = None,
) -> tuple[list[ChatMessage], MessagesMemo]:
    """The canonical messages: ``system``, then each message of ``messages`` in order; and
    their ``MessagesMemo``. ``earlier``: an earlier request's memo: what it converted of the
    very objects this request repeats is taken (its records replayed into ``seen``), not
    converted again."""
    system_value = body.get("system")
    if earlier is not None and system_value is earlier.system:
        system = earlier.system_message
    else:
        system = _system_message(system_value)
    messages: list[ChatMessage] = [system] if system is not None else []
    sources = earlier.sources if earlier is not None else []
    outputs: list[_Converted | None] = []
    for i, raw in enumerate(raw_messages):
        kept = earlier.outputs[i] if earlier is not None and i < len(sources) else None
        if kept is not None and raw is sources[i]:
            converted, errors, hints = kept
            seen.tool_errors.extend(errors)
            seen.reasoning_hints.extend(hints)
        else:
            errors_at, hints_at = len(seen.tool_errors), len(seen.reasoning_hints)
            images_at = len(seen.images.paths)
            converted = _converted(raw, f"messages.{i}", seen)
            kept = None
            if len(seen.images.paths) == images_at:
                errors = tuple(seen.tool_errors[errors_at:])
                kept = (converted, errors, tuple(seen.reasoning_hints[hints_at:]))
        messages.extend(converted)
        outputs.append(kept)
    return messages, MessagesMemo(system_value, system, raw_messages, outputs)
