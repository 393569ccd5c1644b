"""The front-codec contract: one canonical conversation, one canonical answer, three wire APIs.

Owns the shapes every front codec (``chat``, ``responses``, ``messages``) maps to and from, so
that linking, both prompt modes, verification and storage never know which API a call came in
on. Pure: no I/O, no aiohttp.

The canonical conversation is a chat-completions request body (``FrontRequest.chat``, typed
``core.conversation.ChatRequest``), the form the engine renders in backend-template mode and
the form records, digests and splices already use:

- ``messages``: ``system`` / ``user`` / ``assistant`` / ``tool`` messages. ``content`` is a
  string (or None on an assistant turn with tool calls); a user or tool message with images
  is a list of ``{"type": "text", "text"}`` and canonical image parts (``core.images``), in
  the order the harness sent them; an assistant turn may carry
  ``reasoning_content`` (str) and ``tool_calls``
  (``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``); a tool
  message carries ``tool_call_id``.
- ``tools``: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``.
- ``tool_choice``, ``parallel_tool_calls``, ``max_tokens``, ``temperature``, ``top_p``,
  ``top_k``, ``stop``, ``seed``, ``stream``, ``stream_options``, ``chat_template_kwargs``: as
  in chat completions (vLLM 0.32 names).

The canonical answer (``Answer``) is an OpenAI assistant message with a chat finish reason
(``stop`` | ``length`` | ``tool_calls``) and chat usage. A streamed answer is the sequence of
chat ``choices[0].delta`` objects (``{"content"}``, ``{"reasoning_content"}``, or
``{"tool_calls": [{"index", "id"?, "type"?, "function": {"name"?, "arguments"?}}]}``), which a
front's ``StreamEncoder`` turns into its API's SSE events as they arrive.
"""

from __future__ import annotations

import abc
import base64
import enum
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from capture_proxy.core.conversation import ChatRequest, ChatTool
from capture_proxy.core.front_errors import InvalidFrontRequest as InvalidFrontRequest
from capture_proxy.core.images import ImageLimits, RequestImages
from capture_proxy.core.known_bodies import ParsedBody
from capture_proxy.core.known_messages import KnownMessages, MessageFacts
from capture_proxy.core.known_tools import KnownTools, ToolsFacts, derive_tools_facts, tools_key
from capture_proxy.core.records import Diagnostic, DiagnosticKind


class Api(enum.StrEnum):
    """The wire API a call came in on (recorded on the call as ``api``)."""

    CHAT_COMPLETIONS = "chat_completions"
    RESPONSES = "responses"
    MESSAGES = "messages"


@dataclass(frozen=True)
class FrontRequest:
    """A parsed request. ``chat``: the canonical conversation (``ChatRequest``, see the module
    docstring); ``stream``: whether the harness asked for SSE; ``received``: the body as
    received, less its history field (``messages`` / ``input``), kept on the record;
    ``options``: what the front's encoder needs back (front-private: ``ResponsesOptions``,
    ``MessagesOptions``, None for chat)."""

    api: Api
    chat: ChatRequest
    stream: bool
    received: dict[str, Any] = field(default_factory=dict)
    options: Any = None
    #: the ``known_messages`` facts of ``chat["messages"]``, when the front derived them
    message_facts: tuple[MessageFacts, ...] | None = None
    #: the ``known_tools`` facts of ``chat["tools"]``, when the front derived them
    tools_facts: ToolsFacts | None = None
    #: the ``known_tools`` facts of ``received["tools"]`` when that is not ``chat["tools"]``
    #: (the Responses and Messages fronts' own tools), when the front derived them
    received_tools_facts: ToolsFacts | None = None
    #: what the front knows of the call that the record must say (``tools_not_rendered``)
    diagnostics: tuple[Diagnostic, ...] = ()
    #: the request's images (``core.images``; None: it has none): the canonical messages
    #: hold their parts, this their bytes
    images: RequestImages | None = None


