"""vLLM's tokens-in dialects, ``vllm_completions`` and ``vllm_generate`` (see
``capture_proxy.core.engine_formats``). Pure."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from capture_proxy.core import chunk_scan
from capture_proxy.core.engine_formats.base import (
    Decode,
    EngineFormatError,
    Piece,
    PromptIds,
    Reader,
    choice_stop,
    ends_text,
    finish_reason_of,
    held_at_abort,
    json_list,
    parsed_chunk,
)
from capture_proxy.core.engine_formats.incremental import IncrementalText
from capture_proxy.core.routed_experts import (
    decode_vllm_routed_experts,
    routed_experts_request_fields,
)
from capture_proxy.core.sampling import Sampling
from capture_proxy.core.sse import parse_json_event

#: vLLM's ``return_tokens_as_token_ids`` form of a log-prob token (``format_token_id_placeholder``)
TOKEN_ID_PREFIX = "token_id:"


#: a list of ``token_id:<int>`` joined by commas (the short cut of ``_ids_of_token_strings``)
_JOINED_TOKEN_IDS = re.compile(r"token_id:[0-9]+(?:,token_id:[0-9]+)*")


def _ids_of_token_strings(tokens: Any) -> list[int]:
    """Token ids from log-prob ``tokens`` of the form ``token_id:<int>``. Raises
    EngineFormatError on any other form (the engine ignored ``return_tokens_as_token_ids``)."""
    if not isinstance(tokens, list):
        raise EngineFormatError("logprobs.tokens is not a list")
    if len(tokens) > 8:
        # One regex over the joined strings, then one split: a third less than the per-token
        # loop. As many ids as strings, each part of the form: no string held a comma.
        try:
            joined = ",".join(tokens)
        except TypeError:  # not all strings: the loop names the first
            joined = ""
        if _JOINED_TOKEN_IDS.fullmatch(joined) is not None:
            fast = list(map(int, joined.replace(TOKEN_ID_PREFIX, "").split(",")))
            if len(fast) == len(tokens):
                return fast
    ids = []
    for token in tokens:
        if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
            raise EngineFormatError(
                f"logprobs.tokens entry {token!r} is not 'token_id:<id>' "
                "(return_tokens_as_token_ids ignored?)"
            )
        digits = token[len(TOKEN_ID_PREFIX) :]
        if not digits.isdigit() or not digits.isascii():
            raise EngineFormatError(f"logprobs.tokens entry {token!r} has no token id")
        ids.append(int(digits))
    return ids


class VllmCompletionsReader:
    def whole(self, body: dict[str, Any]) -> Piece:
        return self._choice(body, body)

    def chunk(self, body: dict[str, Any]) -> Piece:
        return self._choice(body, body)

    def chunk_data(self, data: bytes) -> Piece:
        """A middle chunk (the compiled scan, ``chunk_scan.SCAN_COMPLETIONS``) without its
        parse; any other, and every chunk where the scan is not built, parsed."""
        scan = chunk_scan.SCAN_COMPLETIONS
        scanned = scan(data) if scan is not None else None
        if scanned is None:
            return self.chunk(parse_json_event(data))
        text, token_ids, log_probs = scanned
        if log_probs is None:
            return Piece(token_ids, text=text, saw_token_ids=True)
        return Piece(token_ids, log_probs, text, saw_token_ids=True, saw_log_probs=True)

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
                piece.token_ids = json_list(choice["token_ids"], "choices[0].token_ids")
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and logprobs.get("token_logprobs") is not None:
                piece.saw_log_probs = True
                piece.log_probs = json_list(logprobs["token_logprobs"], "logprobs.token_logprobs")
            if not piece.saw_token_ids and isinstance(logprobs, dict):
                tokens = logprobs.get("tokens")
                if tokens is not None:
                    piece.saw_token_ids = True
                    piece.token_ids = _ids_of_token_strings(tokens)
            piece.text = choice.get("text") or ""
            if not isinstance(piece.text, str):
                raise EngineFormatError(f"choices[0].text is not a string: {piece.text!r:.40}")
            piece.finish_reason = finish_reason_of(choice.get("finish_reason"))
            if piece.finish_reason is not None:  # the last piece only (nothing per token)
                piece.stop_reason = choice_stop(choice)
            piece.routed_experts = choice.get("routed_experts")
        if top.get("prompt_token_ids") is not None and piece.prompt_token_ids is None:
            piece.prompt_token_ids = top["prompt_token_ids"]
        return held_at_abort(piece)


class VllmCompletions:
    """vLLM ``/v1/completions`` with token ids in. Generated ids come from the log probs
    (``return_tokens_as_token_ids``: ``logprobs.tokens`` = ``token_id:<id>``), so the answer
    grows with the generation only. ``echo_prompt``: also ask for ``return_token_ids``, whose
    ``prompt_token_ids`` echo lets the proxy check the prompt id for id (the answer then
    carries the whole prompt: about 2 ms of proxy CPU per call at 54k tokens); without it the
    prompt is checked by its length (``usage.prompt_tokens``)."""

    name = "vllm_completions"
    path = "/v1/completions"
    needs_decode = False

    def __init__(self, echo_prompt: bool = False) -> None:
        self.echo_prompt = echo_prompt

    def request(
        self,
        prompt_token_ids: PromptIds,
        sampling: Sampling,
        *,
        stream: bool,
        model: str | None,
        experts_start: int | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt_token_ids,
            "max_tokens": sampling.max_tokens,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "stream": stream,
            **sampling.extra,
        }
        if self.echo_prompt:
            body["return_token_ids"] = True
        if model:
            body["model"] = model
        if sampling.stop:
            body["stop"] = sampling.stop
        if stream:
            body["stream_options"] = {"include_usage": True}
        # vLLM returns rows whenever it runs with --enable-return-routed-experts; only the
        # rows after the parent's are asked for, as in backend-template mode.
        body.update(routed_experts_request_fields(experts_start))
        return body

    def decode_routed_experts(self, raw: Any) -> np.ndarray:
        return decode_vllm_routed_experts(raw)

    def reader(self, decode: Decode | None = None) -> Reader:
        return VllmCompletionsReader()


class VllmGenerateReader:
    def __init__(self, decode: Decode) -> None:
        self.text = IncrementalText(decode)

    def whole(self, body: dict[str, Any]) -> Piece:
        return self._piece(body, final=True)

    def chunk(self, body: dict[str, Any]) -> Piece:
        return self._piece(body, final=False)

    def chunk_data(self, data: bytes) -> Piece:
        return parsed_chunk(self, data)

    def _piece(self, body: dict[str, Any], *, final: bool) -> Piece:
        piece = Piece(usage=body.get("usage") or None)
        if isinstance(body.get("prompt_token_ids"), list):
            # asked with ``return_token_ids`` (a prompt with images): the expanded prompt
            piece.prompt_token_ids = body["prompt_token_ids"]
        choices = body.get("choices")
        if not isinstance(choices, list):
            raise EngineFormatError("generate body has no 'choices' list")
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if choice.get("token_ids") is not None:
                piece.saw_token_ids = True
                piece.token_ids = list(choice["token_ids"])
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and logprobs.get("content") is not None:
                piece.saw_log_probs = True
                piece.log_probs = [e.get("logprob") for e in logprobs["content"]]
            piece.finish_reason = finish_reason_of(choice.get("finish_reason"))
            if piece.finish_reason is not None:  # the last piece only (nothing per token)
                piece.stop_reason = choice_stop(choice)
            piece.routed_experts = choice.get("routed_experts")
            piece.weight_versions = choice.get("weight_versions")
        piece.text = self.text.add(piece.token_ids, final=ends_text(piece.finish_reason, final))
        return piece


class VllmGenerate:
    name = "vllm_generate"
    path = "/inference/v1/generate"
    needs_decode = True

    def request(
        self,
        prompt_token_ids: PromptIds,
        sampling: Sampling,
        *,
        stream: bool,
        model: str | None,
        experts_start: int | None = None,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_tokens": sampling.max_tokens,
            "logprobs": 0,
            **sampling.extra,
        }
        if sampling.stop:
            params["stop"] = sampling.stop
        body: dict[str, Any] = {
            "token_ids": prompt_token_ids,
            "sampling_params": params,
            "stream": stream,
        }
        if model:
            body["model"] = model
        if stream:
            body["stream_options"] = {"include_usage": True}
        body.update(routed_experts_request_fields(experts_start))
        return body

    def decode_routed_experts(self, raw: Any) -> np.ndarray:
        return decode_vllm_routed_experts(raw)

    def reader(self, decode: Decode | None = None) -> Reader:
        if decode is None:
            raise EngineFormatError(
                "vllm_generate answers carry no text: a local tokenizer is needed"
            )
        return VllmGenerateReader(decode)
