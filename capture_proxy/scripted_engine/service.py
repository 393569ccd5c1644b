"""The scripted engine's service endpoints: ``/tokenize``, ``/detokenize``, ``/v1/models``,
``/health`` (vLLM's shapes).

Must not: generate (``chat`` and ``tokens_in`` do).
"""

from __future__ import annotations

from typing import cast

from aiohttp import web

from capture_proxy.scripted_engine.chat_request import (
    chat_prompt_ids,
    check,
    json_body,
    validate_chat,
)
from capture_proxy.scripted_engine.state import CONFIG, FAMILY, RequestError, check_model


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: chat form (``messages``, ``tools``, ``add_generation_prompt``) or
    prompt form (``prompt``) -> ``{count, max_model_len, tokens, token_strs}``."""
    app = request.app
    body = await json_body(request)
    if "messages" in body:
        validate_chat(body)
    check_model(app, body)
    if "messages" in body:
        # Like vLLM 0.32: only chat completions rename an assistant message's deprecated
        # ``reasoning_content`` to ``reasoning``; /tokenize drops the field, so that reasoning is
        # not rendered here (``reasoning`` is).
        messages = [
            {k: v for k, v in m.items() if k != "reasoning_content"} for m in body["messages"]
        ]
        ids = chat_prompt_ids(app, {**body, "messages": messages})
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
    body = await json_body(request)
    ids = body.get("tokens")
    vocab = request.app[FAMILY].vocab_size
    check(
        isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids),
        "tokens must be a list of token ids",
        "tokens",
    )
    check_model(request.app, body)
    return web.json_response({"prompt": request.app[FAMILY].decode(cast(list[int], ids))})


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: one card per served name, as vLLM lists its ``--served-model-name``s
    (``model_name`` first)."""
    cfg = request.app[CONFIG]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "capture-proxy",
                    "root": cfg.model_name,
                    "max_model_len": cfg.max_model_len,
                }
                for name in cfg.served_models
            ],
        }
    )


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 with an empty body, like vLLM."""
    return web.Response()
