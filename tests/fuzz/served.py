"""The fuzz tier's target: a real proxy on a loopback port in front of the scripted engine,
run on its own event loop in a thread, and a raw HTTP/1.1 client that can send what no
well-behaved client would (any bytes in the path, the headers and the body).

``ServedProxy`` is started once per module (``start``/``stop``); ``send`` answers one request
on a fresh connection, bounded by ``timeout_s`` (a hang is a failure, never a wait).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.proxy.server import ProxyRunner
from capture_proxy.scripted_engine.app import ScriptedEngineConfig, build_scripted_engine_app
from capture_proxy.store.sqlite import SQLiteStore

#: The longest any one request may take (the proxy's own body timeout is shorter).
REQUEST_TIMEOUT_S = 15.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class ServedProxy:
    """The scripted engine and the proxy, each on a loopback port, on one loop in a thread."""

    def __init__(self, store_dir: Path, tokenizer: Any, **settings: Any) -> None:
        self.store_dir = store_dir
        self.tokenizer = tokenizer
        self.settings = settings
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runners: list[web.AppRunner] = []

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=60)

    async def _start(self) -> None:
        engine = web.AppRunner(
            build_scripted_engine_app(ScriptedEngineConfig(), self.tokenizer), access_log=None
        )
        await engine.setup()
        engine_sock = _listening_socket()
        await web.SockSite(engine, engine_sock).start()
        self._runners.append(engine)
        settings = Settings(
            backend=f"http://127.0.0.1:{engine_sock.getsockname()[1]}",
            store=self.store_dir,
            client_body_timeout_s=2.0,
            upstream_connect_retries=0,
            **self.settings,
        )
        app = build_proxy_app(settings, SQLiteStore(self.store_dir))
        proxy = ProxyRunner(app, access_log=None, **settings.server_kwargs)
        await proxy.setup()
        sock = _listening_socket()
        await web.SockSite(proxy, sock).start()
        self._runners.append(proxy)
        self.port = sock.getsockname()[1]

    def stop(self) -> None:
        async def cleanup() -> None:
            for runner in reversed(self._runners):
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def send(
        self,
        method: str,
        target: bytes | str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
        *,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> Answer:
        """One request, byte for byte (``Content-Length`` added for a body unless given);
        the whole answer read (a stream to its end). Raises TimeoutError past ``timeout_s``."""
        raw_target = target.encode("latin-1") if isinstance(target, str) else target
        lines = [method.encode() + b" " + raw_target + b" HTTP/1.1"]
        names = {name.lower() for name, _ in headers or []}
        if "host" not in names:
            lines.append(b"Host: 127.0.0.1")
        for name, value in headers or []:
            lines.append(name.encode("latin-1") + b": " + value.encode("latin-1"))
        if body and "content-length" not in names and "transfer-encoding" not in names:
            lines.append(b"Content-Length: " + str(len(body)).encode())
        lines.append(b"Connection: close")
        request = b"\r\n".join(lines) + b"\r\n\r\n" + body
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as sock:
            sock.sendall(request)
            response = http.client.HTTPResponse(sock)
            try:
                response.begin()
                data = response.read()
            except TimeoutError as exc:
                raise TimeoutError(f"no answer within {timeout_s} s") from exc
            return Answer(
                response.status, {k.lower(): v for k, v in response.getheaders()}, data
            )
