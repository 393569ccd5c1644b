"""What the scripted engine's handlers share: its options, the app's state and its errors.

Owns ``ScriptedEngineConfig`` (one engine's options), the typed keys of the app's state (set
once by ``app.build_scripted_engine_app``), ``SentCall`` (the record of answered calls that
tests compare against), ``RequestError`` (a client error) and ``check_model`` (vLLM's 404 for a
model it does not serve). The chat endpoints (``app``) and
the tokens-in endpoints (``tokens_in``) both read these, so neither imports the other for
them. Must not: handle a request or load the tokenizer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerFast

from capture_proxy.families.vision import QWEN3_VL_PROCESSOR, VisionProcessorConfig
from capture_proxy.scripted_engine.families import EngineFamily
from capture_proxy.scripted_engine.faults import Faults
from capture_proxy.scripted_engine.moe import MoeShape
from capture_proxy.scripted_engine.policy import Policy


@dataclass(frozen=True)
class ScriptedEngineConfig:
    """Options of one scripted engine. ``sse_fragment_bytes``: write each SSE event in pieces
    of that many bytes; ``omit_token_ids``: ignore ``return_token_ids``/``logprobs`` like a
    plain OpenAI server; ``fail_status``: answer every chat request with that HTTP status;
    ``responder``: answers a request body with an assistant message (tool calls with ids),
    replacing the policy (used to replay recorded sessions)."""

    policy: Policy = field(default_factory=Policy.default)
    responder: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    tokenizer_template: str = "keep_reasoning"
    #: a chat template's jinja text that the Qwen families render with instead of
    #: ``tokenizer_template`` (a published template, e.g. Qwen3's, in tests)
    chat_template: str | None = None
    #: the model family it renders and writes as (``capture_proxy.families``): qwen3
    #: (Hermes JSON, with ``tokenizer_template``), qwen3_coder (XML tool calls), gpt_oss
    #: (harmony), llama3 (JSON tool calls; needs ``tokenizer_dir``); the proxy's exact-token
    #: mode renders and parses with the same objects
    family: str = "qwen3"
    #: the family's own tokenizer directory (tokenizer.json + chat template): required for
    #: llama3, optional for the Qwen families (unset: the built-in Qwen tokenizer)
    tokenizer_dir: Path | None = None
    #: the model it serves (vLLM's first ``--served-model-name``), and more names for it
    #: (the others): a request naming another model is a 404 (``check_model``)
    model_name: str = "scripted-qwen"
    model_aliases: tuple[str, ...] = ()
    max_model_len: int = 32768
    sse_fragment_bytes: int | None = None
    omit_token_ids: bool = False
    fail_status: int | None = None
    #: with ``fail_status``: fail only the first this many chat requests (None: all)
    fail_first_n: int | None = None
    tokenizer_cache_dir: Path | None = None
    #: MoE mode: ``(num_layers, top_k, num_experts)``; non-streaming answers then carry
    #: ``choices[0].routed_experts`` (vLLM: base64 ``.npy``, rows from the request's
    #: ``routed_experts_prompt_start``). Streams carry none, like vLLM.
    moe: MoeShape | None = None
    #: Serve vLLM's ``/inference/v1/generate`` (vLLM's ``--enable-scale-out``); else 404.
    enable_scale_out: bool = False
    #: Serve vLLM's weight-update endpoints (``VLLM_SERVER_DEV_MODE=1``; ``weights.py``).
    dev_mode: bool = False
    #: SGLang ``/generate`` streams deltas (``--incremental-streaming-output``), not the
    #: default cumulative ``text`` / ``output_ids`` / log probs.
    sglang_incremental_streaming: bool = False
    #: injected misbehaviour of chat completions (see ``faults.Faults``)
    faults: Faults = field(default_factory=Faults)
    #: the image processor of a Qwen-VL model (``families.vision``): an image in a prompt
    #: renders as the template's placeholder, expanded to its tokens as vLLM's processor
    #: does; None: images are refused, as a text-only model's
    vision: VisionProcessorConfig | None = QWEN3_VL_PROCESSOR

    @property
    def served_models(self) -> tuple[str, ...]:
        """Every name the engine answers to, ``model_name`` first."""
        return (self.model_name, *self.model_aliases)


@dataclass(frozen=True)
class SentCall:
    """One chat completion the engine answered, in arrival order. ``generation_log_probs[i]``
    belongs to ``generation_token_ids[i]``; the last id is 151645 unless finish is length."""

    request_body: dict[str, Any]
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    stream: bool
    finish_reason: str
    #: the HTTP headers of the request (chat completions), e.g. to check credentials
    request_headers: dict[str, str] = field(default_factory=dict)
    #: the client's (host, port): equal for calls that came over one kept-alive connection
    peer: tuple[str, int] | None = None


CONFIG = web.AppKey("scripted_engine_config", ScriptedEngineConfig)
#: set when a client went away mid-request: a stream could not be written to the end, or the
#: server cancelled a handler (its client's connection was lost)
CLIENT_GONE = web.AppKey("scripted_engine_client_gone", asyncio.Event)
TOKENIZER = web.AppKey("scripted_engine_tokenizer", PreTrainedTokenizerFast)
TEMPLATE = web.AppKey("scripted_engine_template", str)
FAMILY = web.AppKey("scripted_engine_family", EngineFamily)
SENT_CALLS = web.AppKey("scripted_engine_sent_calls", list[SentCall])
#: every request the engine received, in arrival order: (method, path, headers), e.g. to
#: check which engine of several served a rollout's /tokenize and tokens-in requests
SEEN_REQUESTS = web.AppKey("scripted_engine_seen_requests", list[tuple[str, str, dict[str, str]]])
#: the latest generations (prompt ids, full generation), newest last, so that a prompt that is
#: one of them followed by the first tokens of its generation (a generation continued after an
#: abort, tokens in) gets the rest of the same generation, as a model would
GENERATIONS = web.AppKey("scripted_engine_generations", list[tuple[list[int], Any]])
#: chat requests failed so far by ``fail_status`` (a one-item list: app state is set once)
FAILED_SO_FAR = web.AppKey("scripted_engine_failed_so_far", list[int])


class RequestError(ValueError):
    """A client error: becomes a 400 ``{"error": {...}}`` body (``error_type``: its
    ``type``, else ``invalid_request_error`` / ``server_error`` by the status)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.error_type = param, status, error_type


def check_model(app: web.Application, body: dict[str, Any]) -> None:
    """Refuse a ``model`` the engine does not serve, as vLLM 0.32 does (``OpenAIServing.
    _check_model`` in ``vllm/entrypoints/serve/engine/serving.py``, on chat and text
    completions, ``/tokenize``, ``/detokenize`` and ``/inference/v1/generate``): a 404
    ``{"error": {"message": "The model `X` does not exist. Valid aliases: NAME.", "type":
    "NotFoundError", "param": "model", "code": 404}}``. No ``model``, or an empty one, is the
    served model (vLLM's ``_is_model_supported``). Raises RequestError."""
    model = body.get("model")
    served = app[CONFIG].served_models
    if not model or model in served:
        return
    raise RequestError(
        f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
        "model",
        404,
        error_type="NotFoundError",
    )
