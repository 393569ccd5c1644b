"""The Anthropic Messages front codec (``POST /v1/messages``, as Claude Code 2.1.328 sends it).

Owns the mapping between a Messages request and the canonical conversation (a chat body, see
``fronts.base``), the encoding of the canonical answer as a ``message`` or as its SSE events,
the ``count_tokens`` request and answer, and Anthropic's error shape. Pure: no I/O, no aiohttp.
By noun: ``parse`` (the request; its ``system`` and ``messages`` read by ``blocks``, its tools
by ``tools``, its fields checked by ``checks``), ``options`` (``MessagesOptions``, what the
encoders need back from it), ``encode`` (the ``message``, its content blocks, the error shape),
``stream`` (the SSE events of one streamed answer).
"""

from __future__ import annotations

from typing import Any

from capture_proxy.core.fronts.base import Answer, Api, FrontRequest
from capture_proxy.core.fronts.messages.encode import (
    anthropic_error_body,
    encode_count_tokens,
    encode_message,
    error_type_for,
)
from capture_proxy.core.fronts.messages.parse import parse_count_tokens, parse_request
from capture_proxy.core.fronts.messages.stream import MessagesStreamEncoder
from capture_proxy.core.images import ImageLimits
from capture_proxy.core.known_bodies import ParsedBody
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.known_tools import KnownTools


class MessagesCodec:
    """Anthropic Messages (see the package docstring). ``parse`` raises InvalidFrontRequest
    naming the field."""

    api = Api.MESSAGES
    history_member = "messages"

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
        return parse_request(body, images=images, known_tools=known_tools, history=history)

    def parse_count_tokens(
        self, body: dict[str, Any], images: ImageLimits | None = None
    ) -> FrontRequest:
        return parse_count_tokens(body, images)

    def encode_count_tokens(self, num_tokens: int) -> dict[str, Any]:
        return encode_count_tokens(num_tokens)

    def encode(self, request: FrontRequest, answer: Answer) -> dict[str, Any]:
        return encode_message(request, answer)

    def stream_encoder(self, request: FrontRequest, answer_head: Answer) -> MessagesStreamEncoder:
        return MessagesStreamEncoder(request, answer_head)

    def error_body(
        self, status: int, message: str, *, error_type: str, param: str | None, code: str | None
    ) -> dict[str, Any]:
        """Anthropic's shape; the type follows the status (``error_type`` is the OpenAI-style
        name the caller uses elsewhere); the param leads the message, as Anthropic's own
        messages name the field."""
        if param and param not in message:
            message = f"{param}: {message}"
        return anthropic_error_body(message, error_type_for(status))
