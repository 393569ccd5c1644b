"""Tier 4 fixtures: the proxy (in-process, loopback port) in front of a real vLLM server.

The server is started by ``scripts/e2e-vllm``, which sets ``CAPTURE_PROXY_VLLM_URL`` (and
``CAPTURE_PROXY_VLLM_MODEL``); without it every test here is skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestClient

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.store.sqlite import SQLiteStore

VLLM_URL = os.environ.get("CAPTURE_PROXY_VLLM_URL", "").rstrip("/")
VLLM_MODEL = os.environ.get("CAPTURE_PROXY_VLLM_MODEL", "qwen3-moe")
CAPTURE = "/ng-rollout/{rollout}/training-token-capture/v1/chat/completions"
IM_END = 151645
REGEX_SPECIAL = set(".^$*+?()[]{}|\\/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    skip = pytest.mark.skip(
        reason="no real vLLM server: run scripts/e2e-vllm (sets CAPTURE_PROXY_VLLM_URL)"
    )
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.realengine)
            if not VLLM_URL:
                item.add_marker(skip)


@dataclass
class RealStack:
    """The proxy in front of vLLM. ``engine`` calls vLLM directly (sync, for reference data)."""

    client: TestClient
    engine: httpx.Client
    model: str

    async def chat(self, rollout: str, body: dict[str, Any]) -> Any:
        return await self.client.post(CAPTURE.format(rollout=rollout), json=body)

    async def get_json(self, path: str) -> Any:
        resp = await self.client.get(path)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if tools:
            body["tools"] = tools
        resp = self.engine.post("/tokenize", json={**body, "add_generation_prompt": True})
        resp.raise_for_status()
        return resp.json()["tokens"]

    def tokenize_text(self, text: str) -> list[int]:
        resp = self.engine.post(
            "/tokenize", json={"model": self.model, "prompt": text, "add_special_tokens": False}
        )
        resp.raise_for_status()
        return resp.json()["tokens"]

    def forced(self, text: str) -> tuple[list[int], dict[str, Any]]:
        """Request fields that make the random model write exactly ``text`` in its canonical
        tokens: a ``structured_outputs`` regex (only that text, then the stop token) and a
        +100 logit bias on the text's canonical ids (so among the byte-wise allowed tokens the
        grammar leaves, the canonical one wins). Returns (canonical ids, fields)."""
        ids = self.tokenize_text(text)
        regex = "".join(
            "\\n" if ch == "\n" else "\\" + ch if ch in REGEX_SPECIAL else ch for ch in text
        )
        return ids, {
            "structured_outputs": {"regex": regex},
            "logit_bias": {str(i): 100 for i in sorted(set(ids))},
            "temperature": 0,
        }


async def _stack(aiohttp_client, tmp_path, **settings: Any):
    store_dir = tmp_path / "store"
    cfg = Settings(backend=VLLM_URL, store=store_dir, **settings)
    client = await aiohttp_client(build_proxy_app(cfg, SQLiteStore(store_dir)))
    # An idle connection is dropped after 1 s, well before vLLM's (uvicorn's 5 s keep-alive):
    # httpx's default expiry is also 5 s, and a request sent on a connection the engine was
    # closing that instant fails with "Server disconnected without sending a response" (the
    # proxy's own upstream session does the same, ``upstream_keepalive_timeout_s``).
    limits = httpx.Limits(keepalive_expiry=1.0)
    with httpx.Client(base_url=VLLM_URL, timeout=120, limits=limits) as engine:
        yield RealStack(client, engine, VLLM_MODEL)


@pytest.fixture
async def real(aiohttp_client, tmp_path) -> RealStack:
    """The proxy in backend-template mode (vLLM renders the chat template)."""
    async for stack in _stack(aiohttp_client, tmp_path):
        yield stack


@pytest.fixture
async def real_exact(aiohttp_client, tmp_path) -> RealStack:
    """The proxy in exact-token mode: prompts from the parent's own tokens, sent to vLLM's
    /v1/completions as token ids; new messages rendered with vLLM's /tokenize."""
    async for stack in _stack(aiohttp_client, tmp_path, prompt_mode="exact_tokens"):
        yield stack
