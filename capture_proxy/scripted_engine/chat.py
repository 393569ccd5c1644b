"""The scripted engine's ``POST /v1/chat/completions``: vLLM's OpenAI dialect.

Owns the answer: the scripted generation for the rendered prompt (the policy's step, or the
configured responder), vLLM-shaped responses streaming and not (token ids, log probs, usage,
routed experts), the stream faults (``faults``) and the ``SENT_CALLS`` record tests compare
against. Must not: validate or render the request (``chat_request``) or load the tokenizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from capture_proxy.scripted_engine.chat_request import (
    chat_prompt_ids,
    check,
    json_body,
    validate_chat,
)
from capture_proxy.scripted_engine.continuations import remember_generation
from capture_proxy.scripted_engine.families import EngineFamily
from capture_proxy.scripted_engine.faults import Faults
from capture_proxy.scripted_engine.generation import Generation, TokenEvent
from capture_proxy.scripted_engine.moe import expert_rows, vllm_routed_experts
from capture_proxy.scripted_engine.state import (
    CLIENT_GONE,
    CONFIG,
    FAILED_SO_FAR,
    FAMILY,
    SENT_CALLS,
    RequestError,
    SentCall,
    check_model,
)
from capture_proxy.scripted_engine.weights import Sampler, sampler


def _engine_json(obj: Any) -> str:
    """JSON as vLLM 0.32 writes its chat answers and chunks: compact (pydantic's
    ``model_dump_json`` for a chunk, starlette's ``JSONResponse`` for a whole answer), UTF-8
    kept; NaN written bare (a fault the scripted engine can inject)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _logprob_entry(family: EngineFamily, e: TokenEvent, top: int, as_ids: bool) -> dict:
    def one(tid: int, lp: float) -> dict[str, Any]:
        text = f"token_id:{tid}" if as_ids else family.decode([tid])
        return {"token": text, "logprob": lp, "bytes": list(family.token_bytes(tid))}

    alts = [one(e.token_id, e.logprob)] + [
        one((e.token_id + j) % 151643, e.logprob - j) for j in range(1, top)
    ]
    return {**one(e.token_id, e.logprob), "top_logprobs": alts[:top]}


@dataclass(frozen=True)
class _Options:
    token_ids: bool
    logprobs: bool
    top: int
    as_ids: bool
    usage: bool


def _options(app: web.Application, body: dict[str, Any]) -> _Options:
    so = body.get("stream_options")
    usage = isinstance(so, dict) and so.get("include_usage") is True
    if app[CONFIG].omit_token_ids:
        return _Options(False, False, 0, False, usage)
    lp = body.get("logprobs") is True and not (
        "top_logprobs" in body and body["top_logprobs"] is None
    )
    return _Options(
        body.get("return_token_ids") is True,
        lp,
        body.get("top_logprobs") or 0,
        body.get("return_tokens_as_token_ids") is True,
        usage,
    )


def _usage(prompt: list[int], gen: Generation) -> dict[str, int]:
    n = len(gen.token_ids)
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


def _chat_prompt(app: web.Application, body: dict[str, Any]) -> list[int]:
    """The prompt ids of a validated chat body. Raises RequestError (render failure, longer
    than ``max_model_len``)."""
    cfg = app[CONFIG]
    prompt = chat_prompt_ids(app, body)
    if len(prompt) >= cfg.max_model_len:
        raise RequestError(
            f"prompt has {len(prompt)} tokens; max_model_len is {cfg.max_model_len}", "messages"
        )
    return prompt


def _chat_generation(app: web.Application, body: dict[str, Any], prompt: list[int]) -> Generation:
    """The scripted answer to ``prompt``: the responder's message, or the policy's step, cut at
    ``max_completion_tokens`` / ``max_tokens`` and the context length."""
    cfg = app[CONFIG]
    step = cfg.policy.choose(body["messages"], bool(body.get("tools")))
    seed = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    max_tokens = min(max_tokens or cfg.max_model_len, cfg.max_model_len - len(prompt))
    family, tools = app[FAMILY], body.get("tools")
    if cfg.responder is not None:
        return family.generate(
            cfg.responder(body), max_tokens, tools=tools, id_seed=seed, prompt=prompt
        )
    message = step.assistant_message(seed)
    gen = family.generate(
        message,
        max_tokens,
        token_split=step.token_split,
        tools=tools,
        id_seed=seed,
        prompt=prompt,
    )
    if isinstance(body.get("tool_choice"), dict) and gen.finish_reason == "tool_calls":
        # vLLM 0.32: a named tool choice's call ends with "stop" (as OpenAI's does)
        gen = dataclasses.replace(gen, finish_reason="stop")
    return gen


def _chat_json(
    app: web.Application,
    body: dict[str, Any],
    head: dict[str, Any],
    prompt: list[int],
    gen: Generation,
    opts: _Options,
) -> dict[str, Any]:
    """The non-streamed ``chat.completion``. Raises RequestError (a bad
    ``routed_experts_prompt_start`` in MoE mode)."""
    cfg = app[CONFIG]
    choice: dict[str, Any] = {
        "index": 0,
        "message": gen.message,
        "logprobs": None,
        "finish_reason": None if cfg.faults.null_finish_reason else gen.finish_reason,
        "stop_reason": None,
    }
    if opts.logprobs:
        choice["logprobs"] = {
            "content": [
                entry
                for k, e in enumerate(gen.events)
                for entry in _faulty_entries(app, e, k, opts)
            ]
        }
    if opts.token_ids:
        choice["token_ids"] = gen.token_ids
    if cfg.moe is not None:
        start = body.get("routed_experts_prompt_start") or 0
        check(
            type(start) is int and start >= 0,
            "routed_experts_prompt_start must be a non-negative integer",
            "routed_experts_prompt_start",
        )
        rows = expert_rows(prompt + gen.token_ids, cfg.moe, start)
        choice["routed_experts"] = vllm_routed_experts(rows)
    out = {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(prompt, gen)}
    if opts.token_ids:
        out["prompt_token_ids"] = prompt
    return out


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (vLLM dialect; see the module docstring)."""
    app, cfg = request.app, request.app[CONFIG]
    body = await json_body(request)
    if cfg.fail_status is not None:
        failed = app[FAILED_SO_FAR]
        if cfg.fail_first_n is None or failed[0] < cfg.fail_first_n:
            failed[0] += 1
            raise RequestError("scripted failure", None, cfg.fail_status)
    validate_chat(body)
    check_model(app, body)
    prompt = _chat_prompt(app, body)
    walk = sampler(app)
    await walk.admit()
    try:
        return await _answer(request, body, prompt, walk)
    finally:
        await walk.finish()


async def _answer(
    request: web.Request, body: dict[str, Any], prompt: list[int], walk: Sampler
) -> web.StreamResponse:
    """The scripted generation, whole or streamed, under the engine's pause rules (a pause in
    abort mode ends it with ``finish_reason: "abort"`` and the tokens so far)."""
    app, cfg = request.app, request.app[CONFIG]
    gen = _chat_generation(app, body, prompt)
    remember_generation(app, prompt, gen)
    stream = body.get("stream") is True
    sent = SentCall(
        body,
        prompt,
        gen.token_ids,
        gen.log_probs,
        stream,
        gen.finish_reason,
        dict(request.headers),
        _peer(request),
    )
    app[SENT_CALLS].append(sent)
    index = len(app[SENT_CALLS]) - 1
    opts = _options(app, body)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": cfg.model_name,
    }
    delay_s = cfg.faults.delays_of(index)[0]
    if delay_s:
        await asyncio.sleep(delay_s)
    if stream:
        return await _stream(request, head, prompt, gen, opts, (walk, index))
    done = await walk.walk(len(gen.token_ids))
    if done < len(gen.token_ids):
        gen = _aborted(app, index, gen, done)
    out = _chat_json(app, body, head, prompt, gen, opts)
    return web.json_response(out, dumps=_engine_json)


def _aborted(app: web.Application, index: int, gen: Generation, num_tokens: int) -> Generation:
    """``gen`` cut at ``num_tokens`` by an abort; ``SENT_CALLS[index]`` says so too."""
    cut = gen.aborted(num_tokens)
    app[SENT_CALLS][index] = dataclasses.replace(
        app[SENT_CALLS][index],
        generation_token_ids=cut.token_ids,
        generation_log_probs=cut.log_probs,
        finish_reason=cut.finish_reason,
    )
    return cut


async def _stream(
    request: web.Request,
    head: dict[str, Any],
    prompt: list[int],
    gen: Generation,
    opts: _Options,
    walked: tuple[Sampler, int],
) -> web.StreamResponse:
    app, cfg = request.app, request.app[CONFIG]
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)

    faults = cfg.faults
    chunk_delay_s = faults.delays_of(walked[1])[1]

    async def send(obj: dict[str, Any] | str) -> None:
        data = obj if isinstance(obj, str) else _engine_json(obj)
        raw = f"data: {data}\n\n".encode()
        step = cfg.sse_fragment_bytes or len(raw)
        try:
            for i in range(0, len(raw), step):
                await resp.write(raw[i : i + step])  # write() drains the transport
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            app[CLIENT_GONE].set()
            raise

    chunk = {**head, "object": "chat.completion.chunk"}
    first: dict[str, Any] = {
        **chunk,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    if opts.token_ids:
        first["prompt_token_ids"] = prompt
    try:
        await send(first)
        sent = await _send_tokens(
            send, app, chunk, gen, opts, faults, request, walked[0], chunk_delay_s
        )
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        return resp  # the client left: like vLLM, abort the request
    except asyncio.CancelledError:
        app[CLIENT_GONE].set()  # the client left and the server cancelled this handler
        raise
    if faults.disconnect_after_chunks is not None:
        return resp
    if sent < len(gen.token_ids):
        # aborted (a pause in abort mode): one last chunk says so, vLLM's way
        gen = _aborted(app, walked[1], gen, sent)
        last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "abort"}
        await send({**chunk, "choices": [{**last, "stop_reason": None}]})
    if opts.usage:
        await send({**chunk, "choices": [], "usage": _usage(prompt, gen)})
    if not faults.drop_done:
        await send("[DONE]")
    if faults.hold_body_after_done_s:
        await asyncio.sleep(faults.hold_body_after_done_s)
    await resp.write_eof()
    return resp


def _peer(request: web.Request) -> tuple[str, int] | None:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return (str(peer[0]), int(peer[1])) if peer else None


async def _send_tokens(
    send: Any,
    app: web.Application,
    chunk: dict[str, Any],
    gen: Generation,
    opts: _Options,
    faults: Faults,
    request: web.Request,
    walk: Sampler,
    chunk_delay_s: float,
) -> int:
    """Send the tokens' chunks; how many tokens the engine sampled (fewer: aborted)."""
    for k, e in enumerate(gen.events):
        if not await walk.next_token(k):
            return k
        if chunk_delay_s:
            await asyncio.sleep(chunk_delay_s)
        if faults.disconnect_after_chunks is not None and k >= faults.disconnect_after_chunks:
            if request.transport is not None:
                request.transport.close()
            return k
        if faults.malformed_chunk_at == k:
            await send("{not json")
            continue
        last = k == len(gen.events) - 1
        if k in faults.drop_chunks_at and not last:
            continue
        delta: dict[str, Any] = {}
        if e.reasoning:
            delta["reasoning_content"] = e.reasoning
        if e.content:
            delta["content"] = e.content
        if e.tool_calls:
            delta["tool_calls"] = list(e.tool_calls)
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": (
                gen.finish_reason if last and not app[CONFIG].faults.null_finish_reason else None
            ),
        }
        if last:
            choice["stop_reason"] = None
        if opts.logprobs:
            choice["logprobs"] = {"content": _faulty_entries(app, e, k, opts)}
        if opts.token_ids:
            choice["token_ids"] = [e.token_id]
        await send({**chunk, "choices": [choice]})
    return len(gen.events)


def _faulty_entries(app: web.Application, e: TokenEvent, k: int, opts: _Options) -> list[dict]:
    """The log-prob entries of token ``k``, with the configured faults applied."""
    faults = app[CONFIG].faults
    if faults.drop_logprob_at == k:
        return []
    entry = _logprob_entry(app[FAMILY], e, opts.top, opts.as_ids)
    if faults.nan_logprob_at == k:
        entry["logprob"] = None
    return [entry]
