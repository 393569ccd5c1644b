"""Tier 2: ``capture_proxy.readers`` against a proxy whose read API needs a token (the
container's default)."""

from __future__ import annotations

import asyncio
import urllib.error

import pytest
from aiohttp import web

from capture_proxy import readers
from capture_proxy.readers import fetch_chains
from tests.proxy.conftest import MakeStack
from tests.proxy.test_capture import USER, _body


async def test_the_reader_sends_the_read_api_token(make_stack: MakeStack, monkeypatch):
    monkeypatch.delenv("CAPTURE_PROXY_CAPTURES_TOKEN", raising=False)
    stack = await make_stack(captures_token="s3cret")
    await stack.chat("read", _body(USER))
    base = str(stack.client.make_url("/")).rstrip("/")
    samples = await asyncio.to_thread(fetch_chains, base, "read", token="s3cret")
    assert len(samples) == 1
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(fetch_chains, base, "read")
    assert refused.value.code == 401
    refused.value.close()
    monkeypatch.setenv("CAPTURE_PROXY_CAPTURES_TOKEN", "s3cret")
    assert len(await asyncio.to_thread(fetch_chains, base, "read")) == 1


async def test_the_reader_waits_out_a_busy_proxys_503_as_its_retry_after_says(
    make_stack: MakeStack, aiohttp_server, monkeypatch
):
    """A read the proxy could not start in time (``503 read_timeout``, ``Retry-After``) is
    asked again after the wait, up to ``READ_RETRIES`` times; a 503 naming no wait is not."""
    stack = await make_stack()
    await stack.chat("busy", _body(USER))
    archive = await (await stack.client.get("/captures/rollouts/busy/chains?format=npz")).read()
    answers: list[web.Response] = []
    seen: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.path_qs)
        return answers.pop(0) if answers else web.Response(body=archive)

    server = await aiohttp_server(_app(handler))
    base = str(server.make_url("/")).rstrip("/")

    def busy(retry_after: str | None = "0") -> web.Response:
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        return web.json_response({"error": {"code": "read_timeout"}}, status=503, headers=headers)

    answers[:] = [busy(), busy()]
    chains = await asyncio.to_thread(fetch_chains, base, "busy")
    assert (len(chains), len(seen)) == (1, 3)
    (chain,) = (await (await stack.client.get("/captures/rollouts/busy/chains")).json())["chains"]
    (call,) = chain["calls"]
    expected = call["prompt_token_ids"] + call["generation_token_ids"]
    assert chains[0].arrays["input_ids"].tolist() == expected

    monkeypatch.setattr(readers, "READ_RETRIES", 1)
    seen.clear()
    answers[:] = [busy(), busy(), busy()]
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(fetch_chains, base, "busy")
    assert (refused.value.code, len(seen)) == (503, 2)
    refused.value.close()

    seen.clear()
    answers[:] = [busy(None)]  # no wait named: not retried
    with pytest.raises(urllib.error.HTTPError):
        await asyncio.to_thread(fetch_chains, base, "busy")
    assert len(seen) == 1


def _app(handler) -> web.Application:
    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    return app
