"""Qwen / Hermes output parser: ``<think>`` reasoning, text, ``<tool_call>{json}</tool_call>``.

The generation layout it inverts (Qwen2.5/Qwen3 with Hermes tool calls, and our ChatML
template in ``capture_proxy/templates``)::

    [ "<think>\\n" REASONING "\\n</think>\\n\\n" ] CONTENT
    [ ("\\n" if CONTENT) TOOL_CALL ("\\n" TOOL_CALL)* ]
    TOOL_CALL = "<tool_call>\\n" {"name": NAME, "arguments": {...}} "\\n</tool_call>"

Tool calls are read as vLLM 0.32's ``hermes`` tool parser reads them
(``vllm/tool_parsers/hermes_tool_parser.py``, non-streaming ``extract_tool_calls``, and the
serving layer around it), so the harness gets the answer the engine itself would give:

- the content is the text before the first ``<tool_call>``, as written (a newline before the
  call included); text after or between calls is not content; content that is only
  whitespace beside calls is no content;
- every ``<tool_call>`` opens a call that ends at the next ``</tool_call>``, or at the end of
  the generation when none follows (a model that stops on its end token without closing the
  call still calls the tool);
- each call's body is JSON holding ``name`` (a string) and ``arguments`` (any JSON value),
  and its arguments are ``json.dumps(arguments, ensure_ascii=False)`` (a string value is
  dumped as a JSON string again, as vLLM does);
- when any call's body is not that, there is no call at all and the whole text is content.

Reasoning (Qwen3): a generation that starts with ``<think>`` (or whose prompt opened the block)
is reasoning up to ``</think>``, or up to a ``<tool_call>`` written inside the block (vLLM's
``qwen3`` reasoning parser ends reasoning there too). The layout's newlines around the block are
markup here; vLLM's ``qwen3`` reasoning parser keeps them (docs/families.md, "Parsing").

A stream emits the content as it is decided (holding back only a partial ``<tool_call>`` and
content that is whitespace so far) and the tool calls at the end of the generation, when it is
known whether every call parses; each piece of text is looked at a bounded number of times. The
end-of-turn token is not part of the text this parser sees.
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


def hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one ``<tool_call>`` body as vLLM's hermes parser reads
    it, None when it is not a call (then vLLM makes no call of the whole generation)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or "arguments" not in obj:
        return None
    name = obj.get("name")
    if not isinstance(name, str):
        return None
    return name, json.dumps(obj["arguments"], ensure_ascii=False)


class HermesCalls:
    """The generation from its first ``<tool_call>`` on, fed piece by piece: each call's body
    is parsed once, when it closes (or at the end); the text between calls is kept only for
    the case that a call does not parse (then all of it is content)."""

    def __init__(self) -> None:
        self.raw: list[str] = []
        self.in_body = False
        self.tail = ""  # the last few characters searched, which may begin a marker
        self.body: list[str] = []
        self.calls: list[tuple[str, str] | None] = []

    def feed(self, text: str) -> None:
        self.raw.append(text)
        while text:
            marker = TC_CLOSE if self.in_body else TC_OPEN
            searched = self.tail + text
            idx = searched.find(marker)
            if idx < 0:
                if self.in_body:
                    self.body.append(text)
                self.tail = searched[len(searched) - _held_suffix(searched, marker) :]
                return
            rest = searched[idx + len(marker) :]
            if self.in_body:
                body = "".join(self.body) + text
                self.calls.append(hermes_call(body[: len(body) - len(searched) + idx]))
                self.body = []
            self.in_body = not self.in_body
            self.tail, text = "", rest

    def finish(self) -> list[tuple[str, str]] | None:
        """The calls, or None when one is not a call (the text is then ``text()``)."""
        if self.in_body:
            self.calls.append(hermes_call("".join(self.body)))
            self.in_body, self.body = False, []
        parsed = [c for c in self.calls if c is not None]
        return parsed if len(parsed) == len(self.calls) else None

    def text(self) -> str:
        return "".join(self.raw)


class QwenHermesStream:
    """Incremental parser for one generation (see the module docstring)."""

    def __init__(self, id_seed: str, *, in_reasoning: bool = False, calls: bool = True) -> None:
        self.id_seed = id_seed
        #: False: ``<tool_call>`` is text (a request without tools, or ``tool_choice`` none)
        self.reads_calls = calls
        # a prompt that opened <think> (Qwen3-2507 Thinking): the text starts as reasoning
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""  # undecided text before the calls (a partial marker)
        self.pending_newlines = 0  # newlines still to skip after "</think>"
        self.space = ""  # the content so far while it is only whitespace
        self.spoke = False  # content other than whitespace was emitted
        self.calls = HermesCalls()

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        if self.state == "calls":
            self.calls.feed(text)
            return []
        if self.state == "content" and self.spoke and not self.buf and text.find("<") < 0:
            # most tokens of an answer: content with nothing held and no marker begun (what
            # ``_step`` makes of it, without its scans)
            return [MessageDelta(content=text)] if text else []
        self.buf += text
        out: list[MessageDelta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[MessageDelta]:
        out: list[MessageDelta] = []
        while self._step(out, final=True):
            pass
        if self.state != "calls":
            if self.buf:
                if self.state == "reasoning":
                    out.append(MessageDelta(reasoning=self.buf))
                else:
                    self._content(out, self.buf)
                self.buf = ""
            if self.space:
                out.append(MessageDelta(content=self.space))
            return out
        calls = self.calls.finish()
        if calls is None:
            # vLLM: a block that is not a call leaves the whole text as content
            out.append(MessageDelta(content=self.space + self.calls.text()))
            return out
        for index, (name, arguments) in enumerate(calls):
            out += tool_call_deltas(self.id_seed, index, name, arguments)
        return out

    # One transition; returns True when it consumed something and may continue.
    def _step(self, out: list[MessageDelta], *, final: bool) -> bool:
        buf = self.buf
        if not buf or self.state == "calls":
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
            return self._reasoning(out, final)
        if self.state == "after_think":
            while self.pending_newlines and self.buf.startswith("\n"):
                self.buf = self.buf[1:]
                self.pending_newlines -= 1
            if self.pending_newlines and not self.buf and not final:
                return False
            self.pending_newlines = 0
            self.state = "content"
            return bool(self.buf)
        if not self.reads_calls:
            self._content(out, buf)
            self.buf = ""
            return False
        # content: up to the first <tool_call>
        idx = buf.find(TC_OPEN)
        if idx >= 0:
            self._content(out, buf[:idx])
            self._to_calls(buf[idx:])
            return False
        held = 0 if final else _held_suffix(buf, TC_OPEN)
        self._content(out, buf[: len(buf) - held])
        self.buf = buf[len(buf) - held :]
        return False

    def _reasoning(self, out: list[MessageDelta], final: bool) -> bool:
        """Reasoning up to ``</think>`` (the newline before it is markup) or a ``<tool_call>``."""
        buf = self.buf
        close, call = buf.find(THINK_CLOSE), buf.find(TC_OPEN)
        if call >= 0 and (close < 0 or call < close):
            if call:
                out.append(MessageDelta(reasoning=buf[:call]))
            if not self.reads_calls:
                # vLLM's qwen3 reasoning parser ends the reasoning at a call all the same
                self.buf, self.state = buf[call:], "content"
                return True
            self._to_calls(buf[call:])
            return False
        if close >= 0:
            text = buf[:close]
            if text.endswith("\n"):
                text = text[:-1]
            if text:
                out.append(MessageDelta(reasoning=text))
            self.buf = buf[close + len(THINK_CLOSE) :]
            self.state, self.pending_newlines = "after_think", 2
            return True
        if final:
            return False
        held = max(
            _held_suffix(buf, "\n" + THINK_CLOSE),
            _held_suffix(buf, THINK_CLOSE),
            _held_suffix(buf, TC_OPEN),
        )
        if len(buf) > held:
            out.append(MessageDelta(reasoning=buf[: len(buf) - held]))
            self.buf = buf[len(buf) - held :]
        return False

    def _to_calls(self, text: str) -> None:
        self.buf, self.state = "", "calls"
        self.calls.feed(text)

    def _content(self, out: list[MessageDelta], text: str) -> None:
        """Emit content, holding it while it is only whitespace: beside tool calls such
        content is no content (vLLM), and whether calls follow is not known yet."""
        if not text:
            return
        if not self.spoke:
            if not text.strip():
                self.space += text
                return
            text, self.space, self.spoke = self.space + text, "", True
        out.append(MessageDelta(content=text))


class QwenHermesParser(ParsesByStream):
    family = "qwen"
    #: vLLM's ``structural_tag_model`` of the tool parser (``families.structural_tags``)
    tool_call_format = "hermes"

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> QwenHermesStream:
        return QwenHermesStream(id_seed, in_reasoning=in_reasoning)

    def stream_without_calls(
        self,
        id_seed: str,
        tools: Sequence[Any] | None = None,
        *,
        in_reasoning: bool = False,
        offered: bool = False,
    ) -> QwenHermesStream:
        """No tools or ``tool_choice`` none (``families.tool_choice``): the reasoning as
        always, the rest content as written."""
        return QwenHermesStream(id_seed, in_reasoning=in_reasoning, calls=False)


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
