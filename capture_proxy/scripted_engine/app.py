"""The scripted engine's aiohttp app: vLLM's OpenAI dialect over a real Qwen tokenizer.

Owns HTTP: request validation (OpenAI-shaped 400s), prompt rendering with our chat template,
vLLM-shaped responses (streaming and not; token ids, log probs, usage), ``/tokenize``,
``/detokenize``, ``/v1/models``, ``/health``, fault switches, and the ``SENT_CALLS`` record
tests compare against. The policy (``policy.py``) and token events (``generation.py``) are
pure and live elsewhere. Must not: load the tokenizer per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
from aiohttp import web
from transformers import PreTrainedTokenizerFast

from capture_proxy.families import load_family
from capture_proxy.families.base import RenderError
from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.families.qwen_vocab import load_chat_template, load_qwen_tokenizer
from capture_proxy.scripted_engine.families import EngineFamily
from capture_proxy.scripted_engine.faults import Faults
from capture_proxy.scripted_engine.generation import Generation, TokenEvent
from capture_proxy.scripted_engine.moe import expert_rows, vllm_routed_experts
from capture_proxy.scripted_engine.policy import Policy
from capture_proxy.scripted_engine.state import (
    CLIENT_GONE,
    CONFIG,
    FAILED_SO_FAR,
    FAMILY,
    SENT_CALLS,
    TEMPLATE,
    TOKENIZER,
    RequestError,
    ScriptedEngineConfig,
    SentCall,
)
from capture_proxy.scripted_engine.tokens_in import add_tokens_in_routes

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI-shaped error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return web.json_response(error_body(str(e), e.status, e.param), status=e.status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise RequestError(message, param)


def _validate_chat(body: dict[str, Any]) -> None:
    msgs = body.get("messages")
    _check(
        isinstance(msgs, list) and len(msgs) > 0, "messages must be a non-empty list", "messages"
    )
    for i, m in enumerate(msgs or []):
        _check(
            isinstance(m, dict) and m.get("role") in ROLES,
            f"messages[{i}] must be an object with a role in {sorted(ROLES)}",
            f"messages.{i}",
        )
        c = m.get("content")
        _check(
            c is None or isinstance(c, str | list),
            f"messages[{i}].content must be a string, null or a list of parts",
            f"messages.{i}.content",
        )
        for j, tc in enumerate(m.get("tool_calls") or []):
            fn = tc.get("function") if isinstance(tc, dict) else None
            _check(
                isinstance(fn, dict) and isinstance(fn.get("name"), str),
                "tool calls need function.name",
                f"messages.{i}.tool_calls.{j}",
            )
    tools = body.get("tools")
    _check(tools is None or isinstance(tools, list), "tools must be a list", "tools")
    _check(body.get("n", 1) == 1, "only n=1 is supported", "n")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        _check(v is None or (type(v) is int and v > 0), f"{key} must be a positive integer", key)
    top = body.get("top_logprobs")
    _check(
        top is None or (type(top) is int and 0 <= top <= 20),
        "top_logprobs must be an integer in [0, 20]",
        "top_logprobs",
    )
    _check(isinstance(body.get("stream", False), bool), "stream must be a boolean", "stream")


def _parse_tool_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_parsed_call(c) for c in calls]}
        out.append(m)
    return out


def _parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            raise RequestError(f"tool call arguments are not JSON: {e}", "messages") from e
    return {**call, "function": {**fn, "arguments": args}}


def render_prompt(app: web.Application, body: dict[str, Any], generation_prompt: bool) -> list[int]:
    """Prompt token ids, rendered by the family's renderer (the proxy's): for the Qwen
    families the template rendered to text, then encoded without extra specials.

    Like vLLM (``chat_utils._postprocess_messages``), assistant tool-call arguments arrive as
    JSON strings and are parsed into objects before rendering, so the template re-serialises
    them with ``tojson`` (``json.dumps`` defaults: ``", "`` and ``": "``, UTF-8 kept)."""
    try:
        if app[FAMILY].tokenizer is not None:
            _parse_tool_arguments(body["messages"])  # the 400 vLLM gives for bad arguments
        return app[FAMILY].render(body["messages"], body.get("tools"), generation_prompt)
    except RequestError:
        raise
    except (RenderError, Exception) as e:  # template errors are the client's fault
        raise RequestError(f"cannot render messages: {e}", "messages") from e


def render_continuation(app: web.Application, body: dict[str, Any]) -> list[int]:
    """Prompt ids with the last message left open (vLLM's ``continue_final_message``), by the
    family's renderer (the proxy's). Raises RequestError."""
    renderer = app[FAMILY].family.renderer
    if not isinstance(renderer, LocalRenderer):
        raise RequestError("continue_final_message is not supported for this family", "messages")
    try:
        if app[FAMILY].tokenizer is not None:
            _parse_tool_arguments(body["messages"])
        return list(
            renderer.render_continuation_sync(
                body["messages"],
                body.get("tools") or None,
                chat_template_kwargs=body.get("chat_template_kwargs"),
            )
        )
    except RequestError:
        raise
    except Exception as e:  # template errors are the client's fault
        raise RequestError(f"cannot render messages: {e}", "messages") from e


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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (vLLM dialect; see the module docstring)."""
    app, cfg = request.app, request.app[CONFIG]
    body = await _json_body(request)
    if cfg.fail_status is not None:
        failed = app[FAILED_SO_FAR]
        if cfg.fail_first_n is None or failed[0] < cfg.fail_first_n:
            failed[0] += 1
            raise RequestError("scripted failure", None, cfg.fail_status)
    _validate_chat(body)
    if body.get("continue_final_message") is True:
        # vLLM: transformers' continue_final_message leaves the last message open
        prompt = render_continuation(app, body)
    else:
        prompt = render_prompt(app, body, True)
    if len(prompt) >= cfg.max_model_len:
        raise RequestError(
            f"prompt has {len(prompt)} tokens; max_model_len is {cfg.max_model_len}", "messages"
        )
    step = cfg.policy.choose(body["messages"], bool(body.get("tools")))
    seed = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    max_tokens = min(max_tokens or cfg.max_model_len, cfg.max_model_len - len(prompt))
    family, tools = app[FAMILY], body.get("tools")
    if cfg.responder is not None:
        gen = family.generate(
            cfg.responder(body), max_tokens, tools=tools, id_seed=seed, prompt=prompt
        )
    else:
        message = step.assistant_message(seed)
        gen = family.generate(
            message,
            max_tokens,
            token_split=step.token_split,
            tools=tools,
            id_seed=seed,
            prompt=prompt,
        )
    stream = body.get("stream") is True
    app[SENT_CALLS].append(
        SentCall(
            body,
            prompt,
            gen.token_ids,
            gen.log_probs,
            stream,
            gen.finish_reason,
            dict(request.headers),
            _peer(request),
        )
    )
    opts = _options(app, body)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": cfg.model_name,
    }
    if cfg.faults.first_byte_delay_s:
        await asyncio.sleep(cfg.faults.first_byte_delay_s)
    if stream:
        return await _stream(request, head, prompt, gen, opts)
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
        _check(
            type(start) is int and start >= 0,
            "routed_experts_prompt_start must be a non-negative integer",
            "routed_experts_prompt_start",
        )
        rows = expert_rows(prompt + gen.token_ids, cfg.moe, start)
        choice["routed_experts"] = vllm_routed_experts(rows)
    out = {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(prompt, gen)}
    if opts.token_ids:
        out["prompt_token_ids"] = prompt
    return web.json_response(out, dumps=lambda o: json.dumps(o, ensure_ascii=False))


