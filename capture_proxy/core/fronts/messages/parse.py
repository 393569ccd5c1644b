"""Parsing an Anthropic Messages request (and a ``count_tokens`` one) into the canonical
conversation.

Owns the validation of a Messages body (errors name the field as a dotted path, e.g.
``messages.3.content.1.type``: ``checks``), its mapping to the canonical chat request (see
``fronts.base``) and to ``MessagesOptions``: ``parse_request`` reads the fields in order, the
``system`` and ``messages`` by ``blocks``, the tools by ``tools``. Pure; must not encode
answers (``encode``, ``stream``).

- ``system`` and ``messages``: see ``blocks`` (each message's content blocks in order; a
  ``tool_result`` -> a ``tool`` message, ``is_error`` said in its text; ``thinking`` ->
  ``reasoning_content``; ``tool_use`` -> a tool call).
- ``tools`` and ``tool_choice``: see ``tools`` (custom tools -> chat function tools, server
  tools left out).
- ``stop_sequences`` -> ``stop``; ``temperature`` (0 to 1), ``top_p`` (above 0, at most 1),
  ``top_k`` (0 or more) as they are, each refused outside its range;
  ``thinking`` -> ``MessagesOptions.thinking`` and, when explicitly ``enabled`` / ``disabled``,
  ``chat_template_kwargs: {"enable_thinking": bool}`` (the vLLM chat-template kwarg that the
  Qwen3 templates read; ``adaptive`` leaves the template's default). ``metadata``,
  ``context_management``, ``service_tier`` and other fields are not sent to the engine (they
  stay in ``received``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from capture_proxy.core.conversation import ChatRequest
from capture_proxy.core.fronts.base import Api, FrontRequest, tools_not_rendered
from capture_proxy.core.fronts.messages.blocks import Collected, MessagesMemo, canonical_messages
from capture_proxy.core.fronts.messages.checks import (
    as_bool,
    as_int,
    as_list,
    as_number,
    as_object,
    as_str,
    fail,
)
from capture_proxy.core.fronts.messages.options import MessagesOptions
from capture_proxy.core.fronts.messages.tools import tool_fields
from capture_proxy.core.images import ImageLimits
from capture_proxy.core.known_tools import KnownTools

if TYPE_CHECKING:
    from capture_proxy.core.known_bodies import ParsedBody


def _stop_sequence(value: Any, path: str) -> str:
    if not as_str(value, path):
        raise fail(path, "must not be empty (the engine refuses an empty stop string)")
    return value


def _thinking(raw: Any, out: ChatRequest) -> tuple[dict[str, Any], bool]:
    """(the thinking object, display omitted)."""
    thinking = as_object(raw, "thinking")
    kind = as_str(thinking.get("type"), "thinking.type")
    if kind == "enabled":
        budget = as_int(thinking.get("budget_tokens"), "thinking.budget_tokens")
        if budget < 1:
            raise fail("thinking.budget_tokens", "must be positive")
        out["chat_template_kwargs"] = {"enable_thinking": True}
    elif kind == "disabled":
        out["chat_template_kwargs"] = {"enable_thinking": False}
    elif kind != "adaptive":
        raise fail("thinking.type", f"must be enabled, disabled or adaptive, not {kind!r}")
    display = thinking.get("display")
    if display is not None:
        as_str(display, "thinking.display")
    return thinking, display == "omitted"


def _sampling_fields(body: dict[str, Any], chat: ChatRequest) -> bool:
    """Sets ``stop``, ``temperature``, ``top_p``, ``top_k`` and the stream fields of ``chat``;
    returns whether the harness asked for a stream."""
    if body.get("stop_sequences") is not None:
        stops = as_list(body["stop_sequences"], "stop_sequences")
        chat["stop"] = [_stop_sequence(s, f"stop_sequences.{k}") for k, s in enumerate(stops)]
    if body.get("temperature") is not None:
        temperature = as_number(body["temperature"], "temperature")
        if not 0 <= temperature <= 1:
            raise fail("temperature", f"must be from 0 to 1, not {temperature}")
        chat["temperature"] = temperature
    if body.get("top_p") is not None:
        top_p = as_number(body["top_p"], "top_p")
        if not 0 < top_p <= 1:
            # Anthropic documents [0, 1]; the engine (vLLM) refuses 0.
            raise fail("top_p", f"must be greater than 0 and at most 1, not {top_p}")
        chat["top_p"] = top_p
    if body.get("top_k") is not None:
        top_k = as_int(body["top_k"], "top_k")
        if top_k < 0:
            raise fail("top_k", f"must be 0 or more, not {top_k}")
        chat["top_k"] = top_k
    stream = False
    if body.get("stream") is not None:
        stream = as_bool(body["stream"], "stream")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return stream


def parse_request(
    body: Any,
    *,
    count_tokens: bool = False,
    images: ImageLimits | None = None,
    known_tools: KnownTools | None = None,
    history: ParsedBody | None = None,
) -> FrontRequest:
    """A Messages body as a ``FrontRequest`` (``options``: ``MessagesOptions``). With
    ``count_tokens`` a ``count_tokens`` body: no ``max_tokens``, sampling fields and
    ``stream`` are not read. ``images``: what images it may carry (None: refused);
    ``known_tools``: facts of earlier requests' tools (a tools value is converted once,
    ``convert_tools``); ``history``: the body as ``known_bodies`` read it (the conversion of
    the messages it repeats is taken from its ``front_memo``, and this one's kept). Raises
    InvalidFrontRequest naming the first bad field, ImageRefused (``core.images``)."""
    as_object(body, "body")
    model = as_str(body.get("model"), "model")
    if not model:
        raise fail("model", "must not be empty")
    if not count_tokens:
        max_tokens = as_int(body.get("max_tokens"), "max_tokens")
        if max_tokens < 1:
            raise fail("max_tokens", "must be positive")
    raw_messages = as_list(body.get("messages"), "messages")
    if not raw_messages:
        raise fail("messages", "must not be empty")
    seen = Collected(images)
    earlier = history.front_memo(MessagesMemo) if history is not None else None
    canonical, memo = canonical_messages(body, raw_messages, seen, earlier)
    if history is not None:
        history.keep_front_memo(memo)
    chat: ChatRequest = {"model": model, "messages": canonical}
    if not count_tokens:
        chat["max_tokens"] = max_tokens
    converted = tool_fields(body, chat, known_tools)
    server_tools = converted.extra
    stream = False if count_tokens else _sampling_fields(body, chat)
    thinking: dict[str, Any] | None = None
    omit = False
    if body.get("thinking") is not None:
        thinking, omit = _thinking(body["thinking"], chat)
    options = MessagesOptions(
        thinking=thinking,
        omit_thinking=omit,
        server_tools=server_tools,
        tool_errors=tuple(seen.tool_errors),
        reasoning_hints=tuple(seen.reasoning_hints),
        prefill=raw_messages[-1].get("role") == "assistant",
        count_tokens=count_tokens,
    )
    if options.prefill and not count_tokens:
        # Anthropic continues a trailing assistant message (a prefill): vLLM's chat extras
        # ask the same of the template (and exact-token mode of its renderer).
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    received = {k: v for k, v in body.items() if k != "messages"}
    return FrontRequest(
        Api.MESSAGES,
        chat,
        stream,
        received,
        options,
        tools_facts=converted.chat_facts,
        received_tools_facts=converted.raw_facts,
        diagnostics=tools_not_rendered(server_tools),
        images=seen.images.result(),
    )


def parse_count_tokens(body: dict[str, Any], images: ImageLimits | None = None) -> FrontRequest:
    """``POST /v1/messages/count_tokens``: the same shapes as a Messages body, without
    ``max_tokens`` (ignored when present); sampling fields and ``stream`` are not read."""
    return parse_request(body, count_tokens=True, images=images)
