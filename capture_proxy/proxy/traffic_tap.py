"""Recording a harness's real traffic through the proxy, in the replay format.

Owns ``serve --record-dir DIR``: every request under a capture path is appended, with the
answer the proxy sent, to ``DIR/<rollout_id>.jsonl`` (``recording_name``: a rollout id too
long for a file name is cut and hashed), one JSON object per request, the format
``capture-proxy replay`` reads (and ``tests/fixtures/*/`` keep):

    seq (per file, from 1, in the order of the lines, across workers: ``append_numbered``),
    rollout_id, ts / ts_done (Unix s), method, path (as received, with the capture prefix
    and query; credential parameters' values ``%3Credacted%3E``), headers ([name, value] in
    wire order; credentials' values ``<redacted>``; both by ``core.redact.secret_name``),
    body_raw (exact text; decoded when it came compressed), body (parsed, or null when the
    proxy refused its text), classification (captured | counted | refused | forwarded |
    error), status, call_id, response_raw (the exact bytes answered)

A rollout's recording is removed when the rollout is deleted or retired
(``remove_recording``), as its stored calls are.

The answer's bytes are tapped as the proxy writes them (``ResponseTap``), so a stream is
recorded as the harness received it. Recording is for building fixtures, not for production
traffic: it keeps each answer in memory until it ends. Recording never fails a call: any
failure to record (a full disk, a value JSON cannot write) is logged, one line, never raised.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from capture_proxy.core.json_bodies import text_problem
from capture_proxy.core.redact import redact_headers, redact_query
from capture_proxy.core.routing import InvalidRolloutId, RouteKind, route

log = logging.getLogger("capture_proxy")

#: Longest file-name stem: room for ``.jsonl`` under NAME_MAX (255 bytes).
MAX_NAME_STEM = 200


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

    def start(self, request: web.Request) -> tuple[float, ResponseTap]:
        tap = ResponseTap()
        request[TAP_KEY] = tap
        return time.time(), tap

    def path_of(self, rollout_id: str) -> Path:
        return self.directory / f"{recording_name(rollout_id)}.jsonl"

    def write(
        self,
        request: web.Request,
        rollout_id: str,
        response: web.StreamResponse,
        started_at: float,
        tap: ResponseTap,
    ) -> None:
        """Append one request to its rollout's file. Never raises (logged)."""
        try:
            self._write(request, rollout_id, response, started_at, tap)
        except Exception as exc:  # recording must never fail the call it records
            log.error("recording rollout %s failed: %s: %s", rollout_id, type(exc).__name__, exc)

    def _write(
        self,
        request: web.Request,
        rollout_id: str,
        response: web.StreamResponse,
        started_at: float,
        tap: ResponseTap,
    ) -> None:
        raw_body, classification = tap.raw_body, tap.classification
        line = {
            "rollout_id": rollout_id,
            "ts": started_at,
            "ts_done": time.time(),
            "method": request.method,
            "path": redact_query(request.raw_path),
            "headers": redact_headers(raw_headers_text(request)),
            "body_raw": raw_body.decode("utf-8", "replace"),
            "body": _parsed_body(raw_body),
            "classification": classification,
            "status": response.status,
            "call_id": response.headers.get("X-Capture-Call-Id"),
            "response_raw": tap.text(response),
        }
        append_numbered(self.path_of(rollout_id), json.dumps(line, ensure_ascii=False))

    def remove(self, rollout_id: str) -> None:
        """Remove a rollout's recording (deleted or retired). Never raises (logged)."""
        try:
            self.path_of(rollout_id).unlink(missing_ok=True)
        except OSError as exc:
            log.error("removing the recording of rollout %s failed: %s", rollout_id, exc)


#: How a recorded line opens (``json.dumps`` with its default separators, ``seq`` first).
_SEQ_HEAD = re.compile(rb'\{"seq": (\d+)[,}]')


def append_numbered(path: Path, encoded: str) -> int:
    """Append ``encoded`` (``json.dumps`` of a dict without ``seq``) to ``path`` as one line
    that opens with ``"seq": N``; returns N.

    N is one more than the ``seq`` of the file's last line, read and appended under an
    exclusive ``flock`` of the file: every process and thread appending to it (each of
    ``serve --workers N``'s workers has its own recorder) takes its turn, so ``seq`` follows
    the order of the lines in the file, from 1, with no number twice. A last line that does
    not open with a ``seq`` (a file not written here) makes N one more than the count of
    non-blank lines (what ``seq`` was before). A last line cut short (a crash mid-write) is
    ended first, so the new line stays whole. Raises OSError."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
        size = os.fstat(fd).st_size
        seq = _last_seq(fd, size) + 1
        rest = encoded[1:]
        head = f'{{"seq": {seq}' + (", " if rest != "}" else "")
        data = (head + rest + "\n").encode("utf-8")
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        return seq
    finally:
        os.close(fd)


def _last_seq(fd: int, size: int) -> int:
    """The ``seq`` of the last line of the file open as ``fd`` (``size`` bytes), 0 when empty.
    Reads back from the end only as far as the last line's start."""
    if size == 0:
        return 0
    end = size - 1 if os.pread(fd, 1, size - 1) == b"\n" else size
    line_start, pos = 0, end
    while pos > 0:
        start = max(0, pos - 65536)
        newline = os.pread(fd, pos - start, start).rfind(b"\n")
        if newline >= 0:
            line_start = start + newline + 1
            break
        pos = start
    found = _SEQ_HEAD.match(os.pread(fd, 32, line_start))
    if found is not None:
        return int(found[1])
    return _non_blank_lines(fd)


def _non_blank_lines(fd: int) -> int:
    with open(os.dup(fd), "rb") as fh:
        fh.seek(0)
        return sum(1 for line in fh if line.strip())


RECORDING_KEY = web.AppKey("traffic_recorder", TrafficRecorder)


def remove_recording(app: web.Application, rollout_id: str) -> None:
    """Remove ``rollout_id``'s recording when the app records traffic (``--record-dir``)."""
    recorder = app.get(RECORDING_KEY)
    if recorder is not None:
        recorder.remove(rollout_id)


def recording_name(rollout_id: str) -> str:
    """The file-name stem of a rollout's recording: the rollout id (already validated: only
    letters, digits, ``.``, ``_``, ``-``); one longer than ``MAX_NAME_STEM`` is cut to 64
    characters plus 16 hex digits of its SHA-256, so every valid id has a file."""
    if len(rollout_id) <= MAX_NAME_STEM:
        return rollout_id
    digest = hashlib.sha256(rollout_id.encode()).hexdigest()[:16]
    return f"{rollout_id[:64]}-{digest}"


def _parsed_body(raw_body: bytes) -> Any:
    """The body as JSON, or None when it is not JSON or holds what the proxy refuses (a lone
    surrogate, nesting too deep: ``text_problem``); ``body_raw`` keeps its text either way."""
    if not raw_body:
        return None
    try:
        body = json.loads(raw_body)
    except (ValueError, RecursionError):
        return None
    return None if text_problem(body) is not None else body


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
        await asyncio.to_thread(
            recorder.write, request, target.rollout_id, response, started_at, tap
        )
        return response

    return record


def raw_headers_text(request: web.Request) -> list[tuple[str, str]]:
    """The request's headers as received: names as sent, wire order (aiohttp's raw
    headers are bytes pairs)."""
    return [
        (name.decode("latin-1"), value.decode("latin-1")) for name, value in request.raw_headers
    ]
