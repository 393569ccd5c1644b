"""Tokens-in endpoints of the scripted engine: vLLM ``/v1/completions`` (token-id prompts),
vLLM ``/inference/v1/generate`` (only with ``enable_scale_out``) and SGLang ``/generate``.

Owns: the wire shapes of those three dialects (see ``docs`` in each handler), turning a prompt
of token ids back into a conversation (decode, then the family reads it: ``chatml`` for our
ChatML + Hermes layout) so the same policy / responder as ``/v1/chat/completions`` answers
it, and the stop / length / detokenisation rules of each engine. The generated ids and log
probs are those of ``generation.generate`` for the same conversation, so chat and tokens-in
answers agree.
Must not: render chat templates (the prompt is given) or load the tokenizer.

Sources (vLLM main of 2026): ``entrypoints/openai/completion/{protocol,serving}.py``,
``entrypoints/serve/disagg/{protocol,serving,api_router}.py``; SGLang:
``managers/io_struct.py`` (``GenerateReqInput``), ``detokenizer_manager.py``
(``trim_matched_stop``), ``tokenizer_manager`` output processing (cumulative stream chunks
unless ``--incremental-streaming-output``), ``scheduler.py`` (``logprob_start_len``).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

from capture_proxy.families.qwen_vocab import SPECIAL_START_ID
from capture_proxy.scripted_engine.families import QWEN_SPECIAL_IDS, EngineFamily
from capture_proxy.scripted_engine.generation import Generation, synthetic_logprob
from capture_proxy.scripted_engine.moe import (
    expert_rows,
    sglang_routed_experts,
    vllm_routed_experts,
)
from capture_proxy.scripted_engine.state import (
    CONFIG,
    FAMILY,
    SENT_CALLS,
    RequestError,
    SentCall,
)

#: Ids of the Qwen tokens ``skip_special_tokens`` drops (``<tool_call>``, ``<think>``... stay).
SPECIAL_IDS = QWEN_SPECIAL_IDS


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class TokensOut:
    """One tokens-in generation after the engine's stop rules. ``texts[k]``: the output text
    after token ``k`` (cumulative, before stop-string trimming; incomplete UTF-8 held back);
    ``text``: the final text. ``matched``: the stop token id or string that ended it."""

    prompt: list[int]
    ids: list[int]
    log_probs: list[float]
    texts: list[str]
    text: str
    finish: str  # "stop" | "length"
    matched: int | str | None


def scripted_generation(app: web.Application, prompt: list[int]) -> Generation:
    """The full (untruncated) generation the chat endpoint would give for this prompt."""
    cfg, family = app[CONFIG], app[FAMILY]
    messages, tools = family.read_prompt(prompt)
    seed = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()
    if cfg.responder is not None:
        body: dict[str, Any] = {"model": cfg.model_name, "messages": messages}
        if tools is not None:
            body["tools"] = tools
        return family.generate(cfg.responder(body), None, id_seed=seed, prompt=prompt)
    step = cfg.policy.choose(messages, tools is not None)
    return family.generate(
        step.assistant_message(seed),
        None,
        token_split=step.token_split,
        id_seed=seed,
        prompt=prompt,
    )


def run_generation(
    app: web.Application,
    prompt: list[int],
    *,
    max_tokens: int,
    stop: list[str],
    stop_token_ids: list[int],
    skip_special_tokens: bool,
    keep_stop: bool,
) -> TokensOut:
    """Sample (replay) the scripted tokens until ``<|im_end|>``, a stop token id, a stop string
    or ``max_tokens``. ``keep_stop``: keep the matched stop string / token text in the text
    (vLLM ``include_stop_str_in_output``, SGLang ``no_stop_trim``)."""
    family = app[FAMILY]
    gen = scripted_generation(app, prompt)
    special_ids, stop_ids = family.special_ids, family.stop_ids
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    ids: list[int] = []
    lps: list[float] = []
    texts: list[str] = []
    text, finish = "", "length"
    matched: int | str | None = None
    for e in gen.events:
        tid = e.token_id
        ids.append(tid)
        bare = app[CONFIG].faults.bare_logprob_at
        lps.append(bare[1] if bare is not None and bare[0] == len(ids) - 1 else e.logprob)
        shown = not (skip_special_tokens and tid in special_ids)
        if tid in stop_ids or tid in stop_token_ids:
            finish, matched = "stop", tid
            if keep_stop and shown:
                text += decoder.decode(family.token_bytes(tid))
            texts.append(text)
            break
        piece = decoder.decode(family.token_bytes(tid)) if shown else ""
        text += piece
        hit = _find_stop(text, len(text) - len(piece), stop)
        texts.append(text)
        if hit is not None:
            pos, s = hit
            finish, matched = "stop", s
            text = text[: pos + len(s)] if keep_stop else text[:pos]
            break
        if len(ids) >= max_tokens:
            text += decoder.decode(b"", final=True)
            texts[-1] = text
            break
    return TokensOut(prompt, ids, lps, texts, text, finish, matched)


def _find_stop(text: str, new_from: int, stop: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stop:
        pos = text.find(s, max(0, new_from - len(s) + 1))
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def _record(app: web.Application, body: dict[str, Any], out: TokensOut, stream: bool) -> None:
    app[SENT_CALLS].append(SentCall(body, out.prompt, out.ids, out.log_probs, stream, out.finish))


def _alternates(token_id: int, logprob: float, n: int) -> list[tuple[int, float]]:
    """The sampled token (ranked first, as the scripted model is greedy-like) and ``n - 1``
    deterministic alternatives, as ``app._logprob_entry`` does for chat."""
    return [(token_id, logprob)] + [
        ((token_id + j) % SPECIAL_START_ID, logprob - j) for j in range(1, n)
    ]


# --------------------------------------------------------------------------- validation


def _get(
    body: dict[str, Any], key: str, kind: Any, default: Any, fail: Callable[[str, str], Exception]
) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    ok = {
        "int": type(v) is int,
        "bool": type(v) is bool,
        "num": type(v) in (int, float),
        "str": isinstance(v, str),
        "dict": isinstance(v, dict),
    }[kind]
    if not ok:
        raise fail(f"{key} must be of type {kind}", key)
    return v


def _stop_list(v: Any, key: str, fail: Callable[[str, str], Exception]) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise fail(f"{key} must be a string or a list of strings", key)


def _id_list(v: Any, key: str, vocab: int, fail: Callable[[str, str], Exception]) -> list[int]:
    if v is None:
        return []
    if isinstance(v, list) and all(type(t) is int and 0 <= t < vocab for t in v):
        return v
    raise fail(f"{key} must be a list of token ids below {vocab}", key)


def _vllm_fail(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param)


async def _json(request: web.Request, fail: Callable[[str, str], Exception]) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise fail(f"request body is not valid JSON: {e}", "body") from e
    if not isinstance(body, dict):
        raise fail("request body must be a JSON object", "body")
    return body


def _check_fault(app: web.Application) -> None:
    status = app[CONFIG].fail_status
    if status is not None:
        raise RequestError("scripted failure", None, status)


def _usage(out: TokensOut) -> dict[str, int]:
    p, c = len(out.prompt), len(out.ids)
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}


async def _sse(request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    step = request.app[CONFIG].sse_fragment_bytes
    for obj in [*events, None]:
        data = "[DONE]" if obj is None else json.dumps(obj, ensure_ascii=False)
        raw = f"data: {data}\n\n".encode()
        for i in range(0, len(raw), step or len(raw)):
            await resp.write(raw[i : i + (step or len(raw))])
    await resp.write_eof()
    return resp


def _json_response(obj: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(obj, status=status, dumps=lambda o: json.dumps(o, ensure_ascii=False))


def _moe_rows(
    app: web.Application,
    out: TokensOut,
    start: Any,
    param: str,
    fail: Callable[[str, str], Exception],
) -> Any:
    if type(start) is not int or start < 0:
        raise fail(f"{param} must be a non-negative integer", param)
    moe = app[CONFIG].moe
    assert moe is not None
    return expert_rows(out.prompt + out.ids, moe, start)


# --------------------------------------------------------------------------- vLLM /v1/completions


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


def _vllm_prompt_len_check(app: web.Application, prompt: list[int], max_tokens: int | None) -> None:
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
        tops.append({name(t): v for t, v in _alternates(tid, lp, max(n, 1))})
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def _visible(out: TokensOut, k: int, holdback: int) -> str:
    """vLLM's streamed text after token ``k``: the final text at the end, else the text so far
    minus ``holdback`` chars kept back in case they start a stop string."""
    if k == len(out.ids) - 1:
        return out.text
    t = out.texts[k]
    return t[: len(t) - holdback] if holdback else t


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (vLLM): ``prompt`` (token ids or a string), ``max_tokens``
    (default 16), ``temperature``/``top_p``/``seed`` (accepted; the script decides),
    ``stop``, ``stop_token_ids``, ``include_stop_str_in_output``, ``logprobs`` (int),
    ``return_token_ids``, ``return_tokens_as_token_ids``, ``skip_special_tokens`` (default
    true), ``echo`` false only, ``n`` 1 only, ``stream`` + ``stream_options.include_usage``."""
    app = request.app
    body = await _json(request, _vllm_fail)
    _check_fault(app)
    f = _vllm_fail
    if body.get("echo"):
        raise RequestError("echo is not supported by the scripted engine", "echo")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported", "n")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise RequestError("max_tokens must be a positive integer", "max_tokens")
    n_lp = _get(body, "logprobs", "int", None, f)
    if n_lp is not None and not 0 <= n_lp <= 20:
        raise RequestError("logprobs must be in [0, 20]", "logprobs")
    for key in ("temperature", "top_p"):
        _get(body, key, "num", None, f)
    _get(body, "seed", "int", None, f)
    stream = _get(body, "stream", "bool", False, f)
    so = _get(body, "stream_options", "dict", {}, f)
    token_ids = _get(body, "return_token_ids", "bool", False, f)
    as_ids = _get(body, "return_tokens_as_token_ids", "bool", False, f)
    keep = _get(body, "include_stop_str_in_output", "bool", False, f)
    skip = _get(body, "skip_special_tokens", "bool", True, f)
    stop = _stop_list(body.get("stop"), "stop", f)
    stop_ids = _id_list(body.get("stop_token_ids"), "stop_token_ids", len(app[FAMILY]), f)
    prompt = _vllm_prompt(app, body)
    _vllm_prompt_len_check(app, prompt, max_tokens)
    limit = app[CONFIG].max_model_len - len(prompt)
    out = run_generation(
        app,
        prompt,
        max_tokens=min(max_tokens or limit, limit),
        stop=stop,
        stop_token_ids=stop_ids,
        skip_special_tokens=skip,
        keep_stop=keep,
    )
    _record(app, body, out, stream)
    tok = app[FAMILY]
    stop_reason = None if out.matched in app[FAMILY].stop_ids else out.matched
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": app[CONFIG].model_name,
    }
    if not stream:
        choice: dict[str, Any] = {
            "index": 0,
            "text": out.text,
            "logprobs": None
            if n_lp is None
            else _completion_logprobs(tok, out, 0, len(out.ids), n_lp, as_ids, 0),
            "finish_reason": out.finish,
            "stop_reason": stop_reason,
            "token_ids": out.ids if token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if token_ids else None,
        }
        if app[CONFIG].moe is not None:
            start = body.get("routed_experts_prompt_start", 0)
            rows = _moe_rows(app, out, start, "routed_experts_prompt_start", f)
            choice["routed_experts"] = vllm_routed_experts(rows)
        return _json_response(
            {
                **head,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": {**_usage(out), "prompt_tokens_details": None},
                "kv_transfer_params": None,
            }
        )
    holdback = 0 if keep or not stop else max(len(s) for s in stop) - 1
    events: list[dict[str, Any]] = []
    sent = ""
    for k in range(len(out.ids)):
        vis = _visible(out, k, holdback)
        delta = vis[len(sent) :] if vis.startswith(sent) else ""
        last = k == len(out.ids) - 1
        lp = None
        if n_lp is not None:
            lp = _completion_logprobs(tok, out, k, k + 1, n_lp, as_ids, len(sent))
        sent += delta
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
                        "prompt_token_ids": prompt if token_ids and k == 0 else None,
                        "token_ids": [out.ids[k]] if token_ids else None,
                    }
                ],
            }
        )
    if so.get("include_usage") is True:
        events.append({**head, "choices": [], "usage": _usage(out)})
    return await _sse(request, events)


