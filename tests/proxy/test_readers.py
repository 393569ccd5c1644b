"""Tier 2: ``capture_proxy.readers`` against a proxy whose read API needs a token (the
container's default)."""

from __future__ import annotations

import asyncio
import urllib.error

import pytest

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
