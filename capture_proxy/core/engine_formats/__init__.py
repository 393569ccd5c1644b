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

from capture_proxy.core.engine_formats.base import (
    Decode,
    Dialect,
    EngineFormatError,
    Piece,
    PromptIds,
    Reader,
    choice_stop,
    ends_text,
    matched_stop,
    parsed_chunk,
)
from capture_proxy.core.engine_formats.incremental import WINDOW, IncrementalText
from capture_proxy.core.engine_formats.sglang import SglangGenerate, SglangGenerateReader
from capture_proxy.core.engine_formats.vllm import (
    TOKEN_ID_PREFIX,
    VllmCompletions,
    VllmCompletionsReader,
    VllmGenerate,
    VllmGenerateReader,
)

__all__ = [
    "DIALECTS",
    "TOKEN_ID_PREFIX",
    "WINDOW",
    "Decode",
    "Dialect",
    "EngineFormatError",
    "IncrementalText",
    "Piece",
    "PromptIds",
    "Reader",
    "SglangGenerate",
    "SglangGenerateReader",
    "VllmCompletions",
    "VllmCompletionsReader",
    "VllmGenerate",
    "VllmGenerateReader",
    "choice_stop",
    "ends_text",
    "get_dialect",
    "matched_stop",
    "parsed_chunk",
]


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
