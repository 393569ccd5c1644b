"""Front codecs: the wire APIs a harness speaks, each mapped to one canonical conversation.

``front_for(path)`` names the codec of a captured engine path; ``endpoint_kind(path)`` says
what the capture path does with any other path (count tokens, refuse a generation endpoint it
cannot capture, or forward). The codecs are pure; see ``base`` for the contract.
"""

from __future__ import annotations

import enum

from capture_proxy.core.fronts.base import (
    Answer,
    Api,
    FrontCodec,
    FrontRequest,
    InvalidFrontRequest,
    StreamEncoder,
)
from capture_proxy.core.fronts.chat import ChatCodec
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.fronts.messages.parse import parse_count_tokens
from capture_proxy.core.fronts.responses import ResponsesCodec

__all__ = [
    "Answer",
    "Api",
    "EndpointKind",
    "FrontCodec",
    "FrontRequest",
    "InvalidFrontRequest",
    "StreamEncoder",
    "endpoint_kind",
    "error_front",
    "front_for",
    "front_of_tail",
    "generation_path",
    "parse_count_tokens",
]

_FRONTS: dict[str, FrontCodec] = {
    "/v1/chat/completions": ChatCodec(),
    "/v1/responses": ResponsesCodec(),
    "/v1/messages": MessagesCodec(),
}


class EndpointKind(enum.StrEnum):
    """What a path under the capture prefix is."""

    CAPTURED = "captured"  # a model call: parsed, captured, answered by the proxy
    COUNT_TOKENS = "count_tokens"  # answered from the tokenizer, not captured
    NOT_CAPTURABLE = "not_capturable"  # generates, but the proxy cannot capture it: refused
    #: a POST path not in normal form (percent-encoded, empty or dot segments): the engine
    #: may decode or normalise it into a generation endpoint, so it is refused
    NOT_NORMAL = "not_normal"
    FORWARDED = "forwarded"  # no generation (models, tokenize, ...): forwarded, not captured


#: Generation endpoints an engine serves that no front codec captures: under a capture path
#: they are refused (400 naming the endpoint), never forwarded silently uncaptured.
#: A trailing "/" covers the paths below (``/v1/responses/compact``: Codex's remote
#: compaction). Paths without the ``/v1`` prefix are the same engines' aliases.
NOT_CAPTURABLE_PATHS = (
    "/v1/completions",
    "/completions",
    "/chat/completions",
    "/responses",
    "/messages",
    "/generate",
    "/inference/v1/generate",
    "/v1/responses/",
    "/v1/messages/",
    "/v1/audio/",
    "/v1/realtime",
    "/invocations",
)


def is_normal_path(path: str) -> bool:
    """True when ``path`` reads the same to every server: no percent-encoding (an engine on
    Starlette routes ``/v1/chat%2Fcompletions`` as ``/v1/chat/completions``), no empty
    segments and no ``.`` or ``..`` segments (HTTP clients and servers normalise them)."""
    if "%" in path or not path.startswith("/"):
        return False
    segments = path[1:].split("/")
    inner = segments[:-1]  # a trailing "/" (an empty last segment) is its own case
    return all(seg not in ("", ".", "..") for seg in inner) and segments[-1] not in (".", "..")


def front_for(path: str) -> FrontCodec | None:
    """The codec capturing ``path`` (the engine path after the capture prefix), or None."""
    return _FRONTS.get(path)


def error_front(path: str) -> FrontCodec | None:
    """The codec whose error shape a request to ``path`` gets: its own, or its API's for the
    paths below it (``/v1/messages/count_tokens`` answers in Anthropic's shape)."""
    front = _FRONTS.get(path)
    if front is None and path.startswith("/v1/messages/"):
        front = _FRONTS["/v1/messages"]
    return front


#: The path tails of the three APIs (a path ending so is meant for that API).
_TAILS = (
    ("/chat/completions", "/v1/chat/completions"),
    ("/responses", "/v1/responses"),
    ("/messages", "/v1/messages"),
    ("/messages/count_tokens", "/v1/messages"),
)


def front_of_tail(path: str) -> FrontCodec | None:
    """The codec of the API whose endpoint ``path`` ends with (``/x/v1/chat/completions``,
    ``/responses``, ``/messages/count_tokens``), for the error shape of a path the proxy does
    not serve (a misspelt capture segment, a read-only server); None for any other path."""
    bare = path.rstrip("/")
    for tail, api in _TAILS:
        if bare.endswith(tail):
            return _FRONTS[api]
    return None


def generation_path(method: str, path: str) -> str | None:
    """The generation endpoint a ``method`` request to ``path`` outside a capture path calls
    (``/v1/chat/completions``; for a family of paths its prefix, ``/v1/responses/``), or None
    when it generates nothing. One of a fixed set: safe as a metric label."""
    if method != "POST" or path == "/v1/messages/count_tokens":
        return None
    if path in _FRONTS:
        return path
    for prefix in NOT_CAPTURABLE_PATHS:
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return prefix
    return None


def endpoint_kind(method: str, path: str) -> EndpointKind:
    """What a ``method`` request to ``path`` under the capture prefix is. Only POSTs generate:
    other methods on any other path are forwarded (a GET on a captured path, or on
    ``count_tokens``, which the proxy answers itself, is the caller's 405)."""
    if path in _FRONTS:
        return EndpointKind.CAPTURED
    if path == "/v1/messages/count_tokens":
        return EndpointKind.COUNT_TOKENS
    if method != "POST":
        return EndpointKind.FORWARDED
    if not is_normal_path(path):
        return EndpointKind.NOT_NORMAL
    if path.rstrip("/") in _FRONTS:
        # ``/v1/chat/completions/``: a model call the proxy would not see as one.
        return EndpointKind.NOT_CAPTURABLE
    for prefix in NOT_CAPTURABLE_PATHS:
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return EndpointKind.NOT_CAPTURABLE
    return EndpointKind.FORWARDED
