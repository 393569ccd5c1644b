"""vLLM's message normalisation before a chat template, for the proxy's own renders.

Owns what vLLM 0.32.0 does to a chat-completions request's messages and tools between the
request and ``tokenizer.apply_chat_template``, so that a local render (exact-token first calls
and tails, ``count_tokens``) gives the ids the engine would. Read from vLLM 0.32.0's sources:
``entrypoints/openai/chat_completion/protocol.py`` (``ChatCompletionRequest``'s
``_normalize_messages_before``: ``reasoning_content`` renamed to ``reasoning``),
``renderers/chat_utils.py`` (``_parse_chat_message_content``, ``_postprocess_messages``,
``_strip_claude_code_billing_header``), ``renderers/hf.py`` (``_detect_content_format``,
``safe_apply_chat_template``: developer messages as system when the template knows no
developer role; ``resolve_chat_template_kwargs``) and ``online_renderer.py`` /
``generate/base/protocol.py`` (tools as ``ChatCompletionToolsParam.model_dump()``).

Per message, as vLLM builds its ``ConversationMessage``:

- ``content``: None or absent becomes no parts; a string one text part. Text-like parts
  (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``) are kept; for a
  string-format template (one that never loops over a message's content) they are joined
  with ``"\\n"`` into one string (so null content renders as ``""``), for an openai-format
  template they stay ``[{"type": "text", "text": ...}]`` parts. A system message's text part
  that starts with Claude Code's ``x-anthropic-billing-header`` loses that first line.
- assistant: ``tool_calls`` kept when present and not null (an empty list is dropped);
  each call's ``function.arguments`` parsed from its JSON string into an object (invalid JSON,
  a non-object, null or "" become ``{}``, as vLLM coerces them); ``reasoning`` (or
  ``reasoning_content``) given to the template as both ``reasoning`` and
  ``reasoning_content``.
- images (an ``image_url`` part, as the engine gets it, or the proxy's canonical image part,
  ``core.images``): for an openai-format template ``{"type": "image"}`` in their place (vLLM's
  ``wrap_dicts``; the model's processor expands each template placeholder afterwards, see
  ``families.vision.expand_image_pads``); a string-format template inserts the model's own
  placeholder string, which this module does not know: refused (MessageError).
- tool: ``tool_call_id`` kept; text parts joined into one string even for openai-format
  templates, unless an image stands among them (then the parts are kept, as vLLM keeps a tool
  message's non-text parts).
- ``name`` (a string) kept on any role; every other key is dropped.
- developer: as system (and all system messages merged into one at the front, joined with
  ``"\\n\\n"``) when the template never names the ``developer`` role.

Tools: ``{"type": "function", "function": {"name", "description", "parameters"}}`` in that
order, missing description or parameters as null, ``strict`` / ``defer_loading`` only when
set; other keys dropped.

Pure: no I/O. Raises ``MessageError`` (a ValueError) for what vLLM refuses too (a tool call
that is not an object or not of type function, a content part that is not text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

#: content part types vLLM 0.32 reads as text (``chat_utils.TEXT_PART_TYPES``) and the key of
#: their text
TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
BILLING_HEADER = "x-anthropic-billing-header"
#: content part types that are images (vLLM's ``image_url`` and the proxy's canonical part)
IMAGE_PARTS = frozenset({"image_url", "image"})


class MessageError(ValueError):
    """A message vLLM would refuse (names the message and field)."""


def _part_text(part: Any, where: str) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise MessageError(f"{where}: a content part must be an object or a string")
    kind = part.get("type")
    key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None:
        raise MessageError(
            f"{where}: content part type {kind!r} is not text; exact-token rendering "
            "supports text parts only"
        )
    text = part.get(key)
    return text if isinstance(text, str) else None  # vLLM skips a text part without text


def _strip_billing_header(texts: list[str]) -> list[str]:
    out = []
    for text in texts:
        if text.startswith(BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def _has_image(message: Mapping[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(p, Mapping) and p.get("type") in IMAGE_PARTS for p in content
    )


def _parts(message: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """A message's text and image parts as vLLM hands an openai-format template them:
    ``{"type": "text", "text"}`` and ``{"type": "image"}``, in order."""
    out: list[dict[str, Any]] = []
    for i, part in enumerate(message.get("content") or []):
        if isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
            out.append({"type": "image"})
            continue
        text = _part_text(part, f"{where}.content.{i}")
        if text is not None:
            out.append({"type": "text", "text": text})
    return out


def _texts(message: Mapping[str, Any], where: str) -> list[str]:
    content = message.get("content")
    if content is None:
        parts: Sequence[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise MessageError(f"{where}.content: must be a string, an array of parts or null")
    texts = [
        t for i, p in enumerate(parts) if (t := _part_text(p, f"{where}.content.{i}")) is not None
    ]
    if message.get("role") == "system":
        texts = _strip_billing_header(texts)
    return texts


def template_arguments(value: Any) -> dict[str, Any]:
    """A tool call's arguments as vLLM gives them to the template: an object, else ``{}``."""
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def _tool_calls(calls: list[Any], where: str) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise MessageError(f"{where}.tool_calls.{i}: must be an object")
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise MessageError(f"{where}.tool_calls.{i}: only function tool calls render")
        out.append(
            {**call, "function": {**fn, "arguments": template_arguments(fn.get("arguments"))}}
        )
    return out


