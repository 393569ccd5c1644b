"""Replay recorded harness traffic through the proxy.

Owns reading a recording (one JSON object per request, as in tests/fixtures/*/ and as
``serve --record-dir`` writes: ``seq``, ``path``, ``headers``, ``body``, ``response_raw`` = what
the recording's server answered) and sending its model calls, in ``seq`` order, to a proxy's
capture path, each to its own API's endpoint (chat completions, Responses, Messages; other
recorded requests such as count_tokens are skipped). ``RecordedResponder`` lets
the scripted engine answer each request with the assistant message the recording answered
(``replay_engine_config``: that engine, serving the model names the recording names), so
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

from capture_proxy.core.fronts.answers import API_PATHS, answer_message, api_of_path
from capture_proxy.core.fronts.base import Api
from capture_proxy.core.json_bodies import json_kind
from capture_proxy.scripted_engine.state import ScriptedEngineConfig

#: Recorded headers worth replaying (identity of the harness and its session); transport
#: headers (Content-Length, Host, Accept-Encoding, Connection) are the client's own business.
REPLAYED_HEADERS = frozenset(
    {
        "authorization",
        "user-agent",
        "x-session-affinity",
        "x-session-id",
        "x-parent-session-id",
        "anthropic-version",
        "anthropic-beta",
        "session_id",
        "originator",
        # a harness's own retry signal: a replayed retry is a retry again
        "x-stainless-retry-count",
    }
)


@dataclass(frozen=True)
class RecordedRequest:
    """One recorded model call: its API, the query string it was sent with (Claude Code's
    ``?beta=true``), and the canonical assistant message the recorded server answered."""

    seq: int
    classification: str
    headers: list[tuple[str, str]]
    body: dict[str, Any]
    response_message: dict[str, Any]
    api: Api = Api.CHAT_COMPLETIONS
    query: str = ""


def _looks_like_sse(raw: str) -> bool:
    head = raw.lstrip()[:6]
    return head.startswith(("data:", "event:", ":"))


def message_from_answer(api: Api, raw: str) -> dict[str, Any]:
    """The assistant message a recorded answer (SSE or whole JSON) spells."""
    content_type = "text/event-stream" if _looks_like_sse(raw) else "application/json"
    message = dict(answer_message(api, raw.encode("utf-8"), content_type))
    message.setdefault("tool_calls", [])
    return message


def message_from_sse(raw: str) -> dict[str, Any]:
    """The assistant message a recorded chat-completions SSE answer spells."""
    return message_from_answer(Api.CHAT_COMPLETIONS, raw)


def load_recording(path: Path) -> list[RecordedRequest]:
    """Read a recording's model calls, sorted by ``seq`` (requests to other paths, e.g.
    count_tokens or model listings, and requests the server refused are left out). Raises
    OSError, ValueError (a line that is not JSON, not an object, or lacks a field, named by
    its number)."""
    out = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"{json_kind(obj)}, not a JSON object")
            recorded_path = str(obj.get("path") or "/v1/chat/completions")
            api = api_of_path(recorded_path)
            if api is None or int(obj.get("status") or 200) >= 400:
                continue
            if not isinstance(obj["body"], dict):
                raise ValueError(f"body is {json_kind(obj['body'])}, not a JSON object")
            out.append(
                RecordedRequest(
                    seq=int(obj["seq"]),
                    classification=str(obj.get("classification", "")),
                    headers=[(str(k), str(v)) for k, v in obj.get("headers", [])],
                    body=obj["body"],
                    response_message=message_from_answer(api, obj["response_raw"]),
                    api=api,
                    query=recorded_path.partition("?")[2],
                )
            )
        # Any shape the fields do not have (a response_raw that is not a string, an answer
        # without choices) is this line's fault, not the replay's.
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValueError(f"{path}:{line_no}: not a recorded request: {exc}") from exc
    return sorted(out, key=lambda r: r.seq)


def recorded_models(recording: list[RecordedRequest]) -> tuple[str, ...]:
    """The model names the recorded requests name, in the order first named (the names the
    recording's server served)."""
    names = (r.body.get("model") for r in recording)
    return tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n))


