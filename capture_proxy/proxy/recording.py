"""Recording a harness's real traffic through the proxy, in the replay format.

Owns ``serve --record-dir DIR``: every request under a capture path is appended, with the
answer the proxy sent, to ``DIR/<rollout_id>.jsonl``, one JSON object per request, the format
``capture-proxy replay`` reads (and ``tests/fixtures/*/`` keep):

    seq (per file, from 1), ts / ts_done (Unix s), method, path (as received, with the
    capture prefix and query), headers ([name, value] in wire order; credentials redacted),
    body_raw (exact text), body (parsed, or null), classification (captured | counted |
    refused | forwarded | error), status, call_id, response_raw (the exact bytes answered)

The answer's bytes are tapped as the proxy writes them (``ResponseTap``), so a stream is
recorded as the harness received it. Recording is for building fixtures, not for production
traffic: it keeps each answer in memory until it ends. A failing write is logged, never
raised.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from capture_proxy.core.routing import InvalidRolloutId, RouteKind, route

log = logging.getLogger("capture_proxy")

#: Header values never written to a recording.
REDACTED_HEADERS = frozenset({"authorization", "x-api-key", "proxy-authorization", "cookie"})
REDACTED = "<redacted>"


class ResponseTap:
    """One recorded request's slot: the bytes of its answer as written (see
    ``calls.ClientWriter``), and what the handler says of it (``raw_body``, ``classification``:
    absent when it ended in an error). One mutable object, because aiohttp's ``clone`` (the
    auth middleware's) copies a request's state: keys set on a clone are not seen outside."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.raw_body = b""
        self.classification = "error"

    def add(self, data: bytes) -> None:
        self.chunks.append(data)

    def text(self, response: web.StreamResponse) -> str:
        raw = b"".join(self.chunks)
        if not raw and isinstance(response, web.Response) and response.body is not None:
            body = response.body
            raw = body if isinstance(body, bytes) else bytes(body)  # type: ignore[arg-type]
        return raw.decode("utf-8", "replace")


TAP_KEY = web.RequestKey("response_tap", ResponseTap)


def note_request(request: web.Request, raw_body: bytes, classification: str | None) -> None:
    """Tell the recorder (when recording) the body the handler read and what it did with the
    request. (The middleware cannot read the body first: the auth middleware clones the
    request, which aiohttp refuses once the body is read.)"""
    tap = request.get(TAP_KEY)
    if tap is not None:
        tap.raw_body = raw_body
        if classification is not None:
            tap.classification = classification


class TrafficRecorder:
    """Appends recorded requests to one JSONL file per rollout under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()

    def start(self, request: web.Request) -> tuple[float, ResponseTap]:
        tap = ResponseTap()
        request[TAP_KEY] = tap
        return time.time(), tap

    def write(
        self,
        request: web.Request,
        rollout_id: str,
        response: web.StreamResponse,
        started_at: float,
        tap: ResponseTap,
    ) -> None:
        raw_body, classification = tap.raw_body, tap.classification
        try:
            body: Any = json.loads(raw_body) if raw_body else None
        except ValueError:
            body = None
        headers = [
            [name, REDACTED if name.lower() in REDACTED_HEADERS else value]
            for name, value in raw_headers_text(request)
        ]
        with self._lock:
            seq = self._seq.get(rollout_id)
            if seq is None:
                seq = _lines_in(self.directory / f"{rollout_id}.jsonl")
            seq += 1
            self._seq[rollout_id] = seq
            line = {
                "seq": seq,
                "ts": started_at,
                "ts_done": time.time(),
                "method": request.method,
                "path": request.raw_path,
                "headers": headers,
                "body_raw": raw_body.decode("utf-8", "replace"),
                "body": body,
                "classification": classification,
                "status": response.status,
                "call_id": response.headers.get("X-Capture-Call-Id"),
                "response_raw": tap.text(response),
            }
            try:
                with open(self.directory / f"{rollout_id}.jsonl", "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(line, ensure_ascii=False) + "\n")
            except OSError as exc:
                log.error("recording rollout %s failed: %s", rollout_id, exc)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def recording_middleware(recorder: TrafficRecorder) -> Any:
    """The outermost middleware when recording: every request under a capture path, with the
    answer it got (errors included), goes to its rollout's file."""

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            target = route(request.raw_path.split("?", 1)[0])
        except InvalidRolloutId:
            return await handler(request)
        if target.kind is not RouteKind.CAPTURE or target.rollout_id is None:
            return await handler(request)
        started_at, tap = recorder.start(request)
        response = await handler(request)
        recorder.write(request, target.rollout_id, response, started_at, tap)
        return response

    return record


def _lines_in(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as fh:
            return sum(1 for line in fh if line.strip())
    except FileNotFoundError:
        return 0


def raw_headers_text(request: web.Request) -> list[tuple[str, str]]:
    """The request's headers as received: names as sent, wire order (aiohttp's raw
    headers are bytes pairs)."""
    return [
        (name.decode("latin-1"), value.decode("latin-1")) for name, value in request.raw_headers
    ]
