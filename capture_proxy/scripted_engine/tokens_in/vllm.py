"""vLLM's tokens-in endpoints on the scripted engine: ``POST /v1/completions`` (a prompt of
token ids or a string) here, and ``POST /inference/v1/generate`` (tokens in, tokens out; only
with ``enable_scale_out``) in ``vllm_generate.py``.

Owns their request options and errors (OpenAI-shaped 400s, ``RequestError``), the context
length check, and their answers and stream chunks (text deltas held back while they may start
a stop string, legacy and chat-shaped log probs, token ids, usage, routed experts). Sources
(vLLM main of 2026): ``entrypoints/openai/completion/{protocol,serving}.py``,
``entrypoints/serve/disagg/{protocol,serving,api_router}.py``. Must not: render chat templates
(the prompt is given).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

from capture_proxy.scripted_engine.families import EngineFamily
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
from capture_proxy.scripted_engine.weights import Sampler, sampler


def vllm_fail(message: str, param: str | None = None) -> RequestError:
    """vLLM's client error (an OpenAI-shaped 400 naming ``param``)."""
    return RequestError(message, param)


def _vllm_prompt(app: web.Application, body: dict[str, Any]) -> list[int]:
    tok, vocab = app[FAMILY], len(app[FAMILY])
    p = body.get("prompt")
    if isinstance(p, str) and p:
        return list(tok.encode(p, add_special_tokens=True))
    if isinstance(p, list) and p and all(type(t) is int for t in p):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"Token id {bad[0]} is out of vocabulary", "prompt")
        return list(p)
    raise RequestError(
        "prompt must be a non-empty string or list of token ids (one prompt only)", "prompt"
    )


def vllm_prompt_len_check(app: web.Application, prompt: list[int], max_tokens: int | None) -> None:
    limit = app[CONFIG].max_model_len
    if len(prompt) >= limit or (max_tokens is not None and len(prompt) + max_tokens > limit):
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{max_tokens or 0} output tokens and your prompt contains {len(prompt)} input "
            f"tokens, for a total of {len(prompt) + (max_tokens or 0)} tokens.",
            "max_tokens" if len(prompt) < limit else "prompt",
        )


def _completion_logprobs(
    tok: EngineFamily,
    out: TokensOut,
    lo: int,
    hi: int,
    n: int,
    as_ids: bool,
    offset0: int,
) -> dict[str, Any]:
    """vLLM legacy completions log probs for tokens ``lo:hi``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (dicts of sampled + top ``n`` deduped: ``max(n, 1)`` entries here) and
    ``text_offset`` (running sum of the per-token strings' lengths from ``offset0``)."""

    def name(tid: int) -> str:
        return f"token_id:{tid}" if as_ids else cast(str, tok.decode([tid]))

    tokens: list[str] = []
    lps: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for tid, lp in zip(out.ids[lo:hi], out.log_probs[lo:hi], strict=True):
        offsets.append(offset0 if not offsets else offsets[-1] + len(tokens[-1]))
        tokens.append(name(tid))
        lps.append(lp)
        tops.append({name(t): v for t, v in alternates(tid, lp, max(n, 1))})
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def _visible(out: TokensOut, k: int, holdback: int) -> str:
    """vLLM's streamed text after token ``k``: the final text at the end, else the text so far
    minus ``holdback`` chars kept back in case they start a stop string."""
    if k == len(out.ids) - 1:
        return out.text
    t = out.texts[k]
    return t[: len(t) - holdback] if holdback else t


# --------------------------------------------------------------------------- /v1/completions


@dataclass(frozen=True)
class _CompletionOptions:
    """A ``/v1/completions`` request's options, validated."""

    prompt: list[int]
    max_tokens: int | None
    logprobs: int | None
    stream: bool
    include_usage: bool
    return_token_ids: bool
    tokens_as_ids: bool
    keep_stop: bool
    skip_special_tokens: bool
    stop: list[str]
    stop_token_ids: list[int]


def _completion_options(app: web.Application, body: dict[str, Any]) -> _CompletionOptions:
    """Validate ``body`` in vLLM's order (the first bad field is the one named). Raises
    RequestError."""
    f = vllm_fail
    if body.get("echo"):
        raise RequestError("echo is not supported by the scripted engine", "echo")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported", "n")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise RequestError("max_tokens must be a positive integer", "max_tokens")
    n_lp = wire.field(body, "logprobs", "int", None, f)
    if n_lp is not None and not 0 <= n_lp <= 20:
        raise RequestError("logprobs must be in [0, 20]", "logprobs")
    for key in ("temperature", "top_p"):
        wire.field(body, key, "num", None, f)
    wire.field(body, "seed", "int", None, f)
    stream = wire.field(body, "stream", "bool", False, f)
    so = wire.field(body, "stream_options", "dict", {}, f)
    token_ids = wire.field(body, "return_token_ids", "bool", False, f)
    as_ids = wire.field(body, "return_tokens_as_token_ids", "bool", False, f)
    keep = wire.field(body, "include_stop_str_in_output", "bool", False, f)
    skip = wire.field(body, "skip_special_tokens", "bool", True, f)
    stop = wire.stop_list(body.get("stop"), "stop", f)
    stop_ids = wire.id_list(body.get("stop_token_ids"), "stop_token_ids", len(app[FAMILY]), f)
    prompt = _vllm_prompt(app, body)
    vllm_prompt_len_check(app, prompt, max_tokens)
    return _CompletionOptions(
        prompt=prompt,
        max_tokens=max_tokens,
        logprobs=n_lp,
        stream=stream,
        include_usage=so.get("include_usage") is True,
        return_token_ids=token_ids,
        tokens_as_ids=as_ids,
        keep_stop=keep,
        skip_special_tokens=skip,
        stop=stop,
        stop_token_ids=stop_ids,
    )


