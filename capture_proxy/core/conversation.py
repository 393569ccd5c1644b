"""The canonical conversation: the chat-completions request every front maps to.

Owns the shapes of the canonical request, its messages, tool calls and tools, that the front
codecs produce and that linking, both prompt modes, records and splices read (``fronts.base``
says how each wire API maps to them). The shapes are TypedDicts: plain dicts at runtime (no
copies, no checks per call); mypy checks the keys and value types where they are built and
read. Pure, and nothing but shapes and their constructors: it must not validate
(``core.requests`` does for chat bodies, each front's ``parse`` for its API).

A chat-completions body passes through the chat front as the harness sent it, so besides the
keys below it may carry any vLLM extra (``return_token_ids``, ``min_p``, ...): those go to the
engine as sent and are read as ``Mapping[str, Any]`` where a reader needs them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NotRequired, Required, TypedDict, cast

#: The roles of canonical messages (``developer`` only in chat bodies that pass through; the
#: other fronts map it to ``system``).
Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatFunctionCall(TypedDict):
    """The function of a tool call: its name and the arguments as JSON text (as the model
    wrote them; ``core.requests.arguments_problem`` says when vLLM would refuse them)."""

    name: str
    arguments: str


class ChatToolCall(TypedDict):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"]
    function: ChatFunctionCall


class ChatTextPart(TypedDict):
    """A text content part (chat bodies only; the other fronts join their texts)."""

    type: Literal["text"]
    text: str


class ChatMessage(TypedDict, total=False):
    """One canonical message. ``content``: a string (a list of text parts only in chat bodies
    as sent), None on an assistant turn with only tool calls; an assistant message may carry
    ``reasoning_content`` (vLLM's ``reasoning`` is the same text under another name) and
    ``tool_calls``; a tool message carries ``tool_call_id``."""

    role: Required[Role]
    content: str | list[ChatTextPart] | None
    reasoning_content: str
    reasoning: str
    tool_calls: list[ChatToolCall]
    tool_call_id: str
    name: str


class ChatFunction(TypedDict):
    """The function a tool offers: ``parameters`` is a JSON Schema object."""

    name: str
    description: NotRequired[str]
    parameters: NotRequired[dict[str, Any]]
    strict: NotRequired[bool]


class ChatTool(TypedDict):
    """One entry of ``tools`` (function tools only: what the engine renders)."""

    type: Literal["function"]
    function: ChatFunction


class ChatNamedToolChoice(TypedDict):
    """A ``tool_choice`` that forces one function: ``{"type": "function", "function":
    {"name"}}``."""

    type: Literal["function"]
    function: dict[str, Any]


class ChatRequest(TypedDict, total=False):
    """The canonical request (``FrontRequest.chat``): a chat-completions body, vLLM 0.32
    names. ``max_tokens`` counts generated tokens; ``temperature``, ``top_p``, ``top_k`` as
    the engine takes them; ``continue_final_message`` with ``add_generation_prompt: false``:
    the last (assistant) message is continued, not answered (an Anthropic prefill)."""

    model: str | None
    messages: Required[list[ChatMessage]]
    #: ``ChatTool`` entries (the fronts build them as ``ChatTool``); ``list[Any]`` because the
    #: family interface (``families.base.ChatRenderer``) still takes ``list[dict[str, Any]]``
    tools: list[Any]
    tool_choice: str | ChatNamedToolChoice
    parallel_tool_calls: bool
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: str | list[str]
    seed: int
    stream: bool
    stream_options: dict[str, Any]
    response_format: dict[str, Any]
    chat_template_kwargs: dict[str, Any]
    continue_final_message: bool
    add_generation_prompt: bool
    logprobs: bool
    return_token_ids: bool


def tool_call(call_id: str, name: str, arguments: str) -> ChatToolCall:
    """A canonical tool call: ``{"id", "type": "function", "function": {"name", "arguments"}}``
    (``arguments``: JSON text, as the model wrote it)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def open_dict(value: ChatRequest | ChatMessage | dict[str, Any]) -> dict[str, Any]:
    """``value`` as the open ``dict[str, Any]`` that records, digests and engine bodies take:
    the same object, not a copy (a TypedDict is a plain dict at runtime). The one crossing
    from the typed canonical conversation to code that reads it untyped."""
    return cast("dict[str, Any]", value)


def kept_messages(messages: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    """Copies of canonical messages kept untyped (a stored record's ``request_messages`` and
    ``response_message``), typed again: they were canonical when they were kept."""
    return [cast(ChatMessage, dict(message)) for message in messages]