def normalise_message(
    message: Mapping[str, Any], content_format: ContentFormat, where: str = "message"
) -> dict[str, Any]:
    """One message as vLLM hands it to the template (see the module docstring). Raises
    MessageError."""
    role = message.get("role")
    content: Any
    if _has_image(message):
        if content_format != "openai":
            raise MessageError(
                f"{where}.content: images render only through a template that loops over "
                "content parts (the model's placeholder string is not known here)"
            )
        content = _parts(message, where)
    else:
        texts = _texts(message, where)
        if content_format == "openai" and role != "tool":
            content = [{"type": "text", "text": t} for t in texts]
        else:
            content = "\n".join(texts)
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            out["tool_calls"] = _tool_calls(calls, where)
        elif calls is not None and not isinstance(calls, list):
            raise MessageError(f"{where}.tool_calls: must be an array")
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``_convert_developer_to_system`` then ``_consolidate_system_messages``."""
    converted = [
        {k: v for k, v in {**m, "role": "system"}.items() if k != "tools"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = []
    for i in systems:
        content = converted[i].get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            texts.append(content)
    rest = [m for m in converted if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def normalise_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    content_format: ContentFormat = "string",
    developer_role: bool = True,
) -> list[dict[str, Any]]:
    """The messages as vLLM 0.32 gives them to a template whose content format is
    ``content_format`` (``detect_content_format``) and that knows the developer role or not
    (``names_developer_role``). Raises MessageError naming ``messages.N.field``."""
    out = [normalise_message(m, content_format, f"messages.{i}") for i, m in enumerate(messages)]
    if not developer_role and any(m["role"] == "developer" for m in out):
        out = _developer_as_system(out)
    return out


def normalise_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools as vLLM dumps them for the template (see the module docstring); None
    for none."""
    if not tools:
        return None
    out = []
    for tool in tools:
        fn = tool.get("function") or {}
        dumped: dict[str, Any] = {
            "name": fn.get("name"),
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        for key in ("strict", "defer_loading"):
            if fn.get(key) is not None:
                dumped[key] = fn[key]
        if tool.get("defer_loading") is not None and "defer_loading" not in dumped:
            dumped["defer_loading"] = tool["defer_loading"]
        entry: dict[str, Any] = {"type": "function", "function": dumped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


@lru_cache(maxsize=32)
def names_developer_role(template: str) -> bool:
    """vLLM's test for developer-role support: the template names ``"developer"``."""
    return '"developer"' in template or "'developer'" in template


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """``openai`` when the template loops over a message's content (so parts stay a list),
    else ``string`` (vLLM's ``_detect_content_format``, on jinja's syntax tree)."""
    from capture_proxy.families.template_ast import loops_over_content

    try:
        return "openai" if loops_over_content(template) else "string"
    except Exception:  # an unparsable template: vLLM's default
        return "string"
