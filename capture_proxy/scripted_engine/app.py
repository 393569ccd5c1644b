"""The scripted engine's aiohttp app: vLLM's OpenAI dialect over a real Qwen tokenizer.

Owns building and running the app: the tokenizer and family loaded once, the app's state, the
error middleware (OpenAI-shaped errors from ``RequestError``) and the routes: chat completions
(``chat``), ``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health`` (``service``) and the
tokens-in endpoints (``tokens_in``). The policy (``policy.py``) and token events
(``generation.py``) are pure and live elsewhere. Must not: load the tokenizer per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerFast

from capture_proxy.families import load_family
from capture_proxy.families.base import RenderError
from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.families.qwen_vocab import load_chat_template, load_qwen_tokenizer
from capture_proxy.scripted_engine.chat import chat_completions
from capture_proxy.scripted_engine.families import EngineFamily
from capture_proxy.scripted_engine.service import detokenize, health, models, tokenize
from capture_proxy.scripted_engine.state import (
    CLIENT_GONE,
    CONFIG,
    FAILED_SO_FAR,
    FAMILY,
    GENERATIONS,
    SEEN_REQUESTS,
    SENT_CALLS,
    TEMPLATE,
    TOKENIZER,
    RequestError,
    ScriptedEngineConfig,
)
from capture_proxy.scripted_engine.tokens_in.routes import add_tokens_in_routes
from capture_proxy.scripted_engine.weights import add_weight_routes


def error_body(
    message: str, status: int, param: str | None = None, error_type: str | None = None
) -> dict[str, Any]:
    """OpenAI-shaped error body (``error_type``: its ``type``, else by the status)."""
    kind = error_type or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    request.app[SEEN_REQUESTS].append((request.method, request.path, dict(request.headers)))
    try:
        return await handler(request)
    except asyncio.CancelledError:
        request.app[CLIENT_GONE].set()  # the server cancelled the handler: its client left
        raise
    except RequestError as e:
        return web.json_response(
            error_body(str(e), e.status, e.param, e.error_type), status=e.status
        )


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
    app[GENERATIONS] = []
    app[SEEN_REQUESTS] = []
    app[FAILED_SO_FAR] = [0]
    app[CLIENT_GONE] = asyncio.Event()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    add_tokens_in_routes(app, config.enable_scale_out)
    if config.dev_mode:
        add_weight_routes(app)
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
    if isinstance(family.renderer, LocalRenderer):
        family.renderer.vision = config.vision  # a renderer of its own, made above
    if config.family == "gpt_oss":
        return EngineFamily(family, None)
    return EngineFamily(family, family.renderer.tokenizer)


def run_scripted_engine(
    host: str, port: int, config: ScriptedEngineConfig, app: web.Application | None = None
) -> None:
    """Serve the engine until interrupted (blocking; for the CLI). ``app``: the engine
    already built from ``config`` (the CLI builds it first, to report a config that cannot
    load); else it is built here. Raises ValueError (building: see
    ``build_scripted_engine_app``) and OSError (the address cannot be bound)."""
    if app is None:
        app = build_scripted_engine_app(config)
    # A deep listen queue, like uvicorn's 2048: thousands of rollouts connect at once.
    shown = f"[{host}]" if ":" in host else host
    web.run_app(
        app,
        host=host,
        port=port,
        # aiohttp prints this once the socket listens
        print=lambda _: print(
            f"scripted-engine: serving on http://{shown}:{port} (family {config.family})",
            flush=True,
        ),
        backlog=4096,
    )
