"""The OpenAI Responses API front (``POST /v1/responses``), as Codex CLI sends it.

Owns the mapping between a Responses request and the canonical conversation (a chat body, see
``fronts.base``), and between the canonical answer and a ``response`` object, whole or as the
API's SSE events. Pure: no I/O, no aiohttp. By noun: ``parse`` (the request; its ``input``
items read by ``items``, its tools by ``tools``, its fields checked by ``checks``),
``options`` (``ResponsesOptions``, what the encoders need back from it), ``encode`` (the
``response`` object and its output items), ``stream`` (the SSE events of one streamed
answer).

Reasoning, and how Codex hands it back: Codex sends ``store: false`` and
``include: ["reasoning.encrypted_content"]`` and replays every ``reasoning`` output item on
the next request as it received it (``summary``, ``encrypted_content`` and, when it holds
``reasoning_text`` parts, ``content``; never the item id). So a reasoning item carries the
reasoning text three ways: ``encrypted_content`` (``seal_reasoning``, only when included, as
the API does), ``content`` (``reasoning_text``, always, as open-weight models' reasoning is
shown by vLLM), and ``summary`` (the whole text as one ``summary_text``, only when
``reasoning.summary`` is set: Codex shows summaries as the model's reasoning). ``parse``
prefers the sealed text, then ``content``, then ``summary``.
"""

from __future__ import annotations

from typing import Any

from capture_proxy.core.fronts.base import Answer, Api, FrontRequest
from capture_proxy.core.fronts.chat import openai_error_body
from capture_proxy.core.fronts.responses.encode import encode_response
from capture_proxy.core.fronts.responses.parse import parse_request
from capture_proxy.core.fronts.responses.stream import ResponsesStream
from capture_proxy.core.images import ImageLimits
from capture_proxy.core.known_bodies import ParsedBody
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.known_tools import KnownTools


class ResponsesCodec:
    """The Responses API front codec (stateless). ``parse`` raises InvalidFrontRequest
    naming the field; errors have OpenAI's shape."""

    api = Api.RESPONSES
    history_member = "input"

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
        return parse_request(body, previous, images, known_tools, history)

    def encode(self, request: FrontRequest, answer: Answer) -> dict[str, Any]:
        return encode_response(request, answer)

    def stream_encoder(self, request: FrontRequest, answer_head: Answer) -> ResponsesStream:
        return ResponsesStream(request, answer_head)

    def error_body(
        self, status: int, message: str, *, error_type: str, param: str | None, code: str | None
    ) -> dict[str, Any]:
        return openai_error_body(message, error_type, param=param, code=code)
