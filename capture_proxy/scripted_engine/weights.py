"""The scripted engine's weight-update endpoints, as vLLM 0.32 serves them with
``VLLM_SERVER_DEV_MODE=1`` (``vllm/entrypoints/rl/online/api_router.py``).

Owns ``WeightState`` (the engine's current weight version and pause state) and the routes:
``GET /weight_info`` -> ``{"weight_version": str}``; ``POST /update_weight_version``
``{"new_version": str}``; ``POST /finish_weight_update`` ``{"weight_version": str}``;
``POST /update_weights`` (no-op: the scripted policy has no weights); ``POST
/pause?mode=abort|keep|wait``; ``POST /resume``; ``GET /is_paused`` -> ``{"is_paused": bool}``.
The generation loops read ``WeightState`` (the version of each token they emit; whether to
abort, hold or go on). Must not: generate tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from capture_proxy.scripted_engine.state import RequestError

PAUSE_MODES = ("abort", "keep", "wait")


@dataclass
class WeightState:
    """The weight version the engine serves (vLLM's default is ``"default"``) and its pause.

    ``pause_mode``: None while serving, else the mode of the pause in effect. ``resumed`` is
    set while serving (generation loops ``await resumed.wait()`` to hold under ``keep``);
    ``aborted`` counts pauses in ``abort`` mode, so a loop that saw a lower count aborts its
    request (``finish_reason: "abort"``)."""

    version: str = "default"
    pause_mode: str | None = None
    aborted: int = 0
    resumed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.resumed.set()


WEIGHTS = web.AppKey("weights", WeightState)


async def _json_field(request: web.Request, name: str) -> str:
    try:
        body = await request.json()
    except ValueError as exc:
        raise RequestError(f"body is not JSON: {exc}") from exc
    value = body.get(name) if isinstance(body, dict) else None
    if value is None:
        raise RequestError(f"'{name}' is required", name)
    return str(value)


async def weight_info(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[WEIGHTS].version})


async def update_weight_version(request: web.Request) -> web.Response:
    request.app[WEIGHTS].version = await _json_field(request, "new_version")
    return web.json_response({"status": "ok"})


async def finish_weight_update(request: web.Request) -> web.Response:
    request.app[WEIGHTS].version = await _json_field(request, "weight_version")
    return web.json_response({"status": "ok"})


async def update_weights(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def pause(request: web.Request) -> web.Response:
    state = request.app[WEIGHTS]
    mode = request.query.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}", "mode")
    state.pause_mode = mode
    state.resumed.clear()
    if mode == "abort":
        state.aborted += 1
    return web.json_response({"status": "paused", "mode": mode})


async def resume(request: web.Request) -> web.Response:
    state = request.app[WEIGHTS]
    state.pause_mode = None
    state.resumed.set()
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[WEIGHTS].pause_mode is not None})


def add_weight_routes(app: web.Application) -> None:
    """Register the weight-update routes and a fresh ``WeightState`` under ``WEIGHTS``."""
    app[WEIGHTS] = WeightState()
    app.router.add_get("/weight_info", weight_info)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_post("/finish_weight_update", finish_weight_update)
    app.router.add_post("/update_weights", update_weights)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
