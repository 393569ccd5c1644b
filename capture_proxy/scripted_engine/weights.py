"""The scripted engine's weight-update endpoints, as vLLM 0.32 serves them with
``VLLM_SERVER_DEV_MODE=1`` (``vllm/entrypoints/rl/online/api_router.py``), and the pause
rules its generation loops follow (``Sampler``).

Owns ``WeightState`` (the engine's current weight version and pause state) and the routes:
``GET /weight_info`` -> ``{"weight_version": str}``; ``POST /update_weight_version``
``{"new_version": str}``; ``POST /finish_weight_update`` ``{"weight_version": str | null}``;
``POST /update_weights`` (no-op: the scripted policy has no weights); ``POST
/pause?mode=abort|keep|wait``; ``POST /resume``; ``GET /is_paused`` -> ``{"is_paused": bool}``;
``POST /abort_requests`` (every request in flight, without a pause).

The pause modes, as vLLM 0.32's ``AsyncLLM.pause_generation``: ``abort`` ends every request in
flight at once (``finish_reason: "abort"``, the tokens so far); ``keep`` freezes them until
``/resume``; ``wait`` lets them finish (the pause call returns once they have). In every mode a
request that arrives while paused is not scheduled until ``/resume``. Each token is labelled
with the version in effect when it is sampled; vLLM's output processor turns the labels into
``WeightVersionSpan``s (``v1/engine/output_processor.py`` ``track_weight_version``).
Must not: generate tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from capture_proxy.scripted_engine.state import RequestError

PAUSE_MODES = ("abort", "keep", "wait")

#: vLLM's version before any update (``EngineCore._weight_version``)
DEFAULT_VERSION = "default"


@dataclass
class WeightState:
    """The weight version the engine serves and its pause.

    ``pause_mode``: None while serving, else the mode of the pause in effect. ``changed`` is
    notified on every pause, resume and release. ``aborted`` counts pauses in ``abort`` mode:
    a request that saw a lower count when admitted is aborted. ``in_flight``: requests admitted
    and not finished (``wait`` waits for 0).

    A test holds a generation at a known token (``hold_at``): the first request to reach token
    ``hold_at`` sets ``held`` (and ``hold_at`` back to None) and waits there until the next
    pause or ``release()``, so the test can pause the engine at a known point without
    timing. With ``hold_pause`` set, the engine enters that pause itself as it holds (as if
    ``POST /pause?mode=`` arrived at that token): no moment passes in which the generation
    stalls unpaused (a proxy's read timeout firing then would rightly cut the call)."""

    version: str = DEFAULT_VERSION
    pause_mode: str | None = None
    aborted: int = 0
    in_flight: int = 0
    hold_at: int | None = None
    #: the pause mode (``PAUSE_MODES``) the engine enters at ``hold_at``; None: none, it holds
    hold_pause: str | None = None
    held: asyncio.Event = field(default_factory=asyncio.Event)
    #: set by every ``GET /is_paused`` (a test waits for the proxy to have asked)
    asked_paused: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _released: int = 0

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def pause(self, mode: str) -> None:
        """Enter a pause in ``mode`` (the caller notifies ``changed``)."""
        self.pause_mode = mode
        if mode == "abort":
            self.aborted += 1

    async def release(self) -> None:
        """Let held generations go on (without a pause)."""
        self._released += 1
        await self.notify()


WEIGHTS = web.AppKey("weights", WeightState)


class Sampler:
    """One request's walk over its tokens under the engine's pause rules (``WeightState``;
    None: an engine without the dev-mode endpoints, always serving ``"default"``). ``spans``:
    ``[{"version", "start", "end"}]`` over the tokens let through, vLLM's shape."""

    def __init__(self, state: WeightState | None) -> None:
        self.state = state
        self.spans: list[dict[str, object]] = []
        self._aborted_at_admission = 0
        self._admitted = False

    @property
    def version(self) -> str:
        """The engine's weight version now."""
        return self.state.version if self.state is not None else DEFAULT_VERSION

    async def admit(self) -> None:
        """Wait while the engine is paused (a new request is not scheduled until resume)."""
        state = self.state
        if state is None:
            return
        async with state.changed:
            await state.changed.wait_for(lambda: state.pause_mode is None)
        self._aborted_at_admission = state.aborted
        state.in_flight += 1
        self._admitted = True

    async def finish(self) -> None:
        """The request is over (answered, aborted or its client gone)."""
        if self.state is not None and self._admitted:
            self._admitted = False
            self.state.in_flight -= 1
            await self.state.notify()

    async def next_token(self, k: int) -> bool:
        """May token ``k`` be sampled? False: the request was aborted (a pause in ``abort``
        mode); under ``keep`` this waits for the resume."""
        state = self.state
        version = DEFAULT_VERSION
        if state is not None:
            if state.hold_at == k:
                state.hold_at = None  # one request holds, once
                released = state._released
                if state.hold_pause is not None:
                    state.pause(state.hold_pause)
                    await state.notify()
                state.held.set()
                async with state.changed:
                    await state.changed.wait_for(
                        lambda: state.pause_mode is not None or state._released != released
                    )
            if state.aborted != self._aborted_at_admission:
                return False
            if state.pause_mode == "keep":
                async with state.changed:
                    await state.changed.wait_for(lambda: state.pause_mode != "keep")
                if state.aborted != self._aborted_at_admission:
                    return False
            version = state.version
        if self.spans and self.spans[-1]["version"] == version:
            self.spans[-1]["end"] = k + 1
        else:
            self.spans.append({"version": version, "start": k, "end": k + 1})
        return True

    async def walk(self, num_tokens: int) -> int:
        """Let up to ``num_tokens`` tokens through; how many were (fewer: aborted)."""
        for k in range(num_tokens):
            if not await self.next_token(k):
                return k
        return num_tokens


def sampler(app: web.Application) -> Sampler:
    """A sampler for one request of ``app``."""
    return Sampler(app.get(WEIGHTS))


async def _json_field(request: web.Request, name: str, required: bool = True) -> str | None:
    try:
        body = await request.json()
    except ValueError as exc:
        raise RequestError(f"body is not JSON: {exc}") from exc
    value = body.get(name) if isinstance(body, dict) else None
    if value is None:
        if required:
            raise RequestError(f"'{name}' is required", name)
        return None
    return str(value)


async def weight_info(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[WEIGHTS].version})