def replay_engine_config(recording: list[RecordedRequest], **options: Any) -> ScriptedEngineConfig:
    """The scripted engine's ``ScriptedEngineConfig`` that answers ``recording`` as its server
    did: each request with the recorded message (``RecordedResponder``), under the model names
    the recording's requests name (the engine refuses others, as vLLM does); ``options``: the
    config's other fields."""
    names = recorded_models(recording)
    if names:
        options = {"model_name": names[0], "model_aliases": names[1:], **options}
    return ScriptedEngineConfig(responder=RecordedResponder(recording), **options)


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
    """One replayed request's answer: its status, the proxy's call id, and for an error
    answer what it said (``error_summary``)."""

    seq: int
    classification: str
    status: int
    call_id: str | None
    error: str | None = None


def error_summary(raw: bytes) -> str:
    """What an error answer says, in one line: ``<code>: <message>`` of an ``{"error": {...}}``
    body (OpenAI's shape, or Anthropic's, whose ``error`` has a ``type``), else the body's
    first 200 characters."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        code = error.get("code") or error.get("type")
        message = " ".join(error["message"].split())
        return f"{code}: {message}" if isinstance(code, str) else message
    text = raw.decode("utf-8", errors="replace").strip()
    return " ".join(text.split())[:200] or "(empty body)"


#: Keys whose string values are tool-call ids in the three APIs' bodies.
_ID_KEYS = frozenset({"id", "tool_call_id", "call_id", "tool_use_id"})


def _substitute(value: Any, keys: frozenset[str], mapping: dict[str, str]) -> Any:
    """``value`` with every string under one of ``keys`` (at any depth) replaced by what
    ``mapping`` maps it to, when it maps it."""
    if not mapping:
        return value
    if isinstance(value, dict):
        return {
            k: mapping.get(v, v)
            if k in keys and isinstance(v, str)
            else _substitute(v, keys, mapping)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_substitute(v, keys, mapping) for v in value]
    return value


#: Keys whose string values are a message's text in the three APIs' bodies.
_TEXT_KEYS = frozenset({"content", "text"})


def _answer_message(api: Api, raw: bytes, content_type: str) -> dict[str, Any] | None:
    try:
        return answer_message(api, raw, content_type)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None


async def replay(
    recording: list[RecordedRequest], base_url: str, *, timeout_s: float = 120.0
) -> list[ReplayedCall]:
    """Send each recorded request to its API's endpoint under ``base_url`` in order, reading
    each answer to its end before the next. ``base_url`` is a harness base URL, e.g.
    ``http://127.0.0.1:8080/ng-rollout/<id>/training-token-capture/v1``.

    Like a harness, later requests echo the tool-call ids and the text the proxy actually
    returned (the recorded ids, and a turn's recorded text where the answer's differs, are
    replaced), so a proxy that generates its own ids or parses the model's text itself
    (exact-token mode) sees the history it would see from the real harness.
    """
    out = []
    id_map: dict[str, str] = {}
    text_map: dict[str, str] = {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for req in recording:
            headers = {k: v for k, v in req.headers if k.lower() in REPLAYED_HEADERS}
            # the recorded tool-call ids (chat ``tool_calls[].id`` / ``tool_call_id``, Responses
            # ``call_id``, Messages ``tool_use.id`` / ``tool_use_id``) and the recorded text of
            # earlier answers (a chat message's ``content``, a Responses ``output_text`` or
            # Messages ``text`` block's ``text``) replaced by what the proxy returned
            body = _substitute(_substitute(req.body, _ID_KEYS, id_map), _TEXT_KEYS, text_map)
            url = base_url + API_PATHS[req.api].removeprefix("/v1")
            if req.query:
                url += "?" + req.query
            async with http.post(url, json=body, headers=headers) as resp:
                raw = await resp.read()
                answer = _answer_message(req.api, raw, resp.headers.get("Content-Type", ""))
                out.append(
                    ReplayedCall(
                        req.seq,
                        req.classification,
                        resp.status,
                        resp.headers.get("X-Capture-Call-Id"),
                        None if resp.status < 400 else error_summary(raw),
                    )
                )
            recorded_text = req.response_message.get("content")
            answered_text = (answer or {}).get("content")
            if recorded_text and isinstance(recorded_text, str) and isinstance(answered_text, str):
                text_map[recorded_text] = answered_text
            recorded_calls = req.response_message.get("tool_calls") or []
            answered_calls = (answer or {}).get("tool_calls") or []
            for rec_call, got in zip(recorded_calls, answered_calls, strict=False):
                if rec_call.get("id") and got.get("id"):
                    id_map[rec_call["id"]] = got["id"]
    return out