def _completion_json(
    app: web.Application,
    body: dict[str, Any],
    opts: _CompletionOptions,
    out: TokensOut,
    head: dict[str, Any],
    stop_reason: int | str | None,
) -> dict[str, Any]:
    """The non-streamed answer."""
    n_lp = opts.logprobs
    choice: dict[str, Any] = {
        "index": 0,
        "text": out.text,
        "logprobs": None
        if n_lp is None
        else _completion_logprobs(app[FAMILY], out, 0, len(out.ids), n_lp, opts.tokens_as_ids, 0),
        "finish_reason": out.finish,
        "stop_reason": stop_reason,
        "token_ids": out.ids if opts.return_token_ids else None,
        "prompt_logprobs": None,
        "prompt_token_ids": opts.prompt if opts.return_token_ids else None,
    }
    if app[CONFIG].moe is not None:
        start = body.get("routed_experts_prompt_start", 0)
        rows = wire.moe_rows(app, out, start, "routed_experts_prompt_start", vllm_fail)
        choice["routed_experts"] = vllm_routed_experts(rows)
    return {
        **head,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {**wire.usage(out), "prompt_tokens_details": None},
        "kv_transfer_params": None,
    }


def _completion_events(
    app: web.Application,
    opts: _CompletionOptions,
    out: TokensOut,
    head: dict[str, Any],
    stop_reason: int | str | None,
) -> list[dict[str, Any]]:
    """The stream's chunks, one per generated token (then usage when asked)."""
    tok, n_lp = app[FAMILY], opts.logprobs
    holdback = 0 if opts.keep_stop or not opts.stop else max(len(s) for s in opts.stop) - 1
    events: list[dict[str, Any]] = []
    sent = ""
    for k in range(len(out.ids)):
        vis = _visible(out, k, holdback)
        delta = vis[len(sent) :] if vis.startswith(sent) else ""
        last = k == len(out.ids) - 1
        lp = None
        if n_lp is not None:
            lp = _completion_logprobs(tok, out, k, k + 1, n_lp, opts.tokens_as_ids, len(sent))
        sent += delta
        first_ids = opts.return_token_ids and k == 0
        events.append(
            {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "text": delta,
                        "logprobs": lp,
                        "finish_reason": out.finish if last else None,
                        "stop_reason": stop_reason if last else None,
                        "prompt_token_ids": opts.prompt if first_ids else None,
                        "token_ids": [out.ids[k]] if opts.return_token_ids else None,
                    }
                ],
            }
        )
    if opts.include_usage:
        events.append({**head, "choices": [], "usage": wire.usage(out)})
    return events


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (vLLM): ``prompt`` (token ids or a string), ``max_tokens``
    (default 16), ``temperature``/``top_p``/``seed`` (accepted; the script decides),
    ``stop``, ``stop_token_ids``, ``include_stop_str_in_output``, ``logprobs`` (int),
    ``return_token_ids``, ``return_tokens_as_token_ids``, ``skip_special_tokens`` (default
    true), ``echo`` false only, ``n`` 1 only, ``stream`` + ``stream_options.include_usage``.
    Under a pause (``weights``) it waits to be scheduled, holds or ends ``"abort"``."""
    app = request.app
    body = await wire.read_json(request, vllm_fail)
    wire.check_fault(app)
    opts = _completion_options(app, body)
    check_model(app, body)
    walk = sampler(app)
    await walk.admit()
    try:
        return await _complete(request, body, opts, walk)
    finally:
        await walk.finish()


async def _complete(
    request: web.Request, body: dict[str, Any], opts: _CompletionOptions, walk: Sampler
) -> web.StreamResponse:
    app = request.app
    limit = app[CONFIG].max_model_len - len(opts.prompt)
    out = run_generation(
        app,
        opts.prompt,
        max_tokens=min(opts.max_tokens or limit, limit),
        stop=opts.stop,
        stop_token_ids=opts.stop_token_ids,
        skip_special_tokens=opts.skip_special_tokens,
        keep_stop=opts.keep_stop,
    )
    index = record_call(app, body, out, opts.stream)
    stop_reason = None if out.matched in app[FAMILY].stop_ids else out.matched
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": app[CONFIG].model_name,
    }
    if not opts.stream:
        done = await walk.walk(len(out.ids))
        if done < len(out.ids):
            out = record_abort(app, index, out.aborted(done))
        return wire.json_response(_completion_json(app, body, opts, out, head, stop_reason))

    def on_abort(k: int) -> list[wire.Event]:
        cut = record_abort(app, index, out.aborted(k))
        last = {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": "abort",
            "stop_reason": None,
            "prompt_token_ids": opts.prompt if opts.return_token_ids and k == 0 else None,
            "token_ids": [] if opts.return_token_ids else None,
        }
        events: list[wire.Event] = [{**head, "choices": [last]}]
        if opts.include_usage:
            events.append({**head, "choices": [], "usage": wire.usage(cut)})
        return events

    events = _completion_events(app, opts, out, head, stop_reason)
    return await wire.sse(request, events, wire.Gate(walk, len(out.ids), on_abort))
