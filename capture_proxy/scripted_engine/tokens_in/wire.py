"""The tokens-in endpoints' shared wire pieces: typed field reads with a dialect's error,
stop lists, the JSON body, injected failures, usage, JSON and SSE responses, routed experts.

Handlers call these through the module (``wire.sse``), so a test can swap the SSE writer of
every tokens-in endpoint in one place. Must not: know one dialect's request or answer shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from capture_proxy.families.vision import IMAGE_PAD_ID, expand_image_pads, image_sizes
from capture_proxy.scripted_engine.moe import expert_rows
from capture_proxy.scripted_engine.state import CONFIG, RequestError
from capture_proxy.scripted_engine.tokens_in.tokens_out import TokensOut
from capture_proxy.scripted_engine.weights import Sampler

#: one SSE event: its JSON object, or a function that makes it when it is sent (a last chunk
#: that names what is known only then: the weight versions of every token)
Event = dict[str, Any] | Callable[[], dict[str, Any]]


def field(
    body: dict[str, Any], key: str, kind: Any, default: Any, fail: Callable[[str, str], Exception]
) -> Any:
    """``body[key]`` (``default`` when absent or null), checked to be of ``kind`` (``int``,
    ``bool``, ``num``, ``str``, ``dict``). Raises ``fail(message, key)``."""
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


def stop_list(v: Any, key: str, fail: Callable[[str, str], Exception]) -> list[str]:
    """A ``stop`` value as a list of non-empty strings. Raises ``fail(message, key)``."""
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise fail(f"{key} must be a string or a list of strings", key)


def id_list(v: Any, key: str, vocab: int, fail: Callable[[str, str], Exception]) -> list[int]:
    """A list of token ids below ``vocab`` (``[]`` for null). Raises ``fail(message, key)``."""
    if v is None:
        return []
    if isinstance(v, list) and all(type(t) is int and 0 <= t < vocab for t in v):
        return v
    raise fail(f"{key} must be a list of token ids below {vocab}", key)


async def read_json(request: web.Request, fail: Callable[[str, str], Exception]) -> dict[str, Any]:
    """The request's JSON object. Raises ``fail(message, "body")``."""
    try:
        body = await request.json()
    except ValueError as e:
        raise fail(f"request body is not valid JSON: {e}", "body") from e
    if not isinstance(body, dict):
        raise fail("request body must be a JSON object", "body")
    return body


def check_fault(app: web.Application) -> None:
    """Raise the injected failure (``fail_status``), if any, as a RequestError."""
    status = app[CONFIG].fail_status
    if status is not None:
        raise RequestError("scripted failure", None, status)


def usage(out: TokensOut) -> dict[str, int]:
    """OpenAI-shaped usage of ``out`` (token counts)."""
    p, c = len(out.prompt), len(out.ids)
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}


@dataclass(frozen=True)
class Gate:
    """A stream's tokens under the engine's pause rules: events ``0 .. num_tokens - 1`` are
    the tokens'; before each, ``sampler.next_token(k)``; on an abort ``on_abort(k)`` is sent
    in place of the rest (the usage after the tokens included)."""

    sampler: Sampler
    num_tokens: int
    on_abort: Callable[[int], list[Event]]


async def sse(
    request: web.Request, events: Sequence[Event], gate: Gate | None = None
) -> web.StreamResponse:
    """Stream ``events`` as ``data:`` lines, then ``data: [DONE]`` (in ``sse_fragment_bytes``
    pieces when set), the tokens' events through ``gate`` when given, each after the first
    ``chunk_delay_s`` after the one before (``Faults``)."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    step = request.app[CONFIG].sse_fragment_bytes
    delay_s = request.app[CONFIG].faults.chunk_delay_s

    async def send(event: Event | str) -> None:
        data = (
            event
            if isinstance(event, str)
            else json.dumps(event() if callable(event) else event, ensure_ascii=False)
        )
        raw = f"data: {data}\n\n".encode()
        for i in range(0, len(raw), step or len(raw)):
            await resp.write(raw[i : i + (step or len(raw))])

    for k, obj in enumerate(events):
        if gate is not None and k < gate.num_tokens and not await gate.sampler.next_token(k):
            for extra in gate.on_abort(k):
                await send(extra)
            break
        if delay_s and gate is not None and 0 < k < gate.num_tokens:
            await asyncio.sleep(delay_s)
        await send(obj)
    await send("[DONE]")
    await resp.write_eof()
    return resp


def json_response(obj: dict[str, Any], status: int = 200) -> web.Response:
    """``obj`` as a JSON response, non-ASCII kept as is."""
    return web.json_response(obj, status=status, dumps=lambda o: json.dumps(o, ensure_ascii=False))


def moe_rows(
    app: web.Application,
    out: TokensOut,
    start: Any,
    param: str,
    fail: Callable[[str, str], Exception],
) -> Any:
    """The routed experts of prompt + generation from token ``start`` on (MoE mode). Raises
    ``fail(message, param)`` for a bad ``start``."""
    if type(start) is not int or start < 0:
        raise fail(f"{param} must be a non-negative integer", param)
    moe = app[CONFIG].moe
    assert moe is not None
    return expert_rows(out.prompt + out.ids, moe, start)


def expand_images(
    app: web.Application,
    ids: list[int],
    urls: Any,
    key: str,
    fail: Callable[[str, str], Exception],
) -> list[int]:
    """A tokens-in prompt (one ``<|image_pad|>`` per image) with each image's placeholder
    expanded as vLLM's Qwen-VL processor does, for the images of ``urls`` (base64 ``data:``
    URLs, in prompt order; none: ``ids`` as they are). Raises ``fail(message, key)``: a model
    without an image processor, an image that cannot be read, another number of placeholders
    than images."""
    if not urls:
        return ids
    vision = app[CONFIG].vision
    if vision is None:
        raise fail("this model takes no image input", key)
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise fail(f"{key} must be a list of image URLs", key)
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    try:
        sizes = image_sizes([{"role": "user", "content": parts}])
        return expand_image_pads(ids, sizes, vision)
    except (ValueError, OSError) as exc:
        raise fail(f"{key}: {exc}", key) from exc


def placeholders(ids: list[int]) -> dict[str, list[dict[str, int]]] | None:
    """vLLM's ``mm_placeholders`` of an expanded prompt: each image's ``offset`` (its first
    ``<|image_pad|>``) and ``length``; None without images."""
    runs = [{"offset": start, "length": end - start} for start, end in _pad_runs(ids)]
    return {"image": runs} if runs else None


def _pad_runs(ids: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start = None
    for i, tid in enumerate([*ids, -1]):
        if tid == IMAGE_PAD_ID and start is None:
            start = i
        elif tid != IMAGE_PAD_ID and start is not None:
            out.append((start, i))
            start = None
    return out
