"""The read API's deadline (``rest.deadline``): which requests it bounds, the 503 of a read
that has not started its answer in time, and a started answer left alone."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from capture_proxy.proxy.errors import error_middleware
from capture_proxy.rest.deadline import (
    DEADLINE_KEY,
    bound_reads,
    is_bounded_read,
    read_deadline_middleware,
)


@pytest.mark.parametrize(
    ("method", "path", "bounded"),
    [
        ("GET", "/captures/rollouts", True),
        ("HEAD", "/captures/rollouts/r1/chains", True),
        ("GET", "/captures", True),
        ("GET", "/captures/ui/", True),
        ("POST", "/captures/rollouts/r1/freeze", False),  # a write: not a read's deadline
        ("DELETE", "/captures/rollouts/r1", False),
        ("GET", "/health", False),
        ("GET", "/capturesx", False),
        ("POST", "/v1/chat/completions", False),
    ],
)
def test_only_reads_under_captures_are_bounded(method: str, path: str, bounded: bool):
    assert is_bounded_read(make_mocked_request(method, path)) is bounded


def test_a_deadline_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        read_deadline_middleware(0)


def _app(timeout_s: float) -> tuple[web.Application, dict[str, object]]:
    app = web.Application(middlewares=[error_middleware, read_deadline_middleware(timeout_s)])
    bound_reads(app)
    seen: dict[str, object] = {}
    never = asyncio.Event()  # never set: the handler waits until its deadline ends it

    async def stuck(request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(never.wait(), 30)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise
        return web.Response(text="late")

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        seen["deadline after prepare"] = request[DEADLINE_KEY].when()
        await resp.write(b"started")
        return resp

    async def own_timeout(request: web.Request) -> web.Response:
        raise TimeoutError("not the deadline")

    async def write(request: web.Request) -> web.Response:
        seen["write deadline"] = DEADLINE_KEY in request
        return web.Response(text="ok")

    app.router.add_get("/captures/stuck", stuck)
    app.router.add_get("/captures/stream", stream)
    app.router.add_get("/captures/own", own_timeout)
    app.router.add_post("/captures/write", write)
    return app, seen


async def test_a_read_that_has_not_answered_in_time_is_a_503_with_retry_after(aiohttp_client):
    app, seen = _app(0.05)
    client = await aiohttp_client(app)
    resp = await client.get("/captures/stuck")
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "5"
    error = (await resp.json())["error"]
    assert error["code"] == "read_timeout"
    assert error["type"] == "server_error"
    assert "read_api_timeout_s" in error["message"]
    assert seen["cancelled"] is True  # the handler was cancelled where it waited


async def test_a_started_answer_has_its_deadline_lifted(aiohttp_client):
    app, seen = _app(30)
    client = await aiohttp_client(app)
    resp = await client.get("/captures/stream")
    assert resp.status == 200
    assert await resp.read() == b"started"
    assert seen["deadline after prepare"] is None  # no deadline while it streams


async def test_a_handlers_own_timeout_is_not_taken_for_the_deadline(aiohttp_client):
    app, seen = _app(30)
    client = await aiohttp_client(app)
    resp = await client.get("/captures/own")
    assert resp.status == 500  # what it was without the deadline: an unhandled error
    resp = await client.post("/captures/write")
    assert resp.status == 200
    assert seen["write deadline"] is False
