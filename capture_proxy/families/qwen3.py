"""Qwen / Hermes output parser: ``<think>`` reasoning, text, ``<tool_call>{json}</tool_call>``.

The generation layout it inverts (Qwen2.5/Qwen3 with Hermes tool calls, and our ChatML
template in ``capture_proxy/templates``)::

    [ "<think>\\n" REASONING "\\n</think>\\n\\n" ] CONTENT
    [ ("\\n" if CONTENT) TOOL_CALL ("\\n" TOOL_CALL)* ]
    TOOL_CALL = "<tool_call>\\n" {"name": NAME, "arguments": {...}} "\\n</tool_call>"

Tolerant of missing newlines around the markers. Tool-call arguments are re-dumped with
``json.dumps(..., ensure_ascii=False)`` as vLLM's hermes parser does; a block whose JSON does
not parse stays in the content as text (nothing generated is dropped). The end-of-turn token is
not part of the text this parser sees.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from capture_proxy.families.parsing import (
    MessageDelta,
    ParsesByStream,
    content_text,
    tool_call_deltas,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TC_OPEN, TC_CLOSE = "<tool_call>", "</tool_call>"


def _held_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class QwenHermesStream:
    """Incremental parser for one generation (see the module docstring). Subclasses change
    the tool-call body (``parse_call``) and the separator between content and the first call
    (``CONTENT_SEPARATOR``)."""

    CONTENT_SEPARATOR = "\n"

    def __init__(self, id_seed: str, *, in_reasoning: bool = False) -> None:
        self.id_seed = id_seed
        # a prompt that opened <think> (Qwen3-2507 Thinking): the text starts as reasoning
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""
        self.num_calls = 0
        self.pending_newlines = 0  # newlines still to skip after "</think>"

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        self.buf += text
        out: list[MessageDelta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[MessageDelta]:
        out: list[MessageDelta] = []
        while self._step(out, final=True):
            pass
        if self.buf:
            if self.state == "reasoning":
                out.append(MessageDelta(reasoning=self.buf))
            elif self.state == "tool":
                out.append(MessageDelta(content=TC_OPEN + self.buf))
            elif self.state != "between" or self.buf.strip():
                out.append(MessageDelta(content=self.buf))
            self.buf = ""
        return out

    # One transition; returns True when it consumed something and may continue.
    def _step(self, out: list[MessageDelta], *, final: bool) -> bool:
        buf = self.buf
        if not buf:
            return False
        if self.state == "start":
            if buf.startswith(THINK_OPEN):
                if len(buf) == len(THINK_OPEN) and not final:
                    return False
                self.buf = buf[len(THINK_OPEN) :]
                if self.buf.startswith("\n"):
                    self.buf = self.buf[1:]
                self.state = "reasoning"
                return True
            if THINK_OPEN.startswith(buf) and not final:
                return False
            self.state = "content"
            return True
        if self.state == "reasoning":
            return self._until(out, THINK_CLOSE, "reasoning", final)
        if self.state == "after_think":
            while self.pending_newlines and self.buf.startswith("\n"):
                self.buf = self.buf[1:]
                self.pending_newlines -= 1
            if self.pending_newlines and not self.buf and not final:
                return False
            self.pending_newlines = 0
            self.state = "content"
            return bool(self.buf)
        if self.state == "content":
            return self._until(out, TC_OPEN, "content", final)
        if self.state == "tool":
            end = buf.find(TC_CLOSE)
            if end < 0:
                return False
            self._emit_tool_call(out, buf[:end])
            self.buf = buf[end + len(TC_CLOSE) :]
            self.state = "between"
            return True
        if self.state == "between":
            stripped = buf.lstrip()
            if stripped.startswith(TC_OPEN):
                self.buf = stripped[len(TC_OPEN) :]
                self.state = "tool"
                return True
            if (not stripped or TC_OPEN.startswith(stripped)) and not final:
                return False
            # Text after the tool calls: keep it as content rather than lose it.
            self.state = "content"
            return True
        return False

    def _until(self, out: list[MessageDelta], marker: str, kind: str, final: bool) -> bool:
        """Emit text of ``kind`` up to ``marker`` (the separator before it is markup: one
        newline, or ``CONTENT_SEPARATOR`` before the first tool call)."""
        buf = self.buf
        sep = self.CONTENT_SEPARATOR if kind == "content" else "\n"
        idx = buf.find(marker)
        if idx >= 0:
            text = buf[:idx]
            if text.endswith(sep):
                text = text[: -len(sep)]
            elif text.endswith("\n"):
                text = text[:-1]
            self._emit(out, kind, text)
            self.buf = buf[idx + len(marker) :]
            if kind == "reasoning":
                self.state, self.pending_newlines = "after_think", 2
            else:
                self.state = "tool"
            return True
        if final:
            return False
        held = max(_held_suffix(buf, sep + marker), _held_suffix(buf, marker))
        safe = len(buf) - held
        if safe > 0:
            self._emit(out, kind, buf[:safe])
            self.buf = buf[safe:]
        return False

    @staticmethod
    def _emit(out: list[MessageDelta], kind: str, text: str) -> None:
        if text:
            out.append(
                MessageDelta(content=text) if kind == "content" else MessageDelta(reasoning=text)
            )

    def _emit_tool_call(self, out: list[MessageDelta], body: str) -> None:
        parsed = self.parse_call(body.strip("\n"))
        if parsed is None:
            out.append(MessageDelta(content=TC_OPEN + body + TC_CLOSE))
            return
        name, arguments = parsed
        out += tool_call_deltas(self.id_seed, self.num_calls, name, arguments)
        self.num_calls += 1

    def parse_call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON text) of one tool-call body, None when it is not one."""
        return _parse_call(body)


def _parse_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = obj.get("arguments", {})
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return obj["name"], arguments


class QwenHermesParser(ParsesByStream):
    family = "qwen"

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> QwenHermesStream:
        return QwenHermesStream(id_seed, in_reasoning=in_reasoning)



def render_tool_call(call: Mapping[str, Any]) -> str:
    """``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>``; A verbatim if a string."""
    fn = call.get("function", call)
    args = fn.get("arguments")
    if args is None:
        args = {}
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args_text}}}\n</tool_call>'


def render_assistant_generation(message: Mapping[str, Any]) -> str:
    """The exact text a Qwen3 model writes for an assistant turn (after
    ``<|im_start|>assistant\\n``, without ``<|im_end|>``): ``<think>\\nR\\n</think>\\n\\n`` if
    it has ``reasoning_content`` (or ``reasoning``), then the content, then each tool call,
    with "\\n" before a tool call unless it comes first with no content. This is the layout
    of the published Qwen3 templates (hybrid, 2507) and of our keep_reasoning template."""
    out = ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        out += f"<think>\n{reasoning}\n</think>\n\n"
    content = content_text(message.get("content"))
    out += content
    for i, call in enumerate(message.get("tool_calls") or []):
        if i > 0 or content:
            out += "\n"
        out += render_tool_call(call)
    return out


#: Qwen3 with Hermes JSON tool calls
write_qwen3 = render_assistant_generation
