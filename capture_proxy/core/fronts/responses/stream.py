"""Streaming a Responses answer: chat deltas in, the API's SSE events out.

Owns the order and shape of the events of one streamed answer, as Codex CLI reads them:
Codex (codex-rs ``sse/responses.rs``) builds its history from ``response.output_item.done``
items and ends a turn on ``response.completed`` (it reads only the response's ``id`` and
``usage``); it needs ``response.created``, takes text from ``response.output_text.delta``,
reasoning from ``response.reasoning_summary_text.delta`` (with ``summary_index``) or
``response.reasoning_text.delta`` (with ``content_index``), and treats ``response.failed`` as a
(retryable) error. It ignores ``error`` events and fails the turn on ``response.incomplete``;
so an answer cut at the token limit ends with ``response.completed`` whose response has
``status: "incomplete"``. Pure; the items themselves are ``encode``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.core.fronts.base import (
    Answer,
    FrontRequest,
    PartsStreamEncoder,
    is_int,
    sse_event,
)
from capture_proxy.core.fronts.responses.encode import (
    ItemIds,
    answer_reasoning,
    answered_response,
    call_item,
    message_item,
    options_of,
    reasoning_item,
    response_object,
    text_part,
)


@dataclass
class _Open:
    """The item being streamed for text or reasoning."""

    kind: str  # "text" | "reasoning"
    item_id: str
    output_index: int
    parts: list[str] = field(default_factory=list)


@dataclass
class _Call:
    """One tool call of the answer, by its chat ``index``."""

    index: int
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    item_id: str = ""
    output_index: int = -1  # -1: no item added yet
    done: bool = False


class ResponsesStream(PartsStreamEncoder):
    """Chat deltas in, Responses SSE events out (see the module docstring for what Codex
    reads). Items are streamed one after another, as the API does. A text or reasoning item
    is closed when a delta of another kind arrives; a tool call item when the answer
    finishes: text or reasoning that comes while a call streams is held and sent after the
    calls, and so is a second call that starts while one is open (its item added, its
    arguments in one delta and done after the open one's). A call's item is added when its
    arguments start (its name is whole by then); a freeform tool's input is sent whole when
    its call closes, unwrapped from ``{"input": ...}``. Codex keeps the done items as the
    turn, so the deltas must add up to the answer; parts of the answer no delta carried are
    streamed by ``finish``. ``response.completed``'s output is the done items, so interleaved
    deltas (text, a call, text again) give the same items there as in the done events (a
    second item of a kind has the id ``<kind's id>_<output index>``); a whole answer has
    one item per kind instead (``encode.output_items``): both parse back into the answer's
    message."""

    reads_reasoning_alias = True

    def __init__(self, request: FrontRequest, head: Answer):
        self.request = request
        self.head = head
        self.opts = options_of(request)
        self.ids = ItemIds(head.call_id)
        self.seq = 0
        self.outputs = 0
        self.open: _Open | None = None
        self.calls: dict[int, _Call] = {}
        self.seen: set[str] = set()  # kinds that had an item ("text", "reasoning")
        #: text and reasoning that came while a call's arguments streamed: sent after the
        #: calls close (parse gathers a turn's items by kind, so the order does not matter)
        self.held: list[tuple[str, str]] = []
        #: the items sent in ``response.output_item.done``, by output index: the output of
        #: ``response.completed``
        self.done_items: dict[int, dict[str, Any]] = {}

    # -- events ----------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(data, kind)

    def _shell(self, status: str) -> dict[str, Any]:
        return response_object(
            self.request, self.head, status=status, output=[], usage=None, incomplete_details=None
        )

    def start(self) -> list[bytes]:
        response = self._shell("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def reasoning_part(self, text: str) -> list[bytes]:
        return self._text_delta("reasoning", text)

    def text_part(self, text: str) -> list[bytes]:
        return self._text_delta("text", text)

    def tool_call_part(self, fragment: Mapping[str, Any], position: int) -> list[bytes]:
        return self._call_delta(fragment)

    def finish(self, answer: Answer) -> list[bytes]:
        """Streams what the answer holds and no delta carried (an answer made whole at the
        end), closes what is open, and ends with ``response.completed``: ``encode``'s
        response whose ``output`` is the items sent as done, in output-index order (the same
        ids and content: a client that keeps ``response.completed`` and one that keeps the
        done items, as Codex does, hold the same transcript)."""
        out = self._close_calls()
        held, self.held = self.held, []
        for kind, text in held:
            out += self._text_delta(kind, text)
        message = answer.message
        reasoning = answer_reasoning(message)
        if reasoning and "reasoning" not in self.seen:
            out += self._text_delta("reasoning", reasoning)
        content = message.get("content")
        if isinstance(content, str) and content and "text" not in self.seen:
            out += self._text_delta("text", content)
        for k, call in enumerate(message.get("tool_calls") or []):
            if k not in self.calls:
                fn = call.get("function") or {}
                out += self._call_delta(
                    {
                        "index": k,
                        "id": call.get("id"),
                        "function": {"name": fn.get("name"), "arguments": fn.get("arguments")},
                    }
                )
        out += self._close_text()
        out += self._close_calls()
        output = [self.done_items[index] for index in sorted(self.done_items)]
        completed = answered_response(self.request, answer, output)
        out.append(self._event("response.completed", response=completed))
        return out

    def error(self, message: str, *, code: str | None = None) -> bytes:
        """An ``error`` event (the API's) and ``response.failed`` (what Codex acts on: it
        retries a failed response whose code it does not know); ``code``: the proxy's, else
        ``server_error``."""
        error = {"code": code or "server_error", "message": message}
        failed = self._shell("failed")
        failed["error"] = error
        return self._event("error", param=None, **error) + self._event(
            "response.failed", response=failed
        )

    # -- text and reasoning ----------------------------------------------------------------

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        if any(c.output_index >= 0 and not c.done for c in self.calls.values()):
            self.held.append((kind, text))
            return []
        out: list[bytes] = []
        if self.open is not None and self.open.kind != kind:
            out += self._close_text()
        if self.open is None:
            out += self._open_text(kind)
        opened = self.open
        assert opened is not None
        opened.parts.append(text)
        where = {"item_id": opened.item_id, "output_index": opened.output_index}
        if kind == "text":
            out.append(
                self._event(
                    "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
                )
            )
        elif self.opts.reasoning_summary:
            out.append(
                self._event(
                    "response.reasoning_summary_text.delta", **where, summary_index=0, delta=text
                )
            )
        else:
            out.append(
                self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)
            )
        return out

    def _open_text(self, kind: str) -> list[bytes]:
        index = self.outputs
        self.outputs += 1
        item_id = self.ids.message() if kind == "text" else self.ids.reasoning()
        if kind in self.seen:  # a second item of a kind: the deltas came interleaved
            item_id = f"{item_id}_{index}"
        self.seen.add(kind)
        self.open = _Open(kind, item_id, index)
        where = {"item_id": item_id, "output_index": index}
        if kind == "text":
            item = message_item(item_id, None, "in_progress")
            return [
                self._event("response.output_item.added", output_index=index, item=item),
                self._event(
                    "response.content_part.added", **where, content_index=0, part=text_part("")
                ),
            ]
        added = [
            self._event(
                "response.output_item.added",
                output_index=index,
                item={"id": item_id, "type": "reasoning", "summary": []},
            )
        ]
        if self.opts.reasoning_summary:
            added.append(
                self._event(
                    "response.reasoning_summary_part.added",
                    **where,
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
            )
        return added

    def _close_text(self) -> list[bytes]:
        opened = self.open
        if opened is None:
            return []
        self.open = None
        text = "".join(opened.parts)
        where = {"item_id": opened.item_id, "output_index": opened.output_index}
        if opened.kind == "text":
            part = text_part(text)
            item = message_item(opened.item_id, text, "completed")
            self.done_items[opened.output_index] = item
            return [
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self._event("response.content_part.done", **where, content_index=0, part=part),
                self._event(
                    "response.output_item.done", output_index=opened.output_index, item=item
                ),
            ]
        out = []
        if self.opts.reasoning_summary:
            out += [
                self._event(
                    "response.reasoning_summary_text.done", **where, summary_index=0, text=text
                ),
                self._event(
                    "response.reasoning_summary_part.done",
                    **where,
                    summary_index=0,
                    part={"type": "summary_text", "text": text},
                ),
            ]
        else:
            out.append(
                self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        item = reasoning_item(opened.item_id, self.head.call_id, text, self.opts)
        self.done_items[opened.output_index] = item
        out.append(
            self._event("response.output_item.done", output_index=opened.output_index, item=item)
        )
        return out

    # -- tool calls ------------------------------------------------------------------------

    def _call_delta(self, raw: Mapping[str, Any]) -> list[bytes]:
        index = raw.get("index", 0)
        if not is_int(index):
            index = 0
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = _Call(index)
        elif call.done:  # more of a call after the answer finished: nothing to add it to
            return []
        if isinstance(raw.get("id"), str) and raw["id"]:
            call.call_id = raw["id"]
        fn = raw.get("function") or {}
        if isinstance(fn.get("name"), str):
            call.name += fn["name"]
        arguments = fn.get("arguments")
        if not isinstance(arguments, str) or not arguments:
            return []
        out: list[bytes] = []
        if call.output_index < 0:
            if any(c.output_index >= 0 and not c.done for c in self.calls.values()):
                # another call's item is open: this one is sent whole when that one closes
                # (the API streams one item after another, never two at once)
                call.arguments.append(arguments)
                return []
            out += self._add_call(call)
        call.arguments.append(arguments)
        if call.name not in self.opts.custom_tools:
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.item_id,
                    output_index=call.output_index,
                    delta=arguments,
                )
            )
        return out

    def _add_call(self, call: _Call) -> list[bytes]:
        out = self._close_text()
        call.output_index = self.outputs
        self.outputs += 1
        call.item_id = self.ids.call(call.index, call.name, self.opts)
        item = call_item(call.item_id, call.call_id, call.name, None, self.opts)
        out.append(
            self._event("response.output_item.added", output_index=call.output_index, item=item)
        )
        return out

    def _close_calls(self) -> list[bytes]:
        """Closes the calls not done, one item after another: the open one first, then each
        held one (added, its arguments in one delta, done), in the answer's order."""
        out: list[bytes] = []
        waiting = [c for c in self.calls.values() if not c.done]
        waiting.sort(key=lambda c: (c.output_index < 0, c.output_index, c.index))
        for call in waiting:
            arguments = "".join(call.arguments)
            where: dict[str, Any]
            if call.output_index < 0:
                out += self._add_call(call)
                if arguments and call.name not in self.opts.custom_tools:
                    where = {"item_id": call.item_id, "output_index": call.output_index}
                    out.append(
                        self._event(
                            "response.function_call_arguments.delta", **where, delta=arguments
                        )
                    )
            call.done = True
            item = call_item(call.item_id, call.call_id, call.name, arguments, self.opts)
            self.done_items[call.output_index] = item
            where = {"item_id": call.item_id, "output_index": call.output_index}
            if item["type"] == "custom_tool_call":
                if item["input"]:
                    out.append(
                        self._event(
                            "response.custom_tool_call_input.delta", **where, delta=item["input"]
                        )
                    )
                out.append(
                    self._event(
                        "response.custom_tool_call_input.done", **where, input=item["input"]
                    )
                )
            else:
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        **where,
                        name=call.name,
                        arguments=arguments,
                    )
                )
            out.append(
                self._event("response.output_item.done", output_index=call.output_index, item=item)
            )
        return out
