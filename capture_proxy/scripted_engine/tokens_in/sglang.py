"""SGLang's native ``POST /generate`` on the scripted engine: ``input_ids`` (or ``text``) in,
``{text, output_ids, meta_info}`` out, cumulative (SGLang's default) or incremental streams.

Owns SGLang's request options, its error shape (400 ``{"error": {"message": ...}}``) and its
``meta_info`` (finish reason, log probs as ``[logprob, id, text]``, routed experts). Sources:
SGLang's ``managers/io_struct.py`` (``GenerateReqInput``), ``detokenizer_manager.py``
(``trim_matched_stop``), ``tokenizer_manager`` output processing, ``scheduler.py``
(``logprob_start_len``). Must not: render chat templates (the prompt is given).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from capture_proxy.scripted_engine.families import EngineFamily
from capture_proxy.scripted_engine.generation import synthetic_logprob
from capture_proxy.scripted_engine.moe import sglang_routed_experts
from capture_proxy.scripted_engine.state import CONFIG, FAMILY
from capture_proxy.scripted_engine.tokens_in import wire
from capture_proxy.scripted_engine.tokens_in.tokens_out import (
    TokensOut,
    alternates,
    record_abort,
    record_call,
    run_generation,
)
from capture_proxy.scripted_engine.weights import Sampler, sampler


class SglangError(ValueError):
    """A client error in SGLang's shape: 400 ``{"error": {"message": ...}}``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _sglang_logprobs(
    tok: EngineFamily, pairs: Sequence[tuple[int, float | None]], with_text: bool
) -> list[list[Any]]:
    return [[lp, tid, tok.decode([tid]) if with_text else None] for tid, lp in pairs]


def _finish(out: TokensOut) -> dict[str, Any]:
    """SGLang's ``meta_info.finish_reason`` (``FINISH_LENGTH`` / ``FINISH_MATCHED_*`` /
    ``FINISH_ABORT`` ``to_json()``)."""
    if out.finish == "length":
        return {"type": "length", "length": len(out.ids)}
    if out.finish == "abort":
        return {"type": "abort", "message": "Abort before weight update.", "status_code": None}
    return {"type": "stop", "matched": out.matched}


def _sglang_meta(
    app: web.Application,
    out: TokensOut,
    k: int,
    rid: str,
    opts: dict[str, Any],
    t0: float,
    walk: Sampler,
) -> dict[str, Any]:
    """``meta_info`` after token ``k`` (cumulative, as SGLang sends by default);
    ``weight_version``: the engine's version when it is sent."""
    tok = app[FAMILY]
    done = k == len(out.ids) - 1
    spans = walk.spans
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish(out) if done else None,
        "prompt_tokens": len(out.prompt),
        "weight_version": spans[-1]["version"] if spans else walk.version,
    }
    if opts["return_logprob"]:
        start, top, with_text = opts["logprob_start_len"], opts["top_logprobs_num"], opts["text"]
        prompt_pairs = [
            (t, None if i == 0 else synthetic_logprob(t, -i)) for i, t in enumerate(out.prompt)
        ][start:]
        out_pairs = list(zip(out.ids[: k + 1], out.log_probs[: k + 1], strict=True))
        meta["input_token_logprobs"] = _sglang_logprobs(tok, prompt_pairs, with_text)
        meta["output_token_logprobs"] = _sglang_logprobs(tok, out_pairs, with_text)
        if top > 0:
            meta["input_top_logprobs"] = [
                None
                if lp is None
                else _sglang_logprobs(tok, [(a, b) for a, b in alternates(t, lp, top)], with_text)
                for t, lp in prompt_pairs
            ]
            meta["output_top_logprobs"] = [
                _sglang_logprobs(tok, [(a, b) for a, b in alternates(t, lp, top)], with_text)
                for t, lp in out_pairs
            ]
    meta.update(
        {
            "reasoning_tokens": 0,
            "completion_tokens": k + 1,
            "cached_tokens": 0,
        }
    )
    if done:
        if opts["routed_experts"] is not None:
            meta["routed_experts"] = sglang_routed_experts(opts["routed_experts"])
        meta["e2e_latency"] = time.monotonic() - t0
    return meta


