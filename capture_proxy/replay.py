"""Replay recorded harness traffic through the proxy.

Owns reading a recording (one JSON object per request, as in tests/fixtures/opencode/logs:
``seq``, ``headers``, ``body``, ``response_raw`` = the SSE the recording's server sent) and
sending its requests, in ``seq`` order, to a proxy's capture path. ``RecordedResponder`` lets
the scripted engine answer each request with the assistant message the recording answered, so
a replay reproduces the harness's real request shapes (step-limit notes, reasoning echo,
re-serialised tool-call arguments) with real token ids.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from capture_proxy.core.assembly import CallContext, ChatCaptureAssembler
from capture_proxy.core.sse import SSEStreamDecoder

#: Recorded headers worth replaying (identity of the harness and its session); transport
#: headers (Content-Length, Host, Accept-Encoding, Connection) are the client's own business.
REPLAYED_HEADERS = frozenset(
    {"authorization", "user-agent", "x-session-affinity", "x-session-id", "x-parent-session-id"}
)


@dataclass(frozen=True)
class RecordedRequest:
    seq: int
    classification: str
    headers: list[tuple[str, str]]
    body: dict[str, Any]
    response_message: dict[str, Any]


def message_from_sse(raw: str) -> dict[str, Any]:
    """The assistant message a recorded SSE answer spells (content, reasoning, tool calls)."""
    decoder = SSEStreamDecoder()
    ctx = CallContext("replay", "replay", 0.0, True, "/v1/chat/completions", {})
    assembler = ChatCaptureAssembler(ctx)
    for event in [*decoder.feed(raw.encode("utf-8")), *decoder.close()]:
        if event.data != "[DONE]":
            assembler.add_chunk(json.loads(event.data))
    message = assembler.assembled_message()
    message.setdefault("tool_calls", [])
    return message


def load_recording(path: Path) -> list[RecordedRequest]:
    """Read a recording, sorted by ``seq``. Raises OSError, ValueError (bad JSON lines)."""
    out = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.append(
                RecordedRequest(
                    seq=int(obj["seq"]),
                    classification=str(obj.get("classification", "")),
                    headers=[(str(k), str(v)) for k, v in obj.get("headers", [])],
                    body=obj["body"],
                    response_message=message_from_sse(obj["response_raw"]),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{line_no}: not a recorded request: {exc}") from exc
    return sorted(out, key=lambda r: r.seq)


class RecordedResponder:
    """Answers the n-th chat request with the n-th recorded message (thread-safe).

    For ``ScriptedEngineConfig(responder=...)``: replays must send requests one at a time, in
    recording order, so that the n-th request the engine sees is the n-th recorded one.
    Raises IndexError when more requests arrive than were recorded.
    """

    def __init__(self, recording: list[RecordedRequest]) -> None:
        self._messages = [r.response_message for r in recording]
        self._next = 0
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            message = self._messages[self._next]
            self._next += 1
        return message


@dataclass(frozen=True)
class ReplayedCall:
    seq: int
    classification: str
    status: int
    call_id: str | None


def _substitute_ids(body: dict[str, Any], id_map: dict[str, str]) -> dict[str, Any]:
    """The recorded body with recorded tool-call ids replaced by the ids the proxy returned."""
    if not id_map:
        return body
    messages = []
    for m in body.get("messages") or []:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**tc, "id": id_map.get(tc.get("id"), tc.get("id"))} for tc in m["tool_calls"]
            ]
        if m.get("tool_call_id") in id_map:
            m["tool_call_id"] = id_map[m["tool_call_id"]]
        messages.append(m)
    return {**body, "messages": messages}


def _answer_message(raw: bytes, content_type: str) -> dict[str, Any] | None:
    try:
        if content_type.startswith("text/event-stream"):
            return message_from_sse(raw.decode("utf-8"))
        choices = json.loads(raw).get("choices") or []
        return choices[0].get("message") if choices else None
    except (ValueError, AttributeError, IndexError):
        return None


async def replay(
    recording: list[RecordedRequest], base_url: str, *, timeout_s: float = 120.0
) -> list[ReplayedCall]:
    """Send each recorded request to ``base_url + /chat/completions`` in order, reading each
    answer to its end before the next. ``base_url`` is a harness base URL, e.g.
    ``http://127.0.0.1:8080/ng-rollout/<id>/training-token-capture/v1``.

    Like a harness, later requests echo the tool-call ids the proxy actually returned (the
    recorded ids are replaced), so a proxy that generates its own ids (exact-token mode) sees
    the history it would see from the real harness.
    """
    out = []
    id_map: dict[str, str] = {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for req in recording:
            headers = {k: v for k, v in req.headers if k.lower() in REPLAYED_HEADERS}
            body = _substitute_ids(req.body, id_map)
            async with http.post(
                base_url + "/chat/completions", json=body, headers=headers
            ) as resp:
                raw = await resp.read()
                answer = _answer_message(raw, resp.headers.get("Content-Type", ""))
                out.append(
                    ReplayedCall(
                        req.seq,
                        req.classification,
                        resp.status,
                        resp.headers.get("X-Capture-Call-Id"),
                    )
                )
            recorded_calls = req.response_message.get("tool_calls") or []
            answered_calls = (answer or {}).get("tool_calls") or []
            for rec_call, got in zip(recorded_calls, answered_calls, strict=False):
                if rec_call.get("id") and got.get("id"):
                    id_map[rec_call["id"]] = got["id"]
    return out
