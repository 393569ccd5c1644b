"""Token text for the viewer: a local tokenizer, the engine's ``/detokenize``, or nothing.

In backend-template mode the proxy holds no tokenizer, so the viewer asks the engine, one token
per request (vLLM's ``/detokenize`` takes a list and answers one string, which would lose the
token boundaries), many at once, and caches each id's text for the process (a vocabulary is
bounded). A local tokenizer (the ``tokenizer`` setting) is used when set. When neither answers,
tokens show as ids. Never raises: a failed look-up leaves that id without text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import aiohttp

log = logging.getLogger("capture_proxy.viewer")

#: Concurrent ``/detokenize`` requests per page.
ENGINE_CONCURRENCY = 16
ENGINE_TIMEOUT_S = 10.0


class Detokenizer(Protocol):
    #: what the page says the text comes from
    source: str

    async def texts(self, ids: Iterable[int]) -> dict[int, str] | None:
        """id -> text for as many of ``ids`` as can be decoded; None: no text at all."""


class NoDetokenizer:
    source = "token ids (no tokenizer, no engine)"

    async def texts(self, ids: Iterable[int]) -> dict[int, str] | None:
        return None


class LocalDetokenizer:
    """A local HF tokenizer directory, loaded on the first page that asks for token text (in a
    worker thread, once however many pages ask at once): loading takes a second or more and
    some 100 MB, a second copy beside the exact-token renderer's, which a proxy whose viewer
    is never opened need not pay at start-up. A directory that cannot be loaded is logged
    once and its pages show ids. Decoding runs on the caller's thread pool."""

    source = "local tokenizer"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tokenizer: Any = None
        self._failed = False
        self._loading = asyncio.Lock()
        self._cache: dict[int, str] = {}

    @staticmethod
    def _load(path: Path) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))

    async def tokenizer(self) -> Any | None:
        """The tokenizer, loaded on the first call; None when it cannot be loaded."""
        async with self._loading:
            if self._tokenizer is None and not self._failed:
                try:
                    self._tokenizer = await asyncio.to_thread(self._load, self.path)
                except Exception as exc:  # any loader error: the pages show ids instead
                    self._failed = True
                    log.warning("viewer: cannot load the tokenizer at %s: %s", self.path, exc)
        return self._tokenizer

    def _decode(self, tokenizer: Any, ids: list[int]) -> dict[int, str]:
        for i in ids:
            if i not in self._cache:
                self._cache[i] = tokenizer.decode([i])
        return {i: self._cache[i] for i in ids}

    async def texts(self, ids: Iterable[int]) -> dict[int, str] | None:
        tokenizer = await self.tokenizer()
        if tokenizer is None:
            return None
        return await asyncio.to_thread(self._decode, tokenizer, sorted(set(ids)))


class EngineDetokenizer:
    """The engine's ``POST /detokenize`` (``{"tokens": [id]}`` -> ``{"prompt": text}``)."""

    source = "engine /detokenize"

    def __init__(self, session: aiohttp.ClientSession, backend: str) -> None:
        self._session = session
        self._url = backend.rstrip("/") + "/detokenize"
        self._cache: dict[int, str] = {}

    async def _one(self, token_id: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            try:
                async with self._session.post(self._url, json={"tokens": [token_id]}) as resp:
                    if resp.status != 200:
                        return
                    data = await resp.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return
        text = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(text, str):
            self._cache[token_id] = text

    async def texts(self, ids: Iterable[int]) -> dict[int, str] | None:
        wanted = sorted(set(ids))
        missing = [i for i in wanted if i not in self._cache]
        if missing:
            gate = asyncio.Semaphore(ENGINE_CONCURRENCY)
            await asyncio.gather(*(self._one(i, gate) for i in missing))
            if any(i not in self._cache for i in missing):
                log.warning(
                    "detokenize: %d of %d token(s) without text from the engine",
                    sum(1 for i in missing if i not in self._cache),
                    len(missing),
                )
        out = {i: self._cache[i] for i in wanted if i in self._cache}
        return out or None
