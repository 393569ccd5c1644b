"""Turning a scripted assistant message into the tokens a model would have sampled.

Owns: the generation token ids (``encode(render_assistant_generation(msg)) + [<|im_end|>]``),
synthetic deterministic log probs, and per-token events (the reasoning / content text and
completed tool calls each token reveals, decoded incrementally like vLLM's detokenizer:
a partial UTF-8 character is held back until complete). Streaming and non-streaming answers
are both built from these events, so they agree by construction.
Must not: import aiohttp or do I/O.
"""

from __future__ import annotations

import codecs
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerFast

from capture_proxy.families.qwen3 import content_text, render_assistant_generation, render_tool_call
from capture_proxy.families.qwen_vocab import (
    BYTE_DECODER,
    IM_END_ID,
    SPECIAL_START_ID,
)


@dataclass(frozen=True)
class TokenEvent:
    """What one generated token reveals. ``tool_calls``: the calls it completes, each
    ``{index, id, type, function: {name, arguments}}`` (the last token of a
    ``<tool_call>...</tool_call>`` block; a parser that decides its calls at the end of the
    generation completes all of them on the last token)."""

    token_id: int
    logprob: float
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Generation:
    """A finished (or length-truncated) generation. ``log_probs[i]`` belongs to
    ``token_ids[i]``; ``message`` is the assistant message assembled from ``events``."""

    token_ids: list[int]
    log_probs: list[float]
    events: list[TokenEvent]
    finish_reason: str  # "stop" | "tool_calls" | "length" | "abort"
    message: dict[str, Any] = field(default_factory=dict)

    def aborted(self, num_tokens: int) -> Generation:
        """The first ``num_tokens`` tokens only, finish ``"abort"`` (a pause in abort mode)."""
        events = self.events[:num_tokens]
        return Generation(
            token_ids=[e.token_id for e in events],
            log_probs=[e.logprob for e in events],
            events=events,
            finish_reason="abort",
            message=assemble_message(events),
        )

    def after(self, num_tokens: int) -> Generation:
        """What is left after the first ``num_tokens`` tokens (a generation continued from
        them: the same tokens and log probs as uninterrupted)."""
        events = self.events[num_tokens:]
        return Generation(
            token_ids=[e.token_id for e in events],
            log_probs=[e.logprob for e in events],
            events=events,
            finish_reason=self.finish_reason,
            message=assemble_message(events),
        )


def synthetic_logprob(token_id: int, position: int) -> float:
    """Deterministic, finite log prob in (-5, 0] from (token id, position in generation)."""
    return -((token_id * 7919 + position * 104729) % 4999) / 1000.0


def token_bytes(tokenizer: PreTrainedTokenizerFast, token_id: int) -> bytes:
    """The raw bytes of one token (added tokens: their UTF-8 text)."""
    piece = str(tokenizer.convert_ids_to_tokens(token_id))
    if token_id >= SPECIAL_START_ID:
        return piece.encode("utf-8")
    return bytes(BYTE_DECODER[c] for c in piece)


def _regions(message: dict[str, Any]) -> list[tuple[int, int, Any]]:
    """Character spans of the generation text: (start, end, "reasoning"|"content"|int call)."""
    out: list[tuple[int, int, Any]] = []
    pos = 0
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        pos += len("<think>\n")
        out.append((pos, pos + len(reasoning), "reasoning"))
        pos += len(reasoning) + len("\n</think>\n\n")
    content = content_text(message.get("content"))
    out.append((pos, pos + len(content), "content"))
    pos += len(content)
    for i, call in enumerate(message.get("tool_calls") or []):
        if i > 0 or content:
            pos += 1
        n = len(render_tool_call(call))
        out.append((pos, pos + n, i))
        pos += n
    return out


