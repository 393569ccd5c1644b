"""A request's ``tool_choice`` and what it does to the answer, as vLLM 0.32's chat serving. Pure.

Owns the answer's rules that depend on the request's tools, ``tool_choice`` and
``parallel_tool_calls`` in exact-token mode, where the proxy parses the generation itself
(the family parser reads it as vLLM's tool-call parser does for ``auto``). vLLM 0.32's
non-streamed answer (``entrypoints/openai/chat_completion/serving.py``,
``chat_completion_full_generator``, over ``vllm/parser/abstract_parser.py``
``DelegatingParser._extract_tool_calls``), for the parsers the families follow (``hermes``,
``llama3_json``, ``qwen3_coder``: with a ``structural_tag_model``, so
``supports_required_and_named`` is off and ``required`` / a named function are parsed as
``auto``, in the model's own format):

- no ``tools`` (vLLM's ``tool_choice`` default is then ``none``) or ``tool_choice: "none"``:
  no tool calls; the content is the text after the reasoning, unparsed (``hermes``,
  ``llama3_json``), except for ``qwen3_coder`` (a parser-engine parser): without tools its
  content is ``auto``'s and the calls are dropped; with tools and ``none`` every call's markup
  is removed from the text and the rest is the content (``Qwen3CoderParser.stream_without_calls``);
- ``auto`` (or absent with tools): the family parser's answer;
- ``required`` and a named function: ``auto``'s answer, except that a generation with no call
  whose content is only whitespace has no content;
- ``parallel_tool_calls: false``: only the first call is kept
  (``maybe_filter_parallel_tool_calls``);
- the finish reason after a ``stop``: ``tool_calls`` for ``auto`` with a call and for
  ``required`` (with or without one), ``stop`` otherwise (a named function's call ends with
  ``stop``, as OpenAI's does); ``length`` and ``abort`` as the engine said.

The stream is the whole answer's (its deltas joined give the non-streamed message); vLLM's own
stream differs from its non-streamed answer in places (docs/families.md). The generation's
constraint is ``structural_tags``. Must not do I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from capture_proxy.families.parsing import (
    MessageDelta,
    OutputParser,
    ParsedMessage,
    ParsesByStream,
    StreamParser,
)

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: ``none`` also for a request without tools; ``name``: the named function;
    ``parallel``: ``parallel_tool_calls`` is not false; ``offered``: the request has tools."""

    mode: Mode
    name: str | None = None
    parallel: bool = True
    offered: bool = False

    def describe(self) -> str:
        return repr(self.name) if self.mode == "named" else repr(self.mode)


AUTO = ToolChoice("auto", offered=True)


def tool_choice_of(body: Mapping[str, Any]) -> ToolChoice:
    """The tool choice of a chat-completions body (validated: ``core.requests``)."""
    tools = body.get("tools")
    offered = bool(tools)
    parallel = body.get("parallel_tool_calls") is not False
    raw = body.get("tool_choice")
    if not offered or raw == "none":
        return ToolChoice("none", parallel=parallel, offered=offered)
    if isinstance(raw, Mapping):
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        return ToolChoice("named", str(name), parallel, offered)
    if raw == "required":
        return ToolChoice("required", parallel=parallel, offered=offered)
    return ToolChoice("auto", parallel=parallel, offered=offered)


def finish_reason(choice: ToolChoice, engine_reason: str | None, has_tool_calls: bool) -> str:
    """The answer's finish reason (module docstring)."""
    if engine_reason in ("length", "abort"):
        return engine_reason
    if choice.mode == "required":
        return "tool_calls"
    if choice.mode == "auto" and has_tool_calls:
        return "tool_calls"
    return "stop"


class _ChoiceStream:
    """The family stream's deltas as the tool choice answers them: calls after the first
    dropped when parallel calls are off (all of them for ``none``, for a parser without
    ``stream_without_calls``), and for ``required`` / a named function content held while it
    is only whitespace (no content when no call follows)."""

    def __init__(self, inner: StreamParser, choice: ToolChoice) -> None:
        self.inner = inner
        self.choice = choice
        self.hold = choice.mode in ("required", "named")
        self.space: list[MessageDelta] = []
        self.called = False

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        return self._pass(self.inner.feed(text, token_ids), final=False)

    def finish(self) -> list[MessageDelta]:
        return self._pass(self.inner.finish(), final=True)

    def _pass(self, deltas: list[MessageDelta], *, final: bool) -> list[MessageDelta]:
        out: list[MessageDelta] = []
        for d in deltas:
            if d.tool_call is not None:
                # none: a family without a call-free stream (harmony) still answers no call
                if self.choice.mode == "none":
                    continue
                if not self.choice.parallel and d.tool_call["index"] > 0:
                    continue
                self.called = True
                out += self._release()
            elif d.content is not None and self.hold:
                if not d.content.strip():
                    self.space.append(d)
                    continue
                out += self._release()
            out.append(d)
        if final and self.called:
            out += self._release()
        return out

    def _release(self) -> list[MessageDelta]:
        held, self.space, self.hold = self.space, [], False
        return held


class ChoiceParser(ParsesByStream):
    """The family parser answering for one request's tool choice (module docstring)."""

    def __init__(self, parser: OutputParser, choice: ToolChoice) -> None:
        self.parser = parser
        self.choice = choice
        self.family = parser.family

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> StreamParser:
        if self.choice.mode == "none":
            without = getattr(self.parser, "stream_without_calls", None)
            if without is not None:
                return without(
                    id_seed, tools, in_reasoning=in_reasoning, offered=self.choice.offered
                )
        return _ChoiceStream(
            self.parser.stream(id_seed, tools, in_reasoning=in_reasoning), self.choice
        )

    def parse(
        self,
        text: str,
        id_seed: str,
        *,
        token_ids: Sequence[int] = (),
        tools: Sequence[Any] | None = None,
        in_reasoning: bool = False,
    ) -> ParsedMessage:
        if self.choice == AUTO:
            return self.parser.parse(
                text, id_seed, token_ids=token_ids, tools=tools, in_reasoning=in_reasoning
            )
        return super().parse(text, id_seed, token_ids=token_ids, tools=tools,
                             in_reasoning=in_reasoning)  # fmt: skip


def choice_parser(parser: OutputParser, choice: ToolChoice) -> OutputParser:
    """``parser`` as it answers a request with this tool choice."""
    return parser if choice == AUTO else ChoiceParser(parser, choice)
