"""Tokens-in engine dialects: request bodies and response parsing. Pure.

Owns the wire formats of the endpoints exact-token mode sends token ids to. Each dialect builds
the request for (prompt ids, sampling, stream) and turns a response body or stream chunk into a
``Piece``: the new generated token ids, their log probs, the new text, and the finish reason.
A dialect's ``reader()`` is stateful per call, for engines whose stream chunks are cumulative.

- ``vllm_completions``: vLLM ``POST /v1/completions`` with ``prompt`` = token ids (vLLM 0.32):
  legacy log probs ``choices[0].logprobs.token_logprobs``, and with
  ``return_tokens_as_token_ids`` their ``tokens`` as ``token_id:<id>``; ``return_token_ids``
  (asked only to echo the prompt) puts ``prompt_token_ids`` and ``token_ids`` on the choice;
  streaming chunks carry only new tokens.
- ``vllm_generate``: vLLM ``POST /inference/v1/generate`` (server flag ``--enable-scale-out``):
  ``token_ids`` + ``sampling_params``; choices carry ``token_ids`` and chat-shaped
  ``logprobs.content[].logprob`` but no text, so the text comes from a local tokenizer; the
  whole answer and the stream's last chunk carry ``weight_versions`` spans (vLLM 0.32); with
  ``return_token_ids`` (asked for a prompt with images, ``flow.exact_images``) the body's
  ``prompt_token_ids`` is the prompt as the engine's processor expanded it.
- ``sglang_generate``: SGLang ``POST /generate`` with ``input_ids``, ``return_logprob`` and
  ``logprob_start_len: -1``; ``output_ids``, ``text``, ``meta_info.output_token_logprobs``
  (``[logprob, token_id, text]``), ``meta_info.finish_reason`` ``{type, matched}``,
  ``meta_info.weight_version``. Streamed
  chunks are cumulative (SGLang's default; do not run it with ``--incremental-streaming-output``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import orjson

from capture_proxy.core import chunk_scan
from capture_proxy.core.routed_experts import (
    decode_sglang_routed_experts,
    decode_vllm_routed_experts,
    routed_experts_request_fields,
)
from capture_proxy.core.sampling import Sampling
from capture_proxy.core.sse import parse_json_event


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
    #: what matched when the engine stopped (vLLM ``stop_reason``, SGLang
    #: ``finish_reason.matched``): a stop string or a stop token id; None: not said
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    saw_token_ids: bool = False
    saw_log_probs: bool = False
    #: the engine's routed experts as sent (vLLM: base64 ``.npy``; SGLang: base64 int32)
    routed_experts: Any = None
    #: vLLM ``/inference/v1/generate``: ``choices[0].weight_versions``, the version spans over
    #: the request's output tokens (whole answer, or the stream's last chunk), as sent
    weight_versions: Any = None
    #: SGLang: ``meta_info.weight_version``, the engine's version when it answered
    weight_version: str | None = None


class Reader(Protocol):
    def whole(self, body: dict[str, Any]) -> Piece: ...

    def chunk(self, body: dict[str, Any]) -> Piece: ...

    def chunk_data(self, data: bytes) -> Piece:
        """``chunk`` of one stream event's data (its JSON, as bytes). Raises ValueError (not
        JSON, not UTF-8), EngineFormatError."""
        ...


def parsed_chunk(reader: Reader, data: bytes) -> Piece:
    """``reader.chunk`` of ``data`` parsed (``sse.parse_json_event``): ``chunk_data`` for a
    reader with no short cut."""
    return reader.chunk(parse_json_event(data))


#: ``decode(token_ids) -> text`` without special tokens (a local tokenizer).
Decode = Callable[[list[int]], str]


#: Prompt ids as a dialect puts them in a body: a list, a uint32 array, or JSON text.
PromptIds = Sequence[int] | np.ndarray | orjson.Fragment


class Dialect(Protocol):
    name: str
    path: str
    #: True when responses carry no text, so a local tokenizer must decode the ids.
    needs_decode: bool

    def request(
        self,
        prompt_token_ids: PromptIds,
        sampling: Sampling,
        *,
        stream: bool,
        model: str | None,
        experts_start: int | None = None,
    ) -> dict[str, Any]:
        """The request body; ``prompt_token_ids`` is put in as given (a list, a uint32 array
        the caller serialises without a copy to Python ints, or the ids written already as an
        ``orjson.Fragment``). ``experts_start``: ask
        for routed-expert rows from that token position on (the rows the parent does not hold;
        None: do not ask, for engines that must be asked explicitly)."""

    def decode_routed_experts(self, raw: Any) -> np.ndarray:
        """The engine's routed experts as an integer array ``[rows, layers, top_k]``. Raises
        ValueError."""

    def reader(self, decode: Decode | None = None) -> Reader: ...


def _finish_reason(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):  # SGLang: {"type": "stop" | "length" | "abort", "matched": ...}
        kind = value.get("type")
        return kind if isinstance(kind, str) else None
    return str(value)


def matched_stop(value: Any) -> str | int | None:
    """A stop string or token id (vLLM ``stop_reason``; SGLang's ``matched_stop`` of an
    OpenAI-style choice, or its ``finish_reason`` object's ``matched``); None for anything
    else."""
    if isinstance(value, dict):
        value = value.get("matched")
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    return None


def choice_stop(choice: Mapping[str, Any]) -> str | int | None:
    """What an OpenAI-style choice says matched when the engine stopped: vLLM's
    ``stop_reason``, else SGLang's ``matched_stop``."""
    value = choice.get("stop_reason")
    return matched_stop(choice.get("matched_stop") if value is None else value)


def ends_text(finish_reason: str | None, whole: bool) -> bool:
    """Whether a piece with ``finish_reason`` ends the generation's text (``whole``: a whole
    answer). An abort never does: a continuation may follow and complete a character it
    split, so a split character's first bytes are held back, not flushed as U+FFFD."""
    return finish_reason != "abort" and (whole or finish_reason is not None)


def _held_at_abort(piece: Piece) -> Piece:
    """An engine's text of an aborted piece without its trailing U+FFFD: an abort is no end,
    and a continuation may complete the character it split (SGLang flushes a finished
    request's text whole, a split character as U+FFFD; vLLM holds it back). A continuation's
    reader gives it with the character (``IncrementalText.resume_after``)."""
    if piece.finish_reason == "abort" and piece.text.endswith("\ufffd"):
        piece.text = piece.text.rstrip("\ufffd")
    return piece


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


def _list(value: Any, name: str) -> list[Any]:
    """``value``, a JSON array, as a new list. Raises EngineFormatError naming ``name``."""
    if not isinstance(value, list):
        raise EngineFormatError(f"{name} is not a list: {value!r:.40}")
    return list(value)


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
                piece.token_ids = _list(choice["token_ids"], "choices[0].token_ids")
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and logprobs.get("token_logprobs") is not None:
                piece.saw_log_probs = True
                piece.log_probs = _list(logprobs["token_logprobs"], "logprobs.token_logprobs")
            if not piece.saw_token_ids and isinstance(logprobs, dict):
                tokens = logprobs.get("tokens")
                if tokens is not None:
                    piece.saw_token_ids = True
                    piece.token_ids = _ids_of_token_strings(tokens)
            piece.text = choice.get("text") or ""
            if not isinstance(piece.text, str):
                raise EngineFormatError(f"choices[0].text is not a string: {piece.text!r:.40}")
            piece.finish_reason = _finish_reason(choice.get("finish_reason"))
            if piece.finish_reason is not None:  # the last piece only (nothing per token)
                piece.stop_reason = choice_stop(choice)
            piece.routed_experts = choice.get("routed_experts")
        if top.get("prompt_token_ids") is not None and piece.prompt_token_ids is None:
            piece.prompt_token_ids = top["prompt_token_ids"]
        return _held_at_abort(piece)


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


class IncrementalText:
    """Text of a growing id sequence, emitted as it becomes stable, at a constant cost per
    token: each step decodes only a short window (the ids from ``prefix`` on), as vLLM's and
    transformers' incremental detokenizers do, and emits what the window's text gained over
    the text of its already-emitted part (both decoded from the same start, so a token that
    decodes differently at the window's edge cancels out). A trailing U+FFFD (a multi-byte
    character split across tokens) is held back until it completes, or until ``final``."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        #: the window's start and the end of the ids whose text was emitted
        self.prefix = 0
        self.read = 0
        #: characters at the end of the emitted ids' text not emitted (``resume_after``)
        self.held = 0

    def resume_after(self, ids: list[int], given: str) -> None:
        """Go on after ``ids``, of whose text ``given`` was emitted (a continuation's first ids
        follow). What ``given`` lacks of the ids' text (the first bytes of a character an abort
        split, held back) comes out with the character once the next ids complete it."""
        self.ids = list(ids)
        self.read = len(self.ids)
        self.prefix = max(0, self.read - WINDOW)
        whole = self.decode(self.ids)
        self.held = len(whole) - len(given) if whole.startswith(given) else 0

    def add(self, ids: list[int], *, final: bool = False) -> str:
        self.ids.extend(ids)
        if len(self.ids) == self.read:
            return ""
        emitted = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        start = len(emitted) - self.held
        if len(text) <= start or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix = max(self.prefix, self.read - WINDOW)
        self.read = len(self.ids)
        self.held = 0
        return text[start:]


#: ids before the newly emitted ones a window keeps
#: (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
WINDOW = 5


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
            piece.finish_reason = _finish_reason(choice.get("finish_reason"))
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
        piece.finish_reason = _finish_reason(meta.get("finish_reason"))
        if piece.finish_reason is not None:  # the last piece only (nothing per token)
            piece.stop_reason = matched_stop(meta.get("finish_reason"))
        _held_at_abort(piece)
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


DIALECTS: dict[str, Dialect] = {
    d.name: d for d in (VllmCompletions(), VllmGenerate(), SglangGenerate())
}


def get_dialect(
    name: str, *, experts_shape: tuple[int, int] | None = None, echo_prompt: bool = False
) -> Dialect:
    """Raises KeyError naming the known dialects. ``experts_shape``: see ``SglangGenerate``;
    ``echo_prompt``: see ``VllmCompletions``."""
    if name == SglangGenerate.name:
        return SglangGenerate(experts_shape)
    if name == VllmCompletions.name:
        return VllmCompletions(echo_prompt)
    try:
        return DIALECTS[name]
    except KeyError:
        raise KeyError(
            f"unknown tokens-in dialect {name!r}; known: {', '.join(DIALECTS)}"
        ) from None
