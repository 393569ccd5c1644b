"""The least a durable capture can do in Python on aiohttp: a second floor under the proxy's
CPU per call (``floor.py``), between the bare relay and ``capture-proxy``.

``bare_relay.py`` plus only what any capture must do per call, each the cheapest way we
know, none of what makes the proxy's data exact or its chains linked:

- the request parsed (orjson) and sent on asking the engine for token ids and log probs
  (``return_token_ids``, ``logprobs``), written again (orjson);
- the engine's answer parsed (orjson; a stream: every SSE event, as ``bare_relay.py
  --per-event`` cuts them), its prompt ids, generation ids and log probs taken as numpy
  arrays (``uint32``, ``float32``), and those fields cut from what the harness gets (the
  answer written again: orjson);
- one row per call (the rollout id from the path, the request's messages and the answer's
  message as orjson text, the three arrays' bytes) committed to SQLite (WAL,
  ``synchronous=FULL``, as the proxy's default) by one writer thread with group commit (the
  rows queued while a commit runs share the next one), the answer's end sent only after its
  row's commit returned: what "durable" means in the proxy too.

No validation, no harness notes, no digests, no linking or verification, no metrics, no access
log, no record format, no read API. So a target measured against this one is what the
proxy's own work costs; against the bare relay, what any durable capture costs.

Run: ``python benchmarks/least_capture.py --backend URL --port N --store FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import sqlite3
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bare_relay import serve  # noqa: E402

_ROW = "INSERT INTO calls VALUES (?, ?, ?, ?, ?, ?)"


class GroupWriter:
    """One writer thread: the rows queued while a commit runs share the next one. ``put``
    resolves once its row's commit returned."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS calls (call_id TEXT PRIMARY KEY, rollout_id TEXT, "
            "text BLOB, prompt_token_ids BLOB, generation_token_ids BLOB, log_probs BLOB)"
        )
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="least-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            group = [self.jobs.get()]
            while not self.jobs.empty():
                group.append(self.jobs.get_nowait())
            if group[-1] is None:
                return
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany(_ROW, [row for row, _, _ in group])
            self.db.execute("COMMIT")
            for _, loop, future in group:
                loop.call_soon_threadsafe(future.set_result, None)

    async def put(self, row: tuple[Any, ...]) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.jobs.put((row, loop, future))
        await future

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)
        self.db.close()


def _take(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """A choice's (or a stream delta's) generation ids and log probs, cut from it."""
    ids = choice.pop("token_ids", None) or []
    lps = choice.pop("logprobs", None) or {}
    choice["logprobs"] = None
    return ids, [e["logprob"] for e in lps.get("content") or ()]


def make_app(backend: str, store: str) -> web.Application:
    app = web.Application()
    state: dict[str, Any] = {}

    async def on_startup(app: web.Application) -> None:
        connector = TCPConnector(limit=0)
        state["http"] = ClientSession(connector=connector, timeout=ClientTimeout(total=600))
        state["writer"] = GroupWriter(store)

    async def on_cleanup(app: web.Application) -> None:
        await state["http"].close()
        state["writer"].close()

    async def capture(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        body["logprobs"] = body["return_token_ids"] = True
        url = backend + "/v1/chat/completions"
        headers = {"Content-Type": "application/json"}
        async with state["http"].post(url, data=orjson.dumps(body), headers=headers) as up:
            if not body.get("stream"):
                answer = orjson.loads(await up.read())
                prompt = answer.pop("prompt_token_ids", None) or []
                ids, lps = _take(answer["choices"][0])
                message = answer["choices"][0].get("message")
                out = orjson.dumps(answer)
                await _store(request, body, message, prompt, ids, lps)
                return web.Response(body=out, content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            prompt, ids, lps, text, tail = [], [], [], [], b""
            async for chunk in up.content.iter_any():
                *events, tail = (tail + chunk).split(b"\n\n")
                for event in events:
                    if event.startswith(b"data: {"):
                        data = orjson.loads(event[6:])
                        prompt = data.pop("prompt_token_ids", None) or prompt
                        for choice in data.get("choices") or ():
                            got, got_lps = _take(choice)
                            ids += got
                            lps += got_lps
                            text.append((choice.get("delta") or {}).get("content") or "")
                        event = b"data: " + orjson.dumps(data)
                    await resp.write(event + b"\n\n")
            message = {"role": "assistant", "content": "".join(text)}
            await _store(request, body, message, prompt, ids, lps)
            await resp.write_eof()
            return resp

    async def _store(request: web.Request, body: dict[str, Any], message: Any,
                     prompt: list[int], ids: list[int], lps: list[float]) -> None:  # fmt: skip
        text = orjson.dumps({"messages": body.get("messages"), "message": message})
        row = (
            os.urandom(16).hex(),
            request.match_info["rollout"],
            text,
            np.array(prompt, dtype=np.uint32).tobytes(),
            np.array(ids, dtype=np.uint32).tobytes(),
            np.array(lps, dtype=np.float32).tobytes(),
        )
        await state["writer"].put(row)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/health", health)
    path = "/ng-rollout/{rollout}/training-token-capture/v1/chat/completions"
    app.router.add_post(path, capture)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--store", required=True, help="the SQLite file")
    args = ap.parse_args()
    serve(make_app(args.backend.rstrip("/"), args.store), args.port)


if __name__ == "__main__":
    main()
