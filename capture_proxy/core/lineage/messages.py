"""The parts of canonical messages that lineage compares, and their digests.

A harness that starts one conversation from another replays messages, but not byte for byte:
system prompts differ per conversation (Claude Code's billing header), thinking may be left
out, and so may the text beside a tool call (a Claude Code 2.1.328 fork replays the parent's
``Agent`` turn as its tool_use blocks alone), text blocks may be split or joined otherwise. So
a message is compared by its role and: an assistant turn with tool calls by its tool calls
(id, name, arguments as canonical JSON; the ids name the turn), any other message by its text
with whitespace runs collapsed and the tool call it answers. System and developer messages take
no part. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson

#: Roles left out of the compared history (they differ between conversations of one episode).
SKIPPED_ROLES = frozenset({"system", "developer"})


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a message's ``content`` (a string, or the text parts joined)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text") or "")
            for part in content
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text")
        )
    return ""


def text_parts(message: Mapping[str, Any]) -> list[str]:
    """Each text part of a message's ``content`` (the string itself when it is one)."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            str(part.get("text") or "")
            for part in content
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text")
        ]
    return []


def squash(text: str) -> str:
    """Whitespace runs collapsed to one space, ends stripped."""
    return " ".join(text.split())


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


def tool_calls(message: Mapping[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """``(tool_call_id, name, arguments)`` of each tool call; arguments parsed from JSON when
    they are a JSON string."""
    for call in message.get("tool_calls") or ():
        if not isinstance(call, Mapping):
            continue
        function = call.get("function")
        if not isinstance(function, Mapping):
            continue
        yield (
            str(call.get("id") or ""),
            str(function.get("name") or ""),
            _arguments(function.get("arguments")),
        )


def message_key(message: Mapping[str, Any]) -> bytes:
    """The compared form of one message, as bytes (see the module docstring)."""
    role = str(message.get("role") or "")
    if message.get("tool_calls"):
        calls = [[call_id, name, args] for call_id, name, args in tool_calls(message)]
        if calls:
            return _dumps([role, "", calls, ""])
    return _dumps([role, squash(message_text(message)), [], str(message.get("tool_call_id") or "")])


def _dumps(form: list[Any]) -> bytes:
    """orjson with sorted keys (arguments compare as canonical JSON); the stdlib for what orjson
    refuses (integers past 64 bits, lone surrogates)."""
    try:
        return orjson.dumps(form, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        text = json.dumps(form, sort_keys=True, ensure_ascii=False)
        return text.encode("utf-8", "surrogatepass")


def compared(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The messages that take part in the comparison (system and developer ones left out)."""
    return [m for m in messages if m.get("role") not in SKIPPED_ROLES]


def prefix_digests(keys: Sequence[bytes]) -> list[bytes]:
    """``out[k]``: the digest of the first ``k + 1`` compared messages (given by their
    ``message_key``), chained (sha256 of the previous digest and the key's), so each prefix
    costs one hash."""
    out: list[bytes] = []
    digest = b""
    for key in keys:
        digest = hashlib.sha256(digest + hashlib.sha256(key).digest()).digest()
        out.append(digest)
    return out