def tools_not_rendered(tools: Sequence[Mapping[str, Any]]) -> tuple[Diagnostic, ...]:
    """A ``tools_not_rendered`` diagnostic naming ``tools`` (left out of the chat tools, so
    the model was not shown them), with each one's ``type`` and ``name`` (when it has one);
    none when ``tools`` is empty."""
    if not tools:
        return ()
    named = [
        {k: tool[k] for k in ("type", "name") if isinstance(tool.get(k), str)} for tool in tools
    ]
    return (Diagnostic(DiagnosticKind.TOOLS_NOT_RENDERED, {"tools": named}),)


_Extra = TypeVar("_Extra")


@dataclass(frozen=True)
class ConvertedTools(Generic[_Extra]):
    """What a front made of its API's ``tools``: the chat tools (``chat``; empty: none
    rendered) and the front's own ``extra`` (e.g. the tools left out), with the ``known_tools``
    facts of the chat tools (None: none, or not derived) and of the received value (``raw``)."""

    chat: list[ChatTool]
    extra: _Extra
    chat_facts: ToolsFacts | None = None
    raw_facts: ToolsFacts | None = None


def convert_tools(
    raw: Any,
    api: Api,
    convert: Callable[[Any], tuple[list[ChatTool], _Extra]],
    known_tools: KnownTools | None,
) -> ConvertedTools[_Extra]:
    """``convert(raw)`` (the chat tools and the front's extras, or InvalidFrontRequest), done
    once per tools value: what the first call that sent it got is kept on its ``known_tools``
    facts (by ``api``) and shared by the later ones (read-only), with the facts of the chat
    tools. A value that fails conversion is converted (and fails) every time."""
    if known_tools is None or not isinstance(raw, list):
        chat, extra = convert(raw)
        return ConvertedTools(chat, extra)
    raw_facts = known_tools.facts(raw)
    kept = raw_facts.forms.get(api)
    if isinstance(kept, ConvertedTools):
        return ConvertedTools(kept.chat, kept.extra, kept.chat_facts, raw_facts)
    chat, extra = convert(raw)
    chat_facts = derive_tools_facts(chat, tools_key(chat)) if chat else None
    # (kept without ``raw_facts``, which keep it: no cycle) About its bytes: the chat tools'
    # texts, and the objects it keeps alive (the chat tools and what they share with the
    # first request's body) at several times their JSON text.
    texts = 0 if chat_facts is None else len(chat_facts.text or "") * 3
    size = texts + 8 * len(raw_facts.key or b"")
    known_tools.keep_form(raw_facts, api, ConvertedTools(chat, extra, chat_facts), size)
    return ConvertedTools(chat, extra, chat_facts, raw_facts)


#: Token ids as a list or a uint32 array.
TokenIds = Sequence[int] | npt.NDArray[np.uint32]


@dataclass(frozen=True)
class Answer:
    """The canonical answer of one call.

    ``message``: OpenAI assistant message (``content`` str or None, optional
    ``reasoning_content``, ``tool_calls`` list); ``finish_reason``: ``stop`` | ``length`` |
    ``tool_calls``; ``usage``: ``{prompt_tokens, completion_tokens, total_tokens}`` or None;
    ``created_at``: Unix seconds the proxy received the request."""

    call_id: str
    created_at: float
    model: str | None
    message: dict[str, Any]
    finish_reason: str | None
    usage: dict[str, Any] | None = None
    #: what ended the answer, as the engine said (vLLM's ``stop_reason``: the stop string that
    #: matched, or the ``stop_token_ids`` id; SGLang's ``finish_reason.matched``); None: the
    #: model's own end token, the length limit, or not said. Not stored on the record.
    stop_reason: str | int | None = None
    #: token data, for a front that shows it when asked (chat completions'
    #: ``return_token_ids`` / ``logprobs``): generated ids, their log probs, the prompt ids
    #: (a list, or the uint32 array the proxy built: a long prompt becomes a list only for a
    #: front that shows it, see ``token_id_list``)
    token_ids: list[int] | None = None
    log_probs: list[float | None] | None = None
    prompt_token_ids: TokenIds | None = None