def _parsed_arguments_call(call: dict[str, Any]) -> dict[str, Any]:
    """The tool call as vLLM's hermes parser returns it: the arguments the model wrote, parsed
    and re-dumped (``json.dumps(..., ensure_ascii=False)``); unparseable text is kept."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.dumps(json.loads(args), ensure_ascii=False)
    elif args is not None:
        args = json.dumps(args, ensure_ascii=False)
    return {**call, "function": {**fn, "arguments": args}}


def _encode(
    tokenizer: PreTrainedTokenizerFast, text: str, regions: list[tuple[int, int, Any]], split: str
) -> list[int]:
    """Canonical ids for ``text``, or with ``split == "characters"`` the content region encoded
    one character at a time (same text, non-canonical ids)."""
    if split == "canonical":
        return list(tokenizer.encode(text, add_special_tokens=False))
    c0, c1 = next((r0, r1) for r0, r1, kind in regions if kind == "content")
    ids = list(tokenizer.encode(text[:c0], add_special_tokens=False))
    for ch in text[c0:c1]:
        ids += tokenizer.encode(ch, add_special_tokens=False)
    return ids + list(tokenizer.encode(text[c1:], add_special_tokens=False))


#: what opens a Qwen3 turn's reasoning (dropped when the prompt opened it)
THINK_PREFIX = "<think>\n"


def generate(
    tokenizer: PreTrainedTokenizerFast,
    message: dict[str, Any],
    max_tokens: int | None = None,
    *,
    token_split: str = "canonical",
    reasoning_opened: bool = False,
) -> Generation:
    """Tokens, log probs and events for ``message`` (an assistant message with tool-call ids),
    truncated to ``max_tokens`` (finish "length"). ``token_split``: "canonical" or
    "characters" (see ``Step.token_split``). ``reasoning_opened``: the prompt already opened
    the think block (Qwen3-2507 Thinking), so the model writes from inside it, without
    ``<think>\n``. Raises ValueError if the text does not survive encode/decode (not NFC)."""
    text = render_assistant_generation(message)
    regions = _regions(message)
    if reasoning_opened and text.startswith(THINK_PREFIX):
        cut = len(THINK_PREFIX)
        text = text[cut:]
        regions = [(max(r0 - cut, 0), max(r1 - cut, 0), kind) for r0, r1, kind in regions]
    ids = _encode(tokenizer, text, regions, token_split) + [IM_END_ID]
    calls = message.get("tool_calls") or []
    decoder = codecs.getincrementaldecoder("utf-8")()
    events: list[TokenEvent] = []
    pos = 0
    for k, tid in enumerate(ids):
        new = decoder.decode(token_bytes(tokenizer, tid)) if tid != IM_END_ID else ""
        if text[pos : pos + len(new)] != new:
            raise ValueError(f"generation text does not round-trip at char {pos}: {new!r}")
        start, pos = pos, pos + len(new)
        parts = {"reasoning": "", "content": ""}
        done_call = None
        for r0, r1, kind in regions:
            if isinstance(kind, str):
                parts[kind] += text[max(r0, start) : min(r1, pos)]
            elif start < r1 <= pos:
                done_call = {"index": kind, **_parsed_arguments_call(calls[kind])}
        lp = synthetic_logprob(tid, k)
        done = (done_call,) if done_call is not None else ()
        events.append(TokenEvent(tid, lp, parts["reasoning"], parts["content"], done))
    if pos != len(text):
        raise ValueError("generation text does not round-trip")
    finish = "tool_calls" if calls else "stop"
    if max_tokens is not None and len(ids) > max_tokens:
        events, finish = events[:max_tokens], "length"
    return Generation(
        token_ids=[e.token_id for e in events],
        log_probs=[e.logprob for e in events],
        events=events,
        finish_reason=finish,
        message=assemble_message(events),
    )


def assemble_message(events: list[TokenEvent]) -> dict[str, Any]:
    """The assistant message (vLLM shape) these events spell: content None when empty with
    tool calls; ``reasoning_content`` only when there is reasoning."""
    content = "".join(e.content for e in events)
    reasoning = "".join(e.reasoning for e in events)
    calls = [{k: v for k, v in c.items() if k != "index"} for e in events for c in e.tool_calls]
    msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:
        msg["reasoning_content"] = reasoning
    msg["tool_calls"] = calls
    return msg
