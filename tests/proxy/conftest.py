"""Tier 2 fixtures: the proxy on a loopback port in front of the scripted engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.proxy.server import ProxyRunner
from capture_proxy.scripted_engine.app import build_scripted_engine_app
from capture_proxy.scripted_engine.state import SENT_CALLS, ScriptedEngineConfig, SentCall
from capture_proxy.store.base import CaptureStore
from capture_proxy.store.postgres import PostgresStore
from capture_proxy.store.sqlite import SQLiteStore

CAPTURE = "/ng-rollout/{rollout}/training-token-capture/v1/chat/completions"


class ProxyTestServer(TestServer):
    """``TestServer`` on the proxy's own runner (``proxy.server.ProxyRunner``), as ``serve``
    runs it: what aiohttp's parser refuses is answered in the proxy's JSON shape.
    ``cancel_handlers``: the test server's way, a handler is cancelled when its client leaves;
    False: ``serve``'s (aiohttp's default), it runs on and must find out by itself."""

    def __init__(self, app: web.Application, *, cancel_handlers: bool = True, **kwargs: Any):
        super().__init__(app, **kwargs)
        self.cancel_handlers = cancel_handlers

    async def _make_runner(self, **kwargs: Any) -> ProxyRunner:
        kwargs["handler_cancellation"] = self.cancel_handlers
        return ProxyRunner(self.app, **kwargs)


@dataclass
class Stack:
    """A scripted engine and the proxy in front of it; ``client`` talks to the proxy."""

    engine: TestServer
    engine_app: web.Application
    client: TestClient
    store_dir: Path

    @property
    def sent(self) -> list[SentCall]:
        return self.engine_app[SENT_CALLS]

    async def chat(self, rollout: str, body: dict[str, Any], **kwargs: Any) -> Any:
        return await self.client.post(CAPTURE.format(rollout=rollout), json=body, **kwargs)

    async def get_json(self, path: str, status: int = 200) -> Any:
        resp = await self.client.get(path)
        assert resp.status == status, await resp.text()
        return await resp.json()


MakeStack = Callable[..., Awaitable[Stack]]


@pytest.fixture
def stack_store_kind() -> str:
    """The store behind ``make_stack``'s proxies: ``sqlite`` (here) or ``postgres``; a test
    runs on both with ``@ON_BOTH_STORES``."""
    return "sqlite"


STACK_STORE_KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
#: Runs a test that takes ``stack`` or ``make_stack`` on SQLite and on PostgreSQL.
ON_BOTH_STORES = pytest.mark.parametrize("stack_store_kind", STACK_STORE_KINDS)


@pytest.fixture
async def make_stack(
    aiohttp_server, aiohttp_client, qwen_tokenizer, tmp_path, stack_store_kind, request
) -> MakeStack:
    """``await make_stack(...)``: a scripted engine and a proxy in front of it. Each call is a
    new proxy on the same store (a restart): the store directory, or for ``postgres`` one
    database of the session's server per test. With the embedded store the proxy made before
    is stopped first (one proxy per store directory: the store's writer lock); pass
    ``store_dir`` for a proxy of its own beside it. ``cancel_handlers=False``: the proxy's
    handlers are not cancelled when a client leaves, as under ``serve``."""
    pg_url = None
    if stack_store_kind == "postgres":
        pg_url = request.getfixturevalue("postgres_server").create_database()

    running: dict[Path, TestClient] = {}

    async def make(
        *,
        engine_config: ScriptedEngineConfig | None = None,
        store: CaptureStore | None = None,
        renderer: Any = None,
        store_dir: Path | None = None,
        cancel_handlers: bool = True,
        **settings: Any,
    ) -> Stack:
        engine_app = build_scripted_engine_app(
            engine_config or ScriptedEngineConfig(), qwen_tokenizer
        )
        engine = await aiohttp_server(engine_app)
        store_dir = store_dir or tmp_path / "store"
        if store is None and pg_url is None and store_dir in running:
            await running.pop(store_dir).close()  # a restart: the old proxy stops first
        cfg = Settings(backend=str(engine.make_url("/")).rstrip("/"), store=store_dir, **settings)
        if store is None:
            store = SQLiteStore(store_dir) if pg_url is None else PostgresStore(pg_url, pool_size=4)
        proxy_app = build_proxy_app(cfg, store, renderer=renderer)
        # The production runner (protocol errors as JSON) with the settings' server knobs.
        server = ProxyTestServer(proxy_app, cancel_handlers=cancel_handlers, **cfg.server_kwargs)
        client = await aiohttp_client(server)
        if pg_url is None:
            running[store_dir] = client
        return Stack(engine, engine_app, client, store_dir)

    return make


@pytest.fixture
async def stack(make_stack: MakeStack) -> Stack:
    return await make_stack()