def _sglang_opts(app: web.Application, body: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    f = SglangError
    tok, vocab = app[FAMILY], len(app[FAMILY])
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise SglangError("Either text or input_ids should be provided.", "input_ids")
    if ids is not None:
        if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
            raise SglangError("input_ids must be a non-empty list of token ids (one prompt)")
        if any(not 0 <= t < vocab for t in ids):
            raise SglangError(
                f"The input_ids {ids} contains values greater than the vocab size ({vocab})."
            )
        prompt = wire.expand_images(app, list(ids), body.get("image_data"), "image_data", f)
    elif isinstance(text, str) and text:
        prompt = list(tok.encode(text, add_special_tokens=False))
    else:
        raise SglangError("text must be a non-empty string (one prompt)", "text")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise SglangError("sampling_params must be an object", "sampling_params")
    if sp.get("n", 1) != 1:
        raise SglangError("only n=1 is supported", "sampling_params.n")
    limit = app[CONFIG].max_model_len
    if len(prompt) >= limit:
        raise SglangError(
            f"The input ({len(prompt)} tokens) is longer than the model's context length "
            f"({limit} tokens)."
        )
    max_new = sp.get("max_new_tokens", 128)
    if max_new is None:
        max_new = 128
    if type(max_new) is not int or max_new < 0:
        raise SglangError("max_new_tokens must be at least 0, got " + repr(max_new))
    for key in ("temperature", "top_p"):
        wire.field(sp, key, "num", None, f)
    start = wire.field(body, "logprob_start_len", "int", -1, f)
    if start > len(prompt) or start < -1:
        raise SglangError(
            f"logprob_start_len ({start}) is higher than the number of input tokens "
            f"({len(prompt)}). Request with a lower logprob_start_len."
        )
    top = wire.field(body, "top_logprobs_num", "int", 0, f)
    if top < 0:
        raise SglangError("top_logprobs_num must be non-negative")
    opts = {
        "max_tokens": max(1, min(max_new, limit - len(prompt) - 1)),
        "zero": max_new == 0,
        "stop": wire.stop_list(sp.get("stop"), "stop", f),
        "stop_token_ids": wire.id_list(sp.get("stop_token_ids"), "stop_token_ids", vocab, f),
        "skip_special_tokens": wire.field(sp, "skip_special_tokens", "bool", True, f),
        "no_stop_trim": wire.field(sp, "no_stop_trim", "bool", False, f),
        "return_logprob": wire.field(body, "return_logprob", "bool", False, f),
        "logprob_start_len": len(prompt) if start == -1 else start,
        "top_logprobs_num": top,
        "text": wire.field(body, "return_text_in_logprobs", "bool", False, f),
        "stream": wire.field(body, "stream", "bool", False, f),
        "rid": wire.field(body, "rid", "str", None, f) or uuid.uuid4().hex,
        "return_routed_experts": wire.field(body, "return_routed_experts", "bool", False, f),
        "routed_experts_start_len": wire.field(body, "routed_experts_start_len", "int", 0, f),
    }
    return prompt, opts


async def sglang_generate(request: web.Request) -> web.StreamResponse:
    """``POST /generate`` (SGLang native): ``input_ids`` (or ``text``), ``sampling_params``
    (``max_new_tokens`` default 128, ``temperature``, ``top_p``, ``stop``,
    ``stop_token_ids``, ``skip_special_tokens``, ``no_stop_trim``), ``return_logprob``,
    ``logprob_start_len`` (-1: output only), ``top_logprobs_num``,
    ``return_text_in_logprobs``, ``stream``, ``rid``, ``return_routed_experts`` (MoE mode),
    ``image_data`` (base64 ``data:`` URLs, in prompt order: one ``<|image_pad|>`` per image in
    ``input_ids``, expanded as a Qwen-VL processor does).
    Answers ``{text, output_ids, meta_info}``; streams ``data:`` chunks whose ``text``,
    ``output_ids`` and log probs are cumulative (SGLang's default), or deltas with
    ``sglang_incremental_streaming``; then ``data: [DONE]``."""
    app = request.app
    try:
        body = await wire.read_json(request, SglangError)
        wire.check_fault(app)
        prompt, opts = _sglang_opts(app, body)
        if opts["zero"]:
            raise SglangError(
                "max_new_tokens=0 (prefill only) is not supported by the scripted engine"
            )
        if opts["return_routed_experts"] and app[CONFIG].moe is None:
            raise SglangError("return_routed_experts needs --enable-return-routed-experts")
    except SglangError as e:
        return wire.json_response({"error": {"message": str(e)}}, status=400)
    walk = sampler(app)
    await walk.admit()
    try:
        return await _generate(request, body, prompt, opts, walk)
    finally:
        await walk.finish()


async def _generate(
    request: web.Request,
    body: dict[str, Any],
    prompt: list[int],
    opts: dict[str, Any],
    walk: Sampler,
) -> web.StreamResponse:
    app = request.app
    t0 = time.monotonic()
    out = run_generation(
        app,
        prompt,
        max_tokens=opts["max_tokens"],
        stop=opts["stop"],
        stop_token_ids=opts["stop_token_ids"],
        skip_special_tokens=opts["skip_special_tokens"],
        keep_stop=opts["no_stop_trim"],
    )
    opts["routed_experts"] = None
    if opts["return_routed_experts"]:
        opts["routed_experts"] = wire.moe_rows(
            app, out, opts["routed_experts_start_len"], "routed_experts_start_len", SglangError
        )
    index = record_call(app, body, out, opts["stream"])
    rid = opts["rid"]
    if not opts["stream"]:
        done = await walk.walk(len(out.ids))
        if done < len(out.ids):
            out = record_abort(app, index, out.aborted(done))
        meta = _sglang_meta(app, out, len(out.ids) - 1, rid, opts, t0, walk)
        return wire.json_response({"text": out.text, "output_ids": out.ids, "meta_info": meta})

    def on_abort(k: int) -> list[wire.Event]:
        cut = record_abort(app, index, out.aborted(k))
        meta = _sglang_meta(app, cut, k - 1, rid, opts, t0, walk)
        meta["finish_reason"] = _finish(cut)
        if app[CONFIG].sglang_incremental_streaming:
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    meta[key] = []
            return [{"text": "", "output_ids": [], "meta_info": meta}]
        return [{"text": cut.text, "output_ids": cut.ids, "meta_info": meta}]

    events = _stream_events(app, out, rid, opts, t0, walk)
    return await wire.sse(request, events, wire.Gate(walk, len(out.ids), on_abort))


def _stream_events(
    app: web.Application,
    out: TokensOut,
    rid: str,
    opts: dict[str, Any],
    t0: float,
    walk: Sampler,
) -> list[wire.Event]:
    """One chunk per token, made when it is sent (its ``meta_info`` names the version then):
    cumulative (SGLang's default) or deltas (``sglang_incremental_streaming``)."""
    incremental = app[CONFIG].sglang_incremental_streaming
    last = len(out.ids) - 1
    sent = [""]  # the text sent so far (incremental)

    def event(k: int) -> dict[str, Any]:
        text = out.text if k == last else out.texts[k]
        meta = _sglang_meta(app, out, k, rid, opts, t0, walk)
        if not incremental:
            return {"text": text, "output_ids": out.ids[: k + 1], "meta_info": meta}
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if key in meta:
                meta[key] = meta[key][k:]
        delta = text[len(sent[0]) :] if len(text) > len(sent[0]) else ""
        sent[0] = text if len(text) > len(sent[0]) else sent[0]
        return {"text": delta, "output_ids": [out.ids[k]], "meta_info": meta}

    return [functools.partial(event, k) for k in range(len(out.ids))]