def token_id_list(ids: TokenIds | None) -> list[int] | None:
    """Token ids as a JSON-ready list (from a list or a numpy array)."""
    if ids is None:
        return None
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)


class StreamEncoder(Protocol):
    """Chat deltas in, one API's SSE event bytes out (each item a whole ``event``/``data``
    block ending in a blank line)."""

    def start(self) -> list[bytes]:
        """Events sent before the first delta (e.g. ``response.created``,
        ``message_start``)."""

    def delta(
        self,
        delta: Mapping[str, Any],
        *,
        token_ids: list[int] | None = None,
        log_probs: list[float | None] | None = None,
    ) -> list[bytes]:
        """One chat ``choices[0].delta``; may return nothing (held back or empty). The token
        data that came with it is for fronts that show it (chat completions); others ignore
        it, and an empty delta."""

    def finish(self, answer: Answer) -> list[bytes]:
        """The closing events, from the whole answer (usage, stop reason, done items)."""

    def error(self, message: str, *, code: str | None = None) -> bytes:
        """An in-band error event for a stream whose headers are sent (no clean end).
        ``code``: the proxy's own error code, for an error of the proxy's that a retry may
        cure (``store_unavailable``: the store refused the record); None: the engine failed."""


class PartsStreamEncoder(abc.ABC):
    """The ``delta`` of a ``StreamEncoder`` that answers each part of a chat delta by itself,
    in the order reasoning, content, tool-call fragments (the Responses and Messages
    encoders); subclasses give ``start``, ``finish``, ``error`` and the three parts. Empty
    text parts and fragments that are not objects are skipped; token data is ignored."""

    #: reasoning is read from ``reasoning_content``, and when that is absent (None) also from
    #: vLLM's newer name ``reasoning`` if this is set
    reads_reasoning_alias: bool = False

    def delta(
        self,
        delta: Mapping[str, Any],
        *,
        token_ids: list[int] | None = None,
        log_probs: list[float | None] | None = None,
    ) -> list[bytes]:
        out: list[bytes] = []
        reasoning = delta.get("reasoning_content")
        if reasoning is None and self.reads_reasoning_alias:
            reasoning = delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out += self.reasoning_part(reasoning)
        content = delta.get("content")
        if isinstance(content, str) and content:
            out += self.text_part(content)
        for position, fragment in enumerate(delta.get("tool_calls") or []):
            if isinstance(fragment, Mapping):
                out += self.tool_call_part(fragment, position)
        return out

    @abc.abstractmethod
    def reasoning_part(self, text: str) -> list[bytes]:
        """The events of a reasoning text (non-empty)."""

    @abc.abstractmethod
    def text_part(self, text: str) -> list[bytes]:
        """The events of a content text (non-empty)."""

    @abc.abstractmethod
    def tool_call_part(self, fragment: Mapping[str, Any], position: int) -> list[bytes]:
        """The events of one tool-call fragment (``{"index", "id"?, "function"?}``), the
        ``position``-th of its delta."""


class FrontCodec(Protocol):
    """One wire API. Pure."""

    api: Api
    #: the top-level member holding the request's history, an array (``known_bodies``)
    history_member: str

    def parse(
        self,
        body: dict[str, Any],
        *,
        previous: list[dict[str, Any]] | None = None,
        known: KnownMessages | None = None,
        images: ImageLimits | None = None,
        known_tools: KnownTools | None = None,
        history: ParsedBody | None = None,
    ) -> FrontRequest:
        """Validate ``body`` and map it to the canonical conversation. ``previous``: canonical
        messages a reference in the body stands for (Responses ``previous_response_id``; the
        adapter resolves it). ``known``: facts of the messages of earlier requests; a front
        may skip what it checked of them before, and give the facts of the canonical messages
        (``FrontRequest.message_facts``). ``images``: what images a call may carry (None: an
        image is refused). ``known_tools``: facts of the tools of earlier requests, likewise
        (``FrontRequest.tools_facts``, ``received_tools_facts``). ``history``: the body as
        ``known_bodies`` read it, when it did (its first elements of ``body[history_member]``
        may be an earlier request's own objects): a front takes the facts of the messages it
        repeats from it (``head_facts_for``), and a front that converts the history takes the
        conversion of the elements it repeats (``front_memo``) and keeps its own
        (``keep_front_memo``). Raises InvalidFrontRequest
        naming the field, ImageRefused (``core.images``) for an image it may not carry."""

    def encode(self, request: FrontRequest, answer: Answer) -> dict[str, Any]:
        """The whole (non-streaming) response body in the API's shape."""

    def stream_encoder(self, request: FrontRequest, answer_head: Answer) -> StreamEncoder:
        """An encoder for one streamed answer (``answer_head``: ids and model, empty
        message)."""

    def error_body(
        self, status: int, message: str, *, error_type: str, param: str | None, code: str | None
    ) -> dict[str, Any]:
        """The API's error shape for a proxy-made error."""


