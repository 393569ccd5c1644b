"""gpt-oss (harmony) output parser, through the ``openai-harmony`` library. Pure.

A gpt-oss generation is a run of harmony messages after the generation prompt
``<|start|>assistant``::

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>A<|call|>
    ... or <|channel|>final<|message|>CONTENT<|return|>

It is read from the token ids, not the text (the engine's text drops the special tokens that
carry the structure): ``parse_messages_from_completion_tokens`` for a whole generation,
``StreamableParser`` token by token for a stream. As vLLM maps harmony to chat completions:
``analysis`` is reasoning, ``final`` and ``commentary`` without a recipient (preambles) are
content, messages of one kind joined with ``"\\n"``; a ``commentary`` message to
``functions.NAME`` is a tool call whose arguments are the text the model wrote. A generation
the library cannot parse (the model wrote a malformed header) keeps the rest as content.
The encoding is passed in (loading it reads the vocabulary: ``renderers.harmony``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from openai_harmony import HarmonyEncoding, HarmonyError, Message, Role, StreamableParser

from capture_proxy.families.parsing import (
    MessageDelta,
    ParsedMessage,
    apply_deltas,
    tool_call_deltas,
    tool_call_id,
)

FUNCTIONS_PREFIX = "functions."


def _kind(channel: str | None, recipient: str | None) -> str:
    """``reasoning``, ``content`` or ``tool`` for a message's channel and recipient."""
    if recipient and recipient.startswith(FUNCTIONS_PREFIX):
        return "tool"
    return "reasoning" if channel == "analysis" else "content"


def _text(message: Message) -> str:
    return "".join(getattr(c, "text", "") for c in message.content)


class HarmonyStream:
    """Incremental parser for one generation (see the module docstring)."""

    def __init__(self, encoding: HarmonyEncoding, id_seed: str) -> None:
        self.encoding = encoding
        self.id_seed = id_seed
        self.parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self.broken: list[int] | None = None  # ids after a parse error, kept as content
        self.num_calls = 0
        self.done = 0  # messages already turned into deltas
        self.last_message: dict[str, int] = {}  # kind -> index of the message it came from

    def _text_delta(self, kind: str, text: str, out: list[MessageDelta]) -> None:
        at = len(self.parser.messages)
        if kind in self.last_message and self.last_message[kind] != at:
            text = "\n" + text
        self.last_message[kind] = at
        out.append(
            MessageDelta(content=text) if kind == "content" else MessageDelta(reasoning=text)
        )

    def _completed(self, out: list[MessageDelta]) -> None:
        for message in self.parser.messages[self.done :]:
            self.done += 1
            if _kind(message.channel, message.recipient) != "tool":
                continue
            name = (message.recipient or "")[len(FUNCTIONS_PREFIX) :]
            out += tool_call_deltas(self.id_seed, self.num_calls, name, _text(message))
            self.num_calls += 1

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        out: list[MessageDelta] = []
        for token_id in token_ids:
            if self.broken is not None:
                self.broken.append(int(token_id))
                continue
            try:
                self.parser.process(int(token_id))
            except HarmonyError:
                self.broken = [int(token_id)]
                continue
            delta = self.parser.last_content_delta
            kind = _kind(self.parser.current_channel, self.parser.current_recipient)
            if delta and kind != "tool":
                self._text_delta(kind, delta, out)
            self._completed(out)
        return out

    def finish(self) -> list[MessageDelta]:
        out: list[MessageDelta] = []
        if self.broken is None:
            # A generation cut short (length): the open tool call's text is kept as content.
            if (
                _kind(self.parser.current_channel, self.parser.current_recipient) == "tool"
                and self.parser.current_content
            ):
                self._text_delta("content", self.parser.current_content, out)
        else:
            text = self.encoding.decode_utf8(self.broken)
            if text:
                self._text_delta("content", text, out)
        return out


class HarmonyParser:
    family = "gpt_oss"

    def __init__(self, encoding: HarmonyEncoding) -> None:
        self.encoding = encoding

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> HarmonyStream:
        # harmony's generation prompt ends at <|start|>assistant: channels are in the tokens
        return HarmonyStream(self.encoding, id_seed)

    def parse(
        self,
        text: str,
        id_seed: str,
        *,
        token_ids: Sequence[int] = (),
        tools: Sequence[Any] | None = None,
        in_reasoning: bool = False,
    ) -> ParsedMessage:
        try:
            messages = self.encoding.parse_messages_from_completion_tokens(
                [int(t) for t in token_ids], Role.ASSISTANT
            )
        except HarmonyError:
            stream = self.stream(id_seed)
            return apply_deltas([*stream.feed(text, token_ids), *stream.finish()])
        texts: dict[str, list[str]] = {"reasoning": [], "content": []}
        calls: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            kind = _kind(message.channel, message.recipient)
            if kind != "tool":
                texts[kind].append(_text(message))
                continue
            cut_short = i == len(messages) - 1 and not _closed(token_ids, self.encoding)
            if cut_short:
                texts["content"].append(_text(message))
                continue
            calls.append(
                {
                    "id": tool_call_id(id_seed, len(calls)),
                    "type": "function",
                    "function": {
                        "name": (message.recipient or "")[len(FUNCTIONS_PREFIX) :],
                        "arguments": _text(message),
                    },
                }
            )
        return ParsedMessage(
            content="\n".join(texts["content"]),
            reasoning="\n".join(texts["reasoning"]) if texts["reasoning"] else None,
            tool_calls=calls,
        )


def _closed(token_ids: Sequence[int], encoding: HarmonyEncoding) -> bool:
    """True when the generation ends with a token that closes a message."""
    return bool(token_ids) and int(token_ids[-1]) in set(encoding.stop_tokens())
