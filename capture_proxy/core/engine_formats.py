"""Tokens-in engine dialects: request bodies and response parsing. Pure.

Owns the wire formats of the endpoints exact-token mode sends token ids to. Each dialect builds
the request for (prompt ids, sampling, stream) and turns a response body or stream chunk into a
``Piece``: the new generated token ids, their log probs, the new text, and the finish reason.
A dialect's ``reader()`` is stateful per call, for engines whose stream chunks are cumulative.

- ``vllm_completions``: vLLM ``POST /v1/completions`` with ``prompt`` = token ids (vLLM 0.32):
  ``return_token_ids`` puts ``prompt_token_ids`` and ``token_ids`` on the choice; legacy log
  probs ``choices[0].logprobs.token_logprobs``; streaming chunks carry only new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from capture_proxy.core.sampling import Sampling


class EngineFormatError(ValueError):
    """An engine body does not have the dialect's shape; the message names the field."""


@dataclass
class Piece:
    """What one response body or stream chunk adds. ``prompt_token_ids`` is the engine's echo
    of the prompt (to verify it saw what we sent), when it sends one."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float | None] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    saw_token_ids: bool = False
    saw_log_probs: bool = False


class Reader(Protocol):
    def whole(self, body: dict[str, Any]) -> Piece: ...

    def chunk(self, body: dict[str, Any]) -> Piece: ...


class Dialect(Protocol):
    name: str
    path: str

    def request(
        self, prompt_token_ids: list[int], sampling: Sampling, *, stream: bool, model: str | None
    ) -> dict[str, Any]: ...

    def reader(self) -> Reader: ...


def _finish_reason(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):  # SGLang: {"type": "stop" | "length" | "abort", "matched": ...}
        kind = value.get("type")
        return kind if isinstance(kind, str) else None
    return str(value)


class VllmCompletionsReader:
    def whole(self, body: dict[str, Any]) -> Piece:
        return self._choice(body, body)

    def chunk(self, body: dict[str, Any]) -> Piece:
        return self._choice(body, body)

    @staticmethod
    def _choice(body: dict[str, Any], top: dict[str, Any]) -> Piece:
        piece = Piece(usage=top.get("usage") or None)
        choices = body.get("choices")
        if not isinstance(choices, list):
            raise EngineFormatError("completions body has no 'choices' list")
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if choice.get("prompt_token_ids") is not None:
                piece.prompt_token_ids = choice["prompt_token_ids"]
            if choice.get("token_ids") is not None:
                piece.saw_token_ids = True
                piece.token_ids = list(choice["token_ids"])
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and logprobs.get("token_logprobs") is not None:
                piece.saw_log_probs = True
                piece.log_probs = list(logprobs["token_logprobs"])
            piece.text = choice.get("text") or ""
            piece.finish_reason = _finish_reason(choice.get("finish_reason"))
        if top.get("prompt_token_ids") is not None and piece.prompt_token_ids is None:
            piece.prompt_token_ids = top["prompt_token_ids"]
        return piece


class VllmCompletions:
    name = "vllm_completions"
    path = "/v1/completions"

    def request(
        self, prompt_token_ids: list[int], sampling: Sampling, *, stream: bool, model: str | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt_token_ids,
            "max_tokens": sampling.max_tokens,
            "logprobs": 0,
            "return_token_ids": True,
            "stream": stream,
            **sampling.extra,
        }
        if model:
            body["model"] = model
        if sampling.stop:
            body["stop"] = sampling.stop
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def reader(self) -> Reader:
        return VllmCompletionsReader()


DIALECTS: dict[str, Dialect] = {"vllm_completions": VllmCompletions()}


def get_dialect(name: str) -> Dialect:
    """Raises KeyError naming the known dialects."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise KeyError(
            f"unknown tokens-in dialect {name!r}; known: {', '.join(DIALECTS)}"
        ) from None
