"""SGLang's tokens-in dialect, ``sglang_generate`` (see ``capture_proxy.core.engine_formats``).
Pure."""

from __future__ import annotations

from typing import Any

import numpy as np

from capture_proxy.core.engine_formats.base import (
    Decode,
    EngineFormatError,
    Piece,
    PromptIds,
    Reader,
    finish_reason_of,
    held_at_abort,
    matched_stop,
    parsed_chunk,
)
from capture_proxy.core.routed_experts import (
    decode_sglang_routed_experts,
    routed_experts_request_fields,
)
from capture_proxy.core.sampling import Sampling


class SglangGenerateReader:
    """Cumulative chunks: each carries everything so far; the reader returns only what is new."""

    def __init__(self) -> None:
        self.num_ids = 0
        self.num_log_probs = 0
        self.text_len = 0

    def whole(self, body: dict[str, Any]) -> Piece:
        return self.chunk(body)

    def chunk_data(self, data: bytes) -> Piece:
        return parsed_chunk(self, data)

    def chunk(self, body: dict[str, Any]) -> Piece:
        ids = body.get("output_ids")
        meta = body.get("meta_info")
        if not isinstance(meta, dict):
            raise EngineFormatError("SGLang body has no 'meta_info'")
        piece = Piece()
        if isinstance(ids, list):
            piece.saw_token_ids = True
            piece.token_ids = list(ids[self.num_ids :])
            self.num_ids = len(ids)
        entries = meta.get("output_token_logprobs")
        if isinstance(entries, list):
            piece.saw_log_probs = True
            new = entries[self.num_log_probs :]
            self.num_log_probs = len(entries)
            piece.log_probs = [e[0] if isinstance(e, list) and e else None for e in new]
        text = body.get("text")
        if isinstance(text, str):
            piece.text = text[self.text_len :]
            self.text_len = len(text)
        piece.finish_reason = finish_reason_of(meta.get("finish_reason"))
        if piece.finish_reason is not None:  # the last piece only (nothing per token)
            piece.stop_reason = matched_stop(meta.get("finish_reason"))
        held_at_abort(piece)
        piece.routed_experts = meta.get("routed_experts")
        version = meta.get("weight_version")
        piece.weight_version = version if isinstance(version, str) else None
        prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            piece.usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        return piece


class SglangGenerate:
    """``experts_shape``: ``(num_hidden_layers, num_experts_per_tok)`` of an MoE model: SGLang's
    rows are raw int32 and must be reshaped; without it routed experts are not asked for."""

    name = "sglang_generate"
    path = "/generate"
    needs_decode = False

    def __init__(self, experts_shape: tuple[int, int] | None = None) -> None:
        self.experts_shape = experts_shape

    def request(
        self,
        prompt_token_ids: PromptIds,
        sampling: Sampling,
        *,
        stream: bool,
        model: str | None,
        experts_start: int | None = None,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": sampling.max_tokens, **sampling.extra}
        if sampling.stop:
            params["stop"] = sampling.stop
        body: dict[str, Any] = {
            "input_ids": prompt_token_ids,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": stream,
        }
        if experts_start is not None and self.experts_shape is not None:
            # SGLang answers rows [routed_experts_start_len, seq_len - 1) when asked.
            body.update(routed_experts_request_fields(experts_start, dialect="sglang"))
        return body

    def decode_routed_experts(self, raw: Any) -> np.ndarray:
        if self.experts_shape is None:
            raise ValueError("routed_experts: set routed_experts_shape to decode SGLang's rows")
        layers, top_k = self.experts_shape
        return decode_sglang_routed_experts(raw, num_layers=layers, top_k=top_k)

    def reader(self, decode: Decode | None = None) -> Reader:
        return SglangGenerateReader()