# ------------------------------------------------------------- vLLM /inference/v1/generate


def _chat_logprobs(out: TokensOut, lo: int, hi: int, n: int) -> dict[str, Any]:
    """``ChatCompletionLogProbs`` as ``ServingTokens._create_tokens_logprobs`` builds it:
    tokens as ``token_id:<id>``, ``bytes`` null, ``max(n, 1)`` top entries."""
    content = []
    for tid, lp in zip(out.ids[lo:hi], out.log_probs[lo:hi], strict=True):
        tops = [
            {"token": f"token_id:{t}", "logprob": v, "bytes": None}
            for t, v in _alternates(tid, lp, max(n, 1))
        ]
        content.append(
            {"token": f"token_id:{tid}", "logprob": lp, "bytes": None, "top_logprobs": tops}
        )
    return {"content": content}


async def inference_generate(request: web.Request) -> web.StreamResponse:
    """``POST /inference/v1/generate`` (vLLM tokens in, tokens out): ``token_ids``,
    ``sampling_params`` (vLLM ``SamplingParams``: ``max_tokens`` (default: what fits),
    ``temperature``, ``top_p``, ``seed``, ``stop``, ``stop_token_ids``,
    ``include_stop_str_in_output``, ``logprobs`` (int), ``n`` 1 only; others ignored),
    ``model``, ``request_id``, ``stream``, ``stream_options.include_usage``."""
    app = request.app
    body = await _json(request, _vllm_fail)
    _check_fault(app)
    f = _vllm_fail
    vocab = len(app[FAMILY])
    ids = body.get("token_ids")
    if not (isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < vocab for t in ids)):
        raise RequestError("token_ids must be a non-empty list of token ids", "token_ids")
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise RequestError("sampling_params is required and must be an object", "sampling_params")
    if sp.get("n", 1) != 1:
        raise RequestError("only n=1 is supported", "sampling_params.n")
    max_tokens = sp.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise RequestError("max_tokens must be a positive integer", "sampling_params.max_tokens")
    n_lp = _get(sp, "logprobs", "int", None, f)
    for key in ("temperature", "top_p"):
        _get(sp, key, "num", None, f)
    _get(sp, "seed", "int", None, f)
    stream = _get(body, "stream", "bool", False, f)
    so = _get(body, "stream_options", "dict", {}, f)
    limit = app[CONFIG].max_model_len - len(ids)
    if limit <= 0:
        _vllm_prompt_len_check(app, ids, None)
    out = run_generation(
        app,
        list(ids),
        max_tokens=min(max_tokens or limit, limit),
        stop=_stop_list(sp.get("stop"), "sampling_params.stop", f),
        stop_token_ids=_id_list(
            sp.get("stop_token_ids"), "sampling_params.stop_token_ids", vocab, f
        ),
        skip_special_tokens=_get(sp, "skip_special_tokens", "bool", True, f),
        keep_stop=_get(sp, "include_stop_str_in_output", "bool", False, f),
    )
    _record(app, body, out, stream)
    request_id = uuid.uuid4().hex
    if not stream:
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None if n_lp is None else _chat_logprobs(out, 0, len(out.ids), n_lp),
            "finish_reason": out.finish,
            "token_ids": out.ids,
            "routed_experts": None,
        }
        if app[CONFIG].moe is not None:
            start = body.get("routed_experts_prompt_start", 0)
            rows = _moe_rows(app, out, start, "routed_experts_prompt_start", f)
            choice["routed_experts"] = vllm_routed_experts(rows)
        return _json_response(
            {
                "request_id": request_id,
                "model": app[CONFIG].model_name,
                "created": int(time.time()),
                "choices": [choice],
                "usage": {**_usage(out), "prompt_tokens_details": None},
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        )
    events: list[dict[str, Any]] = []
    for k, tid in enumerate(out.ids):
        last = k == len(out.ids) - 1
        choice = {
            "index": 0,
            "logprobs": None if n_lp is None else _chat_logprobs(out, k, k + 1, n_lp),
            "finish_reason": out.finish if last else None,
            "token_ids": [tid],
            "routed_experts": None,
        }
        events.append({"request_id": request_id, "choices": [choice], "usage": None})
    if so.get("include_usage") is True:
        events.append({"request_id": request_id, "choices": [], "usage": _usage(out)})
    return await _sse(request, events)


# --------------------------------------------------------------------------- SGLang /generate


class SglangError(ValueError):
    """A client error in SGLang's shape: 400 ``{"error": {"message": ...}}``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _sglang_logprobs(
    tok: EngineFamily, pairs: Sequence[tuple[int, float | None]], with_text: bool
) -> list[list[Any]]:
    return [[lp, tid, tok.decode([tid]) if with_text else None] for tid, lp in pairs]


def _sglang_meta(
    app: web.Application, out: TokensOut, k: int, rid: str, opts: dict[str, Any], t0: float
) -> dict[str, Any]:
    """``meta_info`` after token ``k`` (cumulative, as SGLang sends by default)."""
    tok = app[FAMILY]
    done = k == len(out.ids) - 1
    finish: dict[str, Any] | None = None
    if done:
        finish = (
            {"type": "length", "length": len(out.ids)}
            if out.finish == "length"
            else {"type": "stop", "matched": out.matched}
        )
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(out.prompt),
        "weight_version": "default",
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
                else _sglang_logprobs(tok, [(a, b) for a, b in _alternates(t, lp, top)], with_text)
                for t, lp in prompt_pairs
            ]
            meta["output_top_logprobs"] = [
                _sglang_logprobs(tok, [(a, b) for a, b in _alternates(t, lp, top)], with_text)
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
        prompt = list(ids)
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
        _get(sp, key, "num", None, f)
    start = _get(body, "logprob_start_len", "int", -1, f)
    if start > len(prompt) or start < -1:
        raise SglangError(
            f"logprob_start_len ({start}) is higher than the number of input tokens "
            f"({len(prompt)}). Request with a lower logprob_start_len."
        )
    top = _get(body, "top_logprobs_num", "int", 0, f)
    if top < 0:
        raise SglangError("top_logprobs_num must be non-negative")
    opts = {
        "max_tokens": max(1, min(max_new, limit - len(prompt) - 1)),
        "zero": max_new == 0,
        "stop": _stop_list(sp.get("stop"), "stop", f),
        "stop_token_ids": _id_list(sp.get("stop_token_ids"), "stop_token_ids", vocab, f),
        "skip_special_tokens": _get(sp, "skip_special_tokens", "bool", True, f),
        "no_stop_trim": _get(sp, "no_stop_trim", "bool", False, f),
        "return_logprob": _get(body, "return_logprob", "bool", False, f),
        "logprob_start_len": len(prompt) if start == -1 else start,
        "top_logprobs_num": top,
        "text": _get(body, "return_text_in_logprobs", "bool", False, f),
        "stream": _get(body, "stream", "bool", False, f),
        "rid": _get(body, "rid", "str", None, f) or uuid.uuid4().hex,
        "return_routed_experts": _get(body, "return_routed_experts", "bool", False, f),
        "routed_experts_start_len": _get(body, "routed_experts_start_len", "int", 0, f),
    }
    return prompt, opts


async def sglang_generate(request: web.Request) -> web.StreamResponse:
    """``POST /generate`` (SGLang native): ``input_ids`` (or ``text``), ``sampling_params``
    (``max_new_tokens`` default 128, ``temperature``, ``top_p``, ``stop``,
    ``stop_token_ids``, ``skip_special_tokens``, ``no_stop_trim``), ``return_logprob``,
    ``logprob_start_len`` (-1: output only), ``top_logprobs_num``,
    ``return_text_in_logprobs``, ``stream``, ``rid``, ``return_routed_experts`` (MoE mode).
    Answers ``{text, output_ids, meta_info}``; streams ``data:`` chunks whose ``text``,
    ``output_ids`` and log probs are cumulative (SGLang's default), or deltas with
    ``sglang_incremental_streaming``; then ``data: [DONE]``."""
    app = request.app
    try:
        body = await _json(request, SglangError)
        _check_fault(app)
        prompt, opts = _sglang_opts(app, body)
        if opts["zero"]:
            raise SglangError(
                "max_new_tokens=0 (prefill only) is not supported by the scripted engine"
            )
        if opts["return_routed_experts"] and app[CONFIG].moe is None:
            raise SglangError("return_routed_experts needs --enable-return-routed-experts")
    except SglangError as e:
        return _json_response({"error": {"message": str(e)}}, status=400)
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
        opts["routed_experts"] = _moe_rows(
            app, out, opts["routed_experts_start_len"], "routed_experts_start_len", SglangError
        )
    _record(app, body, out, opts["stream"])
    rid, last = opts["rid"], len(out.ids) - 1
    if not opts["stream"]:
        meta = _sglang_meta(app, out, last, rid, opts, t0)
        return _json_response({"text": out.text, "output_ids": out.ids, "meta_info": meta})
    incremental = app[CONFIG].sglang_incremental_streaming
    events: list[dict[str, Any]] = []
    sent_text, sent_lp = "", 0
    for k in range(len(out.ids)):
        text = out.text if k == last else out.texts[k]
        meta = _sglang_meta(app, out, k, rid, opts, t0)
        if not incremental:
            events.append({"text": text, "output_ids": out.ids[: k + 1], "meta_info": meta})
            continue
        delta = text[len(sent_text) :] if len(text) > len(sent_text) else ""
        sent_text = text if len(text) > len(sent_text) else sent_text
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if key in meta:
                meta[key] = meta[key][sent_lp:]
        sent_lp = k + 1
        events.append({"text": delta, "output_ids": [out.ids[k]], "meta_info": meta})
    return await _sse(request, events)


# --------------------------------------------------------------------------- routes


def add_tokens_in_routes(app: web.Application, enable_scale_out: bool) -> None:
    """Register ``/v1/completions``, SGLang ``/generate`` and, with ``enable_scale_out``
    (vLLM's ``--enable-scale-out``), ``/inference/v1/generate`` (else 404, like vLLM)."""
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/generate", sglang_generate)
    if enable_scale_out:
        app.router.add_post("/inference/v1/generate", inference_generate)