async def update_weight_version(request: web.Request) -> web.Response:
    version = await _json_field(request, "new_version")
    assert version is not None
    request.app[WEIGHTS].version = version
    return web.json_response({"success": True, "new_version": version})


async def finish_weight_update(request: web.Request) -> web.Response:
    version = await _json_field(request, "weight_version", required=False)
    if version is not None:
        request.app[WEIGHTS].version = version
    return web.json_response({"message": "Weight update finished"})


async def update_weights(request: web.Request) -> web.Response:
    return web.json_response({"message": "Weights updated"})


async def pause(request: web.Request) -> web.Response:
    state = request.app[WEIGHTS]
    mode = request.query.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}", "mode", 422)
    state.pause(mode)
    await state.notify()
    if mode == "wait":
        # vLLM: the call returns once the requests in flight have finished.
        async with state.changed:
            await state.changed.wait_for(lambda: state.in_flight == 0)
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    state = request.app[WEIGHTS]
    state.pause_mode = None
    state.held.clear()
    await state.notify()
    return web.json_response({"status": "resumed"})


async def abort_requests(request: web.Request) -> web.Response:
    """Abort every request in flight without pausing (vLLM's ``/abort_requests`` with no ids:
    RL frameworks end a batch early this way)."""
    state = request.app[WEIGHTS]
    aborted = state.in_flight
    state.aborted += 1
    await state.notify()
    return web.json_response({"status": "aborted", "aborted": aborted})


async def is_paused(request: web.Request) -> web.Response:
    state = request.app[WEIGHTS]
    state.asked_paused.set()
    return web.json_response({"is_paused": state.pause_mode is not None})


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
    app.router.add_post("/abort_requests", abort_requests)
