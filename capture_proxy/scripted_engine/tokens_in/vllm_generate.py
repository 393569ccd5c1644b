"""vLLM's ``POST /inference/v1/generate`` on the scripted engine (tokens in, tokens out; only
with ``enable_scale_out``): its request options and errors (``vllm.vllm_fail``), its answer
and stream chunks (chat-shaped log probs with ``token_id:<id>`` tokens, token ids, usage,
routed experts). Source (vLLM main of 2026):
``entrypoints/serve/disagg/{protocol,serving,api_router}.py``. Must not: render chat templates
(the prompt is given).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from capture_proxy.scripted_engine.moe import vllm_routed_experts
from capture_proxy.scripted_engine.state import CONFIG, FAMILY, RequestError, check_model
from capture_proxy.scripted_engine.tokens_in import wire
from capture_proxy.scripted_engine.tokens_in.tokens_out import (
    TokensOut,
    alternates,
    record_abort,
    record_call,
    run_generation,
)
from capture_proxy.scripted_engine.tokens_in.vllm import vllm_fail, vllm_prompt_len_check
from capture_proxy.scripted_engine.weights import Sampler, sampler


def _chat_logprobs(out: TokensOut, lo: int, hi: int, n: int) -> dict[str, Any]:
    """``ChatCompletionLogProbs`` as ``ServingTokens._create_tokens_logprobs`` builds it:
    tokens as ``token_id:<id>``, ``bytes`` null, ``max(n, 1)`` top entries."""
    content = []
    for tid, lp in zip(out.ids[lo:hi], out.log_probs[lo:hi], strict=True):
        tops = [
            {"token": f"token_id:{t}", "logprob": v, "bytes": None}
            for t, v in alternates(tid, lp, max(n, 1))
        ]
        content.append(
            {"token": f"token_id:{tid}", "logprob": lp, "bytes": None, "top_logprobs": tops}
        )
    return {"content": content}


def _generate_json(
    app: web.Application,
    body: dict[str, Any],
    out: TokensOut,
    n_lp: int | None,
    request_id: str,
    spans: list[dict[str, Any]],
) -> dict[str, Any]:
    """The non-streamed answer of ``/inference/v1/generate`` (``weight_versions``: the spans
    of the versions that sampled the tokens, ``vllm/outputs.py`` ``WeightVersionSpan``)."""
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None if n_lp is None else _chat_logprobs(out, 0, len(out.ids), n_lp),
        "finish_reason": out.finish,
        "token_ids": out.ids,
        "routed_experts": None,
        "weight_versions": spans,
    }
    if app[CONFIG].moe is not None:
        start = body.get("routed_experts_prompt_start", 0)
        rows = wire.moe_rows(app, out, start, "routed_experts_prompt_start", vllm_fail)
        choice["routed_experts"] = vllm_routed_experts(rows)
    return {
        "request_id": request_id,
        "model": app[CONFIG].model_name,
        "created": int(time.time()),
        "choices": [choice],
        "usage": {**wire.usage(out), "prompt_tokens_details": None},
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def _generate_events(
    out: TokensOut, n_lp: int | None, request_id: str, include_usage: bool, walk: Sampler
) -> list[wire.Event]:
    """The stream's chunks of ``/inference/v1/generate``: one per token (the last one with
    ``weight_versions``, made when it is sent), then usage."""
    events: list[wire.Event] = []
    for k, tid in enumerate(out.ids):
        last = k == len(out.ids) - 1
        choice = {
            "index": 0,
            "logprobs": None if n_lp is None else _chat_logprobs(out, k, k + 1, n_lp),
            "finish_reason": out.finish if last else None,
            "token_ids": [tid],
            "routed_experts": None,
            "weight_versions": None,
        }
        event = {"request_id": request_id, "choices": [choice], "usage": None}
        if last:

            def with_spans(event: dict[str, Any] = event) -> dict[str, Any]:
                event["choices"][0]["weight_versions"] = walk.spans
                return event

            events.append(with_spans)
        else:
            events.append(event)
    if include_usage:
        events.append({"request_id": request_id, "choices": [], "usage": wire.usage(out)})
    return events


def _generate_options(app: web.Application, body: dict[str, Any]) -> dict[str, Any]:
    """The validated options of a ``/inference/v1/generate`` body. Raises RequestError."""
    f = vllm_fail
    vocab = len(app[FAMILY])
    ids = body.get("token_ids")
    if not (isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < vocab for t in ids)):
        raise RequestError("token_ids must be a non-empty list of token ids", "token_ids")
    parts = body.get("content_parts") or []
    if not isinstance(parts, list) or any(
        not isinstance(p, dict) or p.get("type") != "image_url" for p in parts
    ):
        raise RequestError("content_parts must be a list of image_url parts", "content_parts")
    ids = wire.expand_images(app, ids, [p.get("url") for p in parts], "content_parts", f)
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise RequestError("sampling_params is required and must be an object", "sampling_params")
    check_model(app, body)
    if sp.get("n", 1) != 1:
        raise RequestError("only n=1 is supported", "sampling_params.n")
    max_tokens = sp.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise RequestError("max_tokens must be a positive integer", "sampling_params.max_tokens")
    n_lp = wire.field(sp, "logprobs", "int", None, f)
    for key in ("temperature", "top_p"):
        wire.field(sp, key, "num", None, f)
    wire.field(sp, "seed", "int", None, f)
    stream = wire.field(body, "stream", "bool", False, f)
    so = wire.field(body, "stream_options", "dict", {}, f)
    limit = app[CONFIG].max_model_len - len(ids)
    if limit <= 0:
        vllm_prompt_len_check(app, ids, None)
    return {
        "prompt": list(ids),
        "max_tokens": min(max_tokens or limit, limit),
        "stop": wire.stop_list(sp.get("stop"), "sampling_params.stop", f),
        "stop_token_ids": wire.id_list(
            sp.get("stop_token_ids"), "sampling_params.stop_token_ids", vocab, f
        ),
        "skip_special_tokens": wire.field(sp, "skip_special_tokens", "bool", True, f),
        "keep_stop": wire.field(sp, "include_stop_str_in_output", "bool", False, f),
        "logprobs": n_lp,
        "stream": stream,
        "include_usage": so.get("include_usage") is True,
    }


async def inference_generate(request: web.Request) -> web.StreamResponse:
    """``POST /inference/v1/generate`` (vLLM tokens in, tokens out): ``token_ids``,
    ``sampling_params`` (vLLM ``SamplingParams``: ``max_tokens`` (default: what fits),
    ``temperature``, ``top_p``, ``seed``, ``stop``, ``stop_token_ids``,
    ``include_stop_str_in_output``, ``logprobs`` (int), ``n`` 1 only; others ignored),
    ``model``, ``request_id``, ``stream``, ``stream_options.include_usage``, and
    ``content_parts`` (``[{"type": "image_url", "url": <data: URL>}]``: one ``<|image_pad|>``
    per image in ``token_ids``, expanded as vLLM's processor does) with ``return_token_ids``
    (the expanded prompt ids and ``mm_placeholders`` in the answer). The last choice carries
    ``weight_versions``; under a pause it waits to be scheduled, holds or ends ``"abort"``."""
    app = request.app
    body = await wire.read_json(request, vllm_fail)
    wire.check_fault(app)
    opts = _generate_options(app, body)
    walk = sampler(app)
    await walk.admit()
    try:
        return await _generate(request, body, opts, walk)
    finally:
        await walk.finish()


async def _generate(
    request: web.Request, body: dict[str, Any], opts: dict[str, Any], walk: Sampler
) -> web.StreamResponse:
    app = request.app
    out = run_generation(
        app,
        opts["prompt"],
        max_tokens=opts["max_tokens"],
        stop=opts["stop"],
        stop_token_ids=opts["stop_token_ids"],
        skip_special_tokens=opts["skip_special_tokens"],
        keep_stop=opts["keep_stop"],
    )
    index = record_call(app, body, out, opts["stream"])
    request_id, n_lp = uuid.uuid4().hex, opts["logprobs"]
    echo = None
    if wire.field(body, "return_token_ids", "bool", False, vllm_fail):
        prompt = opts["prompt"]
        echo = {"prompt_token_ids": prompt, "mm_placeholders": wire.placeholders(prompt)}
    if not opts["stream"]:
        done = await walk.walk(len(out.ids))
        if done < len(out.ids):
            out = record_abort(app, index, out.aborted(done))
        whole = _generate_json(app, body, out, n_lp, request_id, walk.spans)
        return wire.json_response({**whole, **(echo or {})})

    def on_abort(k: int) -> list[wire.Event]:
        cut = record_abort(app, index, out.aborted(k))
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None if n_lp is None else {"content": []},
            "finish_reason": "abort",
            "token_ids": [],
            "routed_experts": None,
            "weight_versions": walk.spans,
        }
        events: list[wire.Event] = [{"request_id": request_id, "choices": [choice], "usage": None}]
        if opts["include_usage"]:
            events.append({"request_id": request_id, "choices": [], "usage": wire.usage(cut)})
        return events

    events = _generate_events(out, n_lp, request_id, opts["include_usage"], walk)
    if echo is not None and events:
        first = events[0]
        assert isinstance(first, dict)  # (the last chunk alone is made when sent)
        events[0] = {**first, **echo}  # vLLM: in the first chunk only
    return await wire.sse(request, events, wire.Gate(walk, len(out.ids), on_abort))