async def _stream(
    request: web.Request, head: dict[str, Any], prompt: list[int], gen: Generation, opts: _Options
) -> web.StreamResponse:
    app, cfg = request.app, request.app[CONFIG]
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)

    faults = cfg.faults

    async def send(obj: dict[str, Any] | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
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
        await _send_tokens(send, app, chunk, gen, opts, faults, request)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        return resp  # the client left: like vLLM, abort the request
    except asyncio.CancelledError:
        app[CLIENT_GONE].set()  # the client left and the server cancelled this handler
        raise
    if faults.disconnect_after_chunks is not None:
        return resp
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
) -> None:
    for k, e in enumerate(gen.events):
        if faults.chunk_delay_s:
            await asyncio.sleep(faults.chunk_delay_s)
        if faults.disconnect_after_chunks is not None and k >= faults.disconnect_after_chunks:
            if request.transport is not None:
                request.transport.close()
            return
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
        if e.tool_call:
            delta["tool_calls"] = [e.tool_call]
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


def _faulty_entries(app: web.Application, e: TokenEvent, k: int, opts: _Options) -> list[dict]:
    """The log-prob entries of token ``k``, with the configured faults applied."""
    faults = app[CONFIG].faults
    if faults.drop_logprob_at == k:
        return []
    entry = _logprob_entry(app[FAMILY], e, opts.top, opts.as_ids)
    if faults.nan_logprob_at == k:
        entry["logprob"] = None
    return [entry]


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: chat form (``messages``, ``tools``, ``add_generation_prompt``) or
    prompt form (``prompt``) -> ``{count, max_model_len, tokens, token_strs}``."""
    app = request.app
    body = await _json_body(request)
    if "messages" in body:
        _validate_chat(body)
        # Like vLLM 0.32: only chat completions rename an assistant message's deprecated
        # ``reasoning_content`` to ``reasoning``; /tokenize drops the field, so that reasoning is
        # not rendered here (``reasoning`` is).
        messages = [
            {k: v for k, v in m.items() if k != "reasoning_content"} for m in body["messages"]
        ]
        generation_prompt = body.get("add_generation_prompt", True) is not False
        if body.get("continue_final_message") is True:
            ids = render_continuation(app, {**body, "messages": messages})
        else:
            ids = render_prompt(app, {**body, "messages": messages}, generation_prompt)
    elif isinstance(body.get("prompt"), str):
        ids = app[FAMILY].encode(body["prompt"])
    else:
        raise RequestError("give messages or a string prompt", "prompt")
    return web.json_response(
        {
            "count": len(ids),
            "max_model_len": app[CONFIG].max_model_len,
            "tokens": ids,
            "token_strs": (
                app[FAMILY].tokenizer.convert_ids_to_tokens(ids)
                if app[FAMILY].tokenizer is not None
                else [app[FAMILY].decode([i]) for i in ids]
            ),
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    """``POST /detokenize``: ``{tokens: [int]}`` -> ``{prompt: str}``."""
    body = await _json_body(request)
    ids = body.get("tokens")
    vocab = request.app[FAMILY].vocab_size
    _check(
        isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids),
        "tokens must be a list of token ids",
        "tokens",
    )
    return web.json_response({"prompt": request.app[FAMILY].decode(cast(list[int], ids))})


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``."""
    cfg = request.app[CONFIG]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": cfg.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "capture-proxy",
                    "root": cfg.model_name,
                    "max_model_len": cfg.max_model_len,
                }
            ],
        }
    )


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 with an empty body, like vLLM."""
    return web.Response()


def build_scripted_engine_app(
    config: ScriptedEngineConfig, tokenizer: PreTrainedTokenizerFast | None = None
) -> web.Application:
    """The engine app. ``tokenizer``: a loaded Qwen tokenizer to share (tests); by default one
    is loaded here, once (its template is chosen per app by ``config.tokenizer_template``).
    Raises ValueError for an unknown template."""
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    app[CONFIG] = config
    app[TEMPLATE] = config.chat_template or load_chat_template(config.tokenizer_template)
    app[TOKENIZER] = tokenizer or load_qwen_tokenizer(config.tokenizer_cache_dir)
    app[FAMILY] = engine_family(config, app[TOKENIZER])
    app[SENT_CALLS] = []
    app[FAILED_SO_FAR] = [0]
    app[CLIENT_GONE] = asyncio.Event()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    add_tokens_in_routes(app, config.enable_scale_out)
    return app


def engine_family(config: ScriptedEngineConfig, tokenizer: PreTrainedTokenizerFast) -> EngineFamily:
    """The engine's family, sharing ``tokenizer`` (the Qwen families without a
    ``tokenizer_dir``). Raises ValueError for an unknown family or template, or llama3
    without ``tokenizer_dir``."""
    try:
        family = load_family(config.family, tokenizer=tokenizer, tokenizer_dir=config.tokenizer_dir)
    except RenderError as exc:
        raise ValueError(str(exc)) from exc
    if config.chat_template is not None and config.family != "gpt_oss":
        renderer = LocalRenderer(family.renderer.tokenizer, config.chat_template)
        family = dataclasses.replace(family, renderer=renderer)
    elif config.family == "qwen3" and config.tokenizer_dir is None:
        template = load_chat_template(config.tokenizer_template)
        family = dataclasses.replace(family, renderer=LocalRenderer(tokenizer, template))
    if config.family == "gpt_oss":
        return EngineFamily(family, None)
    return EngineFamily(family, family.renderer.tokenizer)


def run_scripted_engine(host: str, port: int, config: ScriptedEngineConfig) -> None:
    """Serve the engine until interrupted (blocking; for the CLI)."""
    # A deep listen queue, like uvicorn's 2048: thousands of rollouts connect at once.
    shown = f"[{host}]" if ":" in host else host
    web.run_app(
        build_scripted_engine_app(config),
        host=host,
        port=port,
        # aiohttp prints this once the socket listens
        print=lambda _: print(
            f"scripted-engine: serving on http://{shown}:{port} (family {config.family})",
            flush=True,
        ),
        backlog=4096,
    )


def run_scripted_engine_cli(
    host: str,
    port: int,
    policy_path: Path | None,
    template: str = "keep_reasoning",
    max_model_len: int = 32768,
    family: str = "qwen3",
    chat_template_path: Path | None = None,
    tokenizer_dir: Path | None = None,
) -> int:
    """``capture-proxy scripted-engine``: serve with the policy file (or the built-in one);
    ``chat_template_path``: a jinja chat template file to render with instead of ours."""
    policy = Policy.load(policy_path) if policy_path is not None else Policy.default()
    chat_template = None
    if chat_template_path is not None:
        chat_template = chat_template_path.read_text(encoding="utf-8")
    config = ScriptedEngineConfig(
        policy=policy,
        tokenizer_template=template,
        max_model_len=max_model_len,
        family=family,
        chat_template=chat_template,
        tokenizer_dir=tokenizer_dir,
    )
    run_scripted_engine(host, port, config)
    return 0
