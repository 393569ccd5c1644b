"""The chat-completions front codec (OpenAI ``POST /v1/chat/completions``, as OpenCode sends it).

Owns the mapping between a chat request and the canonical conversation (the identity: the
canonical form *is* a chat body, validated by ``core.requests``) and the encoding of a
proxy-built answer as a ``chat.completion`` or as ``chat.completion.chunk`` events (exact-token
mode; in backend-template mode the engine's own chat answer is relayed, stripped of what the
proxy added, see ``core.capture``). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import orjson

from capture_proxy.core.conversation import ChatRequest
from capture_proxy.core.fronts.base import (
    Answer,
    Api,
    FrontRequest,
    InvalidFrontRequest,
    token_id_list,
)
from capture_proxy.core.images import ImageCollector, ImageLimits, detail_of
from capture_proxy.core.json_bodies import InvalidRequest
from capture_proxy.core.known_bodies import ParsedBody
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.known_tools import KnownTools
from capture_proxy.core.requests import validate_chat_request
from capture_proxy.core.sse import encode_json_event

DONE_EVENT = b"data: [DONE]\n\n"


def openai_error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def chat_error_event(message: str, *, code: str | None = None) -> bytes:
    """A chat stream's in-band error event (``data: {"error": ...}``): ``upstream_error``
    for the engine's failure, ``server_error`` with the proxy's ``code`` for its own."""
    if code is None:
        return encode_json_event(openai_error_body(message, "upstream_error"))
    return encode_json_event(openai_error_body(message, "server_error", code=code))


def logprobs_content(token_ids: list[int], log_probs: list[float | None] | None) -> dict[str, Any]:
    """Chat-shaped log probs (tokens as ``token_id:<id>``, vLLM's ``return_tokens_as_token_ids``
    form, since the proxy may have no tokenizer; no top alternatives)."""
    values = log_probs or []
    return {
        "content": [
            {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(token_ids, values, strict=False)
        ]
    }


def chat_usage(num_prompt_tokens: int, num_generation_tokens: int) -> dict[str, int]:
    """Chat ``usage``: ``{prompt_tokens, completion_tokens, total_tokens}``."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_generation_tokens,
        "total_tokens": num_prompt_tokens + num_generation_tokens,
    }


def _has_image_part(messages: Any) -> bool:
    """Some message's content holds an ``image_url`` part (a quick look before validation)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content
        ):
            return True
    return False


def canonical_image_messages(messages: list[Any], collector: ImageCollector) -> list[Any]:
    """Valid chat messages with each ``image_url`` part as the canonical image part
    (``core.images``); messages without one are passed as they are. Raises ImageRefused
    naming the part's ``image_url.url`` (or ``detail``)."""
    out: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not (isinstance(content, list) and any(p.get("type") == "image_url" for p in content)):
            out.append(message)
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            if part.get("type") != "image_url":
                parts.append(part)
                continue
            path = f"messages.{i}.content.{j}.image_url"
            url = part["image_url"]
            detail = detail_of(url.get("detail"), f"{path}.detail")
            parts.append(
                collector.url(url.get("url"), f"{path}.url", message["role"], detail=detail)
            )
        out.append({**message, "content": parts})
    return out