def answer_as_deltas(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A whole assistant message as the chat deltas a stream of it would carry (reasoning,
    content, then each tool call whole), for encoding a whole answer as a stream."""
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        out.append({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        out.append({"content": message["content"]})
    for index, tc in enumerate(message.get("tool_calls") or []):
        fn = tc.get("function") or {}
        out.append(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": tc.get("id"),
                        "type": "function",
                        "function": {
                            "name": fn.get("name"),
                            "arguments": fn.get("arguments") or "",
                        },
                    }
                ]
            }
        )
    return out


_Options = TypeVar("_Options")


def front_options(request: FrontRequest, kind: type[_Options]) -> _Options:
    """``request.options`` when it is a ``kind`` (the front's options dataclass), else
    ``kind()``, its defaults (a request parsed by another front)."""
    options = request.options
    return options if isinstance(options, kind) else kind()


def answer_model(request: FrontRequest, answer: Answer) -> Any:
    """The model an answer names: the engine's, else the one the request asked for."""
    return answer.model or request.chat.get("model")


def is_int(value: Any) -> bool:
    """A JSON integer (``True`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A JSON number: an int or a float (``True`` is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def loads_or_none(text: str) -> Any:
    """``json.loads(text)``, or None when it is not JSON (or nests past the stack)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One SSE block: optional ``event:`` line, one ``data:`` line of compact JSON (UTF-8)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


# -- opaque reasoning values -------------------------------------------------------------------
#
# Harnesses hand some values back unchanged: Responses ``reasoning.encrypted_content``,
# Anthropic ``thinking.signature``. The proxy issues them: they carry the call id (a hint, never
# trusted for linking: links are taken only when tokens verify) and the reasoning text itself,
# so that a harness that shows no reasoning text (Claude Code's ``display: omitted``) still
# gets the model's reasoning back to the engine. A checksum catches a changed or foreign value,
# which is then ignored.

_SEAL_PREFIX = "cpr1."


def seal_reasoning(call_id: str, text: str) -> str:
    """An opaque value holding ``call_id`` and the reasoning ``text`` (URL-safe base64 of
    compact JSON, prefixed ``cpr1.``, with a 16-hex-char SHA-256 check)."""
    payload = json.dumps({"c": call_id, "t": text}, ensure_ascii=False, separators=(",", ":"))
    raw = payload.encode()
    check = hashlib.sha256(raw).hexdigest()[:16]
    return _SEAL_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=") + "." + check


def open_reasoning(value: Any) -> tuple[str, str] | None:
    """``(call_id, text)`` from a value made by ``seal_reasoning``; None for anything else
    (absent, foreign, truncated, tampered)."""
    if not isinstance(value, str) or not value.startswith(_SEAL_PREFIX):
        return None
    body, _, check = value[len(_SEAL_PREFIX) :].rpartition(".")
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (ValueError, TypeError):
        return None
    if hashlib.sha256(raw).hexdigest()[:16] != check:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("c"), str):
        return None
    text = obj.get("t")
    return (obj["c"], text) if isinstance(text, str) else None
