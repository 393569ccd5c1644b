"""What every tokens-in dialect shares (see ``capture_proxy.core.engine_formats``): the
``Piece`` a body or chunk adds, the ``Reader`` and ``Dialect`` protocols, and the finish and
stop fields engines put on a choice. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import orjson

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


def finish_reason_of(value: Any) -> str | None:
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


def held_at_abort(piece: Piece) -> Piece:
    """An engine's text of an aborted piece without its trailing U+FFFD: an abort is no end,
    and a continuation may complete the character it split (SGLang flushes a finished
    request's text whole, a split character as U+FFFD; vLLM holds it back). A continuation's
    reader gives it with the character (``IncrementalText.resume_after``)."""
    if piece.finish_reason == "abort" and piece.text.endswith("\ufffd"):
        piece.text = piece.text.rstrip("\ufffd")
    return piece


def json_list(value: Any, name: str) -> list[Any]:
    """``value``, a JSON array, as a new list. Raises EngineFormatError naming ``name``."""
    if not isinstance(value, list):
        raise EngineFormatError(f"{name} is not a list: {value!r:.40}")
    return list(value)