class ChatCodec:
    """OpenAI chat completions. ``parse`` raises InvalidFrontRequest (from
    ``validate_chat_request``: ``n > 1``, parts other than text and images, missing
    ``messages``, ...) and ImageRefused (``core.images``: an image it may not carry)."""

    api = Api.CHAT_COMPLETIONS
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
        messages = body.get("messages")
        with_images = _has_image_part(messages)
        facts = None
        if known is not None and isinstance(messages, list) and not with_images:
            head = history.head_facts_for(messages) if history is not None else ()
            facts = known.facts(messages, head)
        tools = body.get("tools")
        tools_facts = None
        if known_tools is not None and isinstance(tools, list):
            tools_facts = known_tools.facts(tools)
        try:
            validate_chat_request(body, facts, tools_facts)
        except InvalidRequest as exc:
            raise InvalidFrontRequest(str(exc), exc.param) from exc
        received = {k: v for k, v in body.items() if k != "messages"}
        stream = bool(body.get("stream"))
        if not with_images:
            # Validated: the chat body is the canonical request itself (extras and all).
            chat = cast(ChatRequest, body)
            return FrontRequest(
                self.api, chat, stream, received, message_facts=facts, tools_facts=tools_facts
            )
        # Images: the canonical messages hold image parts by content address, not the data
        # (their facts are derived from those, by the adapter, once remote ones are fetched).
        collector = ImageCollector(images)
        assert isinstance(messages, list)
        chat = cast(
            ChatRequest, {**body, "messages": canonical_image_messages(messages, collector)}
        )
        return FrontRequest(
            self.api,
            chat,
            stream,
            received,
            tools_facts=tools_facts,
            images=collector.result(),
        )

    def encode(self, request: FrontRequest, answer: Answer) -> dict[str, Any]:
        body = request.chat
        choice: dict[str, Any] = {
            "index": 0,
            "message": answer.message,
            "logprobs": logprobs_content(answer.token_ids or [], answer.log_probs)
            if body.get("logprobs")
            else None,
            "finish_reason": answer.finish_reason,
            "stop_reason": None,
        }
        out: dict[str, Any] = {
            "id": f"chatcmpl-{answer.call_id}",
            "object": "chat.completion",
            "created": int(answer.created_at),
            "model": answer.model,
            "choices": [choice],
            "usage": answer.usage,
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = answer.token_ids
            out["prompt_token_ids"] = token_id_list(answer.prompt_token_ids)
        return out

    def stream_encoder(self, request: FrontRequest, answer_head: Answer) -> ChatStreamEncoder:
        return ChatStreamEncoder(request.chat, answer_head)

    def error_body(
        self, status: int, message: str, *, error_type: str, param: str | None, code: str | None
    ) -> dict[str, Any]:
        return openai_error_body(message, error_type, param=param, code=code)


class ChatStreamEncoder:
    """``chat.completion.chunk`` events for a proxy-built answer: a role chunk first, one chunk
    per delta (with the token data that came with it, when the harness asked for log probs or
    token ids), a finish chunk, the usage chunk when asked, ``[DONE]``."""

    def __init__(self, body: Mapping[str, Any], head: Answer) -> None:
        self.head = {
            "id": f"chatcmpl-{head.call_id}",
            "object": "chat.completion.chunk",
            "created": int(head.created_at),
            "model": head.model,
        }
        self.logprobs = bool(body.get("logprobs"))
        self.token_ids = bool(body.get("return_token_ids"))
        opts = body.get("stream_options")
        self.include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        self.prompt_token_ids = head.prompt_token_ids  # a list only when it is sent
        # a delta's event with no token data, around its delta's JSON: what orjson writes for
        # ``_chunk(delta)`` (the same members in the same order), without the dicts per token
        self._around = (
            b"data: " + orjson.dumps(self.head)[:-1] + b',"choices":[{"index":0,"delta":',
            b',"logprobs":null,"finish_reason":null}]}\n\n',
        )

    def _chunk(
        self,
        delta: Mapping[str, Any],
        token_ids: list[int] | None = None,
        log_probs: list[float | None] | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": dict(delta),
            "logprobs": None,
            "finish_reason": finish,
        }
        if token_ids is not None and self.logprobs:
            choice["logprobs"] = logprobs_content(token_ids, log_probs)
        if token_ids is not None and self.token_ids:
            choice["token_ids"] = token_ids
        return {**self.head, "choices": [choice]}

    def start(self) -> list[bytes]:
        first = self._chunk({"role": "assistant", "content": ""})
        if self.token_ids:
            first["prompt_token_ids"] = token_id_list(self.prompt_token_ids)
        return [encode_json_event(first)]

    def delta(
        self,
        delta: Mapping[str, Any],
        *,
        token_ids: list[int] | None = None,
        log_probs: list[float | None] | None = None,
    ) -> list[bytes]:
        if not (self.logprobs or self.token_ids) or token_ids is None:
            if not delta:
                return []
            before, after = self._around
            return [before + orjson.dumps(delta if type(delta) is dict else dict(delta)) + after]
        if not delta and not token_ids:
            return []
        return [encode_json_event(self._chunk(delta, token_ids, log_probs))]

    def finish(self, answer: Answer) -> list[bytes]:
        out = [encode_json_event(self._chunk({}, finish=answer.finish_reason))]
        if self.include_usage:
            out.append(encode_json_event({**self.head, "choices": [], "usage": answer.usage}))
        out.append(DONE_EVENT)
        return out

    def error(self, message: str, *, code: str | None = None) -> bytes:
        return chat_error_event(message, code=code)
