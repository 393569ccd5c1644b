"""The parser interface and the message it produces. Pure."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


def tool_call_id(seed: str, index: int) -> str:
    """OpenAI-format tool-call id: ``call_`` + 24 hex chars, deterministic in (seed, index), so
    a streamed and a non-streamed parse of one call agree."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


@dataclass
class ParsedMessage:
    """An assistant message: ``content`` ("" when none), ``reasoning`` (None when none),
    ``tool_calls`` in OpenAI shape (``{id, type, function: {name, arguments}}``)."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        """Chat-completions ``message`` as vLLM sends it: content null when empty with tool
        calls; ``reasoning_content`` only when there is reasoning."""
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": self.content or (None if self.tool_calls else ""),
        }
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        msg["tool_calls"] = self.tool_calls
        return msg


@dataclass(frozen=True)
class MessageDelta:
    """One streamed delta: exactly one of content, reasoning, tool_call is set. ``tool_call``
    is an OpenAI ``delta.tool_calls[]`` entry (``index``, and ``id``/``type``/``function``)."""

    content: str | None = None
    reasoning: str | None = None
    tool_call: dict[str, Any] | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.content is not None:
            return {"content": self.content}
        if self.reasoning is not None:
            return {"reasoning_content": self.reasoning}
        return {"tool_calls": [self.tool_call]}


class StreamParser(Protocol):
    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        """Text as it is generated, with the token ids it came from (text parsers read the
        text, token parsers such as harmony's the ids); returns what can be decided, holding
        back only what the parser must see more of (a partial ``<tool_call>``)."""

    def finish(self) -> list[MessageDelta]:
        """End of generation: flush whatever was held back."""


class OutputParser(Protocol):
    """``tools``: the request's tools (OpenAI shape), for formats whose argument types come
    from the schema (Qwen3-Coder's XML parameters); ``token_ids``: the generated ids, for
    formats parsed from tokens (harmony)."""

    family: str

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> StreamParser:
        """``in_reasoning``: the prompt already opened a reasoning block (Qwen3-2507
        Thinking's generation prompt ends ``<think>\\n``), so the generation starts inside it
        and its first ``</think>`` closes it."""
        ...

    def parse(
        self,
        text: str,
        id_seed: str,
        *,
        token_ids: Sequence[int] = (),
        tools: Sequence[Any] | None = None,
        in_reasoning: bool = False,
    ) -> ParsedMessage: ...


class ParsesByStream:
    """``OutputParser.parse`` written once for the text parsers: one stream (the subclass's
    ``stream``) fed the whole generation, then finished."""

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> StreamParser:
        raise NotImplementedError

    def parse(
        self,
        text: str,
        id_seed: str,
        *,
        token_ids: Sequence[int] = (),
        tools: Sequence[Any] | None = None,
        in_reasoning: bool = False,
    ) -> ParsedMessage:
        stream = self.stream(id_seed, tools, in_reasoning=in_reasoning)
        return apply_deltas([*stream.feed(text, token_ids), *stream.finish()])


def apply_deltas(deltas: list[MessageDelta]) -> ParsedMessage:
    """Concatenate deltas into a message (what a client does with a stream)."""
    msg = ParsedMessage()
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.content is not None:
            msg.content += d.content
        elif d.reasoning is not None:
            msg.reasoning = (msg.reasoning or "") + d.reasoning
        elif d.tool_call is not None:
            tc = d.tool_call
            slot = calls.setdefault(
                tc["index"],
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if tc.get("id"):
                slot["id"] = tc["id"]
            fn = tc.get("function") or {}
            slot["function"]["name"] += fn.get("name") or ""
            slot["function"]["arguments"] += fn.get("arguments") or ""
    msg.tool_calls = [calls[i] for i in sorted(calls)]
    return msg


def content_text(content: Any) -> str:
    """Text of an OpenAI message content: a string, None, or a list of parts (text parts
    joined with "\\n", as vLLM joins them for string-format templates)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(
        p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"
    )


def tool_call_deltas(id_seed: str, index: int, name: str, arguments: str) -> list[MessageDelta]:
    """One whole tool call as the two deltas a stream carries: its head (``index``, the
    deterministic ``id``, ``type``, the name with empty arguments), then its arguments."""
    head = {
        "index": index,
        "id": tool_call_id(id_seed, index),
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    return [
        MessageDelta(tool_call=head),
        MessageDelta(tool_call={"index": index, "function": {"arguments": arguments}}),
    ]
