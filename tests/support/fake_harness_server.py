"""A recording fake model server for the real Codex CLI and Claude Code (aiohttp, port 0).

It answers the two wire APIs the harnesses speak, streaming, from a scripted multi-step tool
session, and records every request it gets (any method, any path) and what it sent back:

- OpenAI Responses API, ``POST /v1/responses`` (Codex): ``response.created``,
  ``response.in_progress``, then per output item ``response.output_item.added`` / deltas /
  ``response.output_item.done`` (reasoning with summary and ``encrypted_content``, assistant
  ``message`` with ``output_text`` deltas, ``function_call`` with argument deltas,
  ``custom_tool_call`` with input deltas), then ``response.completed`` with ``usage``.
- Anthropic Messages, ``POST /v1/messages`` (Claude Code, ``?beta=true``): ``message_start``,
  ``content_block_start`` / ``_delta`` / ``_stop`` (``thinking`` with ``signature_delta``,
  ``text``, ``tool_use`` with ``input_json_delta``), ``message_delta`` with ``stop_reason`` and
  ``usage``, ``message_stop``; non-streaming requests get the whole message. Also
  ``POST /v1/messages/count_tokens`` -> ``{"input_tokens": N}``.

Anything else is recorded and answered 404 in the API's error shape. One recorded line per
request, the format of tests/fixtures/opencode/README.md: ``seq, ts, ts_done, method, path,
query, http_version, headers`` (``[name, value]`` pairs in wire order), ``body_raw`` (exact
body text), ``body`` (parsed JSON or null), ``classification``, ``status``, ``response_raw``.

Step choice (one user turn): the number of model turns after the last real user turn, counted
from the request. Codex: ``function_call``/``custom_tool_call`` items after the last ``user``
``message`` item. Claude Code: ``assistant`` messages after the last user message that is not
only tool results. A request without ``tools`` is a side request (title, summary, quota
probe) and gets ``side_text``. Past the last step the answer is the last step's text.

Knobs for probing a harness: ``omit_events`` (SSE event types left out), ``fail_first`` /
``fail_status`` (answer the first N agent requests with an error in the API's error shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

Api = Literal["responses", "messages"]


@dataclass(frozen=True)
class ToolCall:
    """One scripted tool call. ``kind="custom"``: a Responses API freeform (custom) tool whose
    ``arguments`` is the raw input text; otherwise ``arguments`` is JSON (dict or verbatim)."""

    name: str
    arguments: dict[str, Any] | str
    kind: Literal["function", "custom"] = "function"

    def arguments_text(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Step:
    """One scripted model turn: optional reasoning/thinking, optional text, tool calls."""

    text: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass
class FakeServerConfig:
    codex_steps: list[Step] = field(default_factory=list)
    claude_steps: list[Step] = field(default_factory=list)
    side_text: str = "Listing project files"
    omit_events: frozenset[str] = frozenset()
    fail_first: int = 0  # answer the first N agent requests with an error
    fail_status: int = 500
    chunk_size: int = 12  # characters per text/argument delta


@dataclass
class Recorded:
    line: dict[str, Any]

    @property
    def body(self) -> Any:
        return self.line["body"]

    @property
    def classification(self) -> str:
        return str(self.line["classification"])


class FakeHarnessServer:
    """The app plus what it recorded. ``start()``/``stop()`` run it on 127.0.0.1, port 0."""

    def __init__(self, config: FakeServerConfig) -> None:
        self.config = config
        self.records: list[Recorded] = []
        self._seq = 0
        self._agent_requests = 0
        self._ids = 0
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner: web.AppRunner | None = None
        self.port = 0

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lines(self) -> list[dict[str, Any]]:
        return [r.line for r in self.records]

    def write_jsonl(self, path: Path, replacements: Iterable[tuple[str, str]] = ()) -> None:
        """Write the recording, with each ``(old, new)`` text replaced everywhere (scratch
        paths, keys); ``Content-Length`` is recomputed and the original kept."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for line in self.lines():
                f.write(json.dumps(scrub_line(line, list(replacements)), ensure_ascii=False))
                f.write("\n")

    # --- dispatch ------------------------------------------------------------------------
    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}_fake{self._ids:04d}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self._seq += 1
        raw = await request.read()
        try:
            body_raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            body_raw = raw.decode("latin-1")
        body: Any = None
        if body_raw:
            with contextlib.suppress(ValueError):
                body = json.loads(body_raw)
        line: dict[str, Any] = {
            "seq": self._seq,
            "ts": time.time(),
            "method": request.method,
            "path": request.path,
            "query": request.query_string,
            "http_version": f"HTTP/{request.version.major}.{request.version.minor}",
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers],
            "body_raw": body_raw,
            "body": body,
            "classification": "unknown",
            "status": 404,
            "response_raw": "",
        }
        rec = Recorded(line)
        self.records.append(rec)
        try:
            return await self._answer(request, rec, body)
        finally:
            line["ts_done"] = time.time()

    async def _answer(self, request: web.Request, rec: Recorded, body: Any) -> web.StreamResponse:
        path = request.path.rstrip("/")
        line = rec.line
        if request.method == "POST" and path.endswith("/messages/count_tokens"):
            line["classification"] = "count_tokens"
            return self._json(line, 200, {"input_tokens": _estimate_tokens(line["body_raw"])})
        if request.method == "POST" and path.endswith("/responses") and isinstance(body, dict):
            return await self._api_call(request, rec, body, "responses")
        if request.method == "POST" and path.endswith("/messages") and isinstance(body, dict):
            return await self._api_call(request, rec, body, "messages")
        line["classification"] = "not-found"
        api: Api = (
            "messages"
            if "/messages" in path or "anthropic" in str(request.headers)
            else ("responses")
        )
        return self._json(line, 404, _error_body(api, 404, f"no route {request.method} {path}"))

    def _json(self, line: dict[str, Any], status: int, obj: Any) -> web.Response:
        text = json.dumps(obj)
        line["status"] = status
        line["response_raw"] = text
        return web.Response(status=status, text=text, content_type="application/json")

    async def _api_call(
        self, request: web.Request, rec: Recorded, body: dict[str, Any], api: Api
    ) -> web.StreamResponse:
        line = rec.line
        if not body.get("tools"):
            step, label = Step(text=self.config.side_text), "side"
        else:
            self._agent_requests += 1
            if self._agent_requests <= self.config.fail_first:
                line["classification"] = f"agent-error({self.config.fail_status})"
                return self._json(
                    line,
                    self.config.fail_status,
                    _error_body(api, self.config.fail_status, "scripted failure"),
                )
            steps = self.config.codex_steps if api == "responses" else self.config.claude_steps
            index = codex_step_index(body) if api == "responses" else claude_step_index(body)
            if not steps:
                step = Step(text="Done.")
            elif index < len(steps):
                step = steps[index]
            else:
                step = Step(text=steps[-1].text or "Done.")
            label = f"agent-tool(step={index})" if step.tool_calls else f"agent-final(step={index})"
        line["classification"] = label
        events = (
            self._responses_events(body, step)
            if api == "responses"
            else self._messages_events(body, step)
        )
        if not body.get("stream"):
            final = events[-1][1]
            obj = final["response"] if api == "responses" else _final_message(events)
            return self._json(line, 200, obj)
        events = [(name, data) for name, data in events if name not in self.config.omit_events]
        return await self._stream(request, line, events)

    async def _stream(
        self, request: web.Request, line: dict[str, Any], events: list[tuple[str, dict[str, Any]]]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        line["status"] = 200
        await resp.prepare(request)
        sent: list[str] = []
        try:
            for name, data in events:
                chunk = f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
                sent.append(chunk)
                await resp.write(chunk.encode("utf-8"))
                await asyncio.sleep(0)
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            line["client_disconnected"] = True
            raise
        finally:
            line["response_raw"] = "".join(sent)
        return resp

    # --- Responses API (Codex) -----------------------------------------------------------
    def _responses_events(
        self, body: dict[str, Any], step: Step
    ) -> list[tuple[str, dict[str, Any]]]:
        n = self.config.chunk_size
        resp_id = self._next_id("resp")
        model = str(body.get("model", "fake-model"))
        seq = 0
        out: list[tuple[str, dict[str, Any]]] = []

        def ev(name: str, **data: Any) -> None:
            nonlocal seq
            out.append((name, {"type": name, "sequence_number": seq, **data}))
            seq += 1

        base = {
            "id": resp_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "status": "in_progress",
            "output": [],
            "usage": None,
        }
        ev("response.created", response=dict(base))
        ev("response.in_progress", response=dict(base))
        items: list[dict[str, Any]] = []
        if step.reasoning is not None:
            rid = self._next_id("rs")
            idx = len(items)
            item = {"id": rid, "type": "reasoning", "summary": [], "encrypted_content": None}
            ev("response.output_item.added", output_index=idx, item=item)
            ev(
                "response.reasoning_summary_part.added",
                item_id=rid,
                output_index=idx,
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            )
            for piece in _chunks(step.reasoning, n):
                ev(
                    "response.reasoning_summary_text.delta",
                    item_id=rid,
                    output_index=idx,
                    summary_index=0,
                    delta=piece,
                )
            ev(
                "response.reasoning_summary_text.done",
                item_id=rid,
                output_index=idx,
                summary_index=0,
                text=step.reasoning,
            )
            part = {"type": "summary_text", "text": step.reasoning}
            ev(
                "response.reasoning_summary_part.done",
                item_id=rid,
                output_index=idx,
                summary_index=0,
                part=part,
            )
            done = {
                "id": rid,
                "type": "reasoning",
                "summary": [part],
                "encrypted_content": f"gAAAAB-fake-encrypted-{rid}",
            }
            ev("response.output_item.done", output_index=idx, item=done)
            items.append(done)
        if step.text:
            mid = self._next_id("msg")
            idx = len(items)
            ev(
                "response.output_item.added",
                output_index=idx,
                item={
                    "id": mid,
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                },
            )
            empty = {"type": "output_text", "text": "", "annotations": []}
            ev(
                "response.content_part.added",
                item_id=mid,
                output_index=idx,
                content_index=0,
                part=empty,
            )
            for piece in _chunks(step.text, n):
                ev(
                    "response.output_text.delta",
                    item_id=mid,
                    output_index=idx,
                    content_index=0,
                    delta=piece,
                    logprobs=[],
                )
            ev(
                "response.output_text.done",
                item_id=mid,
                output_index=idx,
                content_index=0,
                text=step.text,
                logprobs=[],
            )
            part = {"type": "output_text", "text": step.text, "annotations": []}
            ev(
                "response.content_part.done",
                item_id=mid,
                output_index=idx,
                content_index=0,
                part=part,
            )
            done = {
                "id": mid,
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
            ev("response.output_item.done", output_index=idx, item=done)
            items.append(done)
        for call in step.tool_calls:
            idx = len(items)
            call_id = self._next_id("call")
            text = call.arguments_text()
            if call.kind == "custom":
                iid = self._next_id("ctc")
                ev(
                    "response.output_item.added",
                    output_index=idx,
                    item={
                        "id": iid,
                        "type": "custom_tool_call",
                        "status": "in_progress",
                        "call_id": call_id,
                        "name": call.name,
                        "input": "",
                    },
                )
                for piece in _chunks(text, n):
                    ev(
                        "response.custom_tool_call_input.delta",
                        item_id=iid,
                        output_index=idx,
                        delta=piece,
                    )
                ev(
                    "response.custom_tool_call_input.done",
                    item_id=iid,
                    output_index=idx,
                    input=text,
                )
                done = {
                    "id": iid,
                    "type": "custom_tool_call",
                    "status": "completed",
                    "call_id": call_id,
                    "name": call.name,
                    "input": text,
                }
            else:
                iid = self._next_id("fc")
                ev(
                    "response.output_item.added",
                    output_index=idx,
                    item={
                        "id": iid,
                        "type": "function_call",
                        "status": "in_progress",
                        "call_id": call_id,
                        "name": call.name,
                        "arguments": "",
                    },
                )
                for piece in _json_chunks(text):
                    ev(
                        "response.function_call_arguments.delta",
                        item_id=iid,
                        output_index=idx,
                        delta=piece,
                    )
                ev(
                    "response.function_call_arguments.done",
                    item_id=iid,
                    output_index=idx,
                    arguments=text,
                )
                done = {
                    "id": iid,
                    "type": "function_call",
                    "status": "completed",
                    "call_id": call_id,
                    "name": call.name,
                    "arguments": text,
                }
            ev("response.output_item.done", output_index=idx, item=done)
            items.append(done)
        in_tokens = _estimate_tokens(json.dumps(body.get("input", "")))
        out_tokens = max(1, _estimate_tokens(json.dumps(items)))
        final = dict(
            base,
            status="completed",
            output=items,
            usage={
                "input_tokens": in_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": out_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": in_tokens + out_tokens,
            },
        )
        ev("response.completed", response=final)
        return out

    # --- Anthropic Messages (Claude Code) ------------------------------------------------
    def _messages_events(
        self, body: dict[str, Any], step: Step
    ) -> list[tuple[str, dict[str, Any]]]:
        n = self.config.chunk_size
        model = str(body.get("model", "fake-model"))
        in_tokens = _estimate_tokens(json.dumps(body.get("messages", [])))
        out: list[tuple[str, dict[str, Any]]] = []

        def ev(name: str, **data: Any) -> None:
            out.append((name, {"type": name, **data}))

        ev(
            "message_start",
            message={
                "id": self._next_id("msg"),
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": in_tokens,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 1,
                },
            },
        )
        ev("ping")
        idx = 0
        if step.reasoning is not None:
            ev(
                "content_block_start",
                index=idx,
                content_block={"type": "thinking", "thinking": "", "signature": ""},
            )
            for piece in _chunks(step.reasoning, n):
                ev(
                    "content_block_delta",
                    index=idx,
                    delta={"type": "thinking_delta", "thinking": piece},
                )
            ev(
                "content_block_delta",
                index=idx,
                delta={
                    "type": "signature_delta",
                    "signature": f"FakeSig{idx}{len(self.records)}==",
                },
            )
            ev("content_block_stop", index=idx)
            idx += 1
        if step.text:
            ev("content_block_start", index=idx, content_block={"type": "text", "text": ""})
            for piece in _chunks(step.text, n):
                ev("content_block_delta", index=idx, delta={"type": "text_delta", "text": piece})
            ev("content_block_stop", index=idx)
            idx += 1
        for call in step.tool_calls:
            ev(
                "content_block_start",
                index=idx,
                content_block={
                    "type": "tool_use",
                    "id": self._next_id("toolu"),
                    "name": call.name,
                    "input": {},
                },
            )
            for piece in _json_chunks(call.arguments_text()):
                ev(
                    "content_block_delta",
                    index=idx,
                    delta={"type": "input_json_delta", "partial_json": piece},
                )
            ev("content_block_stop", index=idx)
            idx += 1
        out_tokens = max(1, idx * 10)
        ev(
            "message_delta",
            delta={
                "stop_reason": "tool_use" if step.tool_calls else "end_turn",
                "stop_sequence": None,
            },
            usage={"output_tokens": out_tokens},
        )
        ev("message_stop")
        return out


# --- the scripted sessions the fixtures and the driver tests use --------------------------
NOTES_TEXT = "TODO: count the files\nalpha é ✓\n  indented beta\n"
CODEX_PATCH = (
    "*** Begin Patch\n*** Update File: notes.txt\n@@\n-TODO: count the files\n"
    "+DONE: counted the files\n*** End Patch\n"
)
CODEX_FINAL = "Done: the project holds notes.txt; its TODO line is now DONE."
CLAUDE_FINAL = "Done: the project holds notes.txt; its TODO line is now DONE."


def codex_tool_session() -> list[Step]:
    """Reasoning + text + ``exec_command ls``; ``apply_patch`` (freeform) on notes.txt;
    ``exec_command cat notes.txt``; a final answer."""
    return [
        Step(
            text="Let me look at the files first.",
            reasoning="The user wants the files listed. Run ls.",
            tool_calls=(ToolCall("exec_command", {"cmd": "ls"}),),
        ),
        Step(tool_calls=(ToolCall("apply_patch", CODEX_PATCH, kind="custom"),)),
        Step(tool_calls=(ToolCall("exec_command", {"cmd": "cat notes.txt"}),)),
        Step(text=CODEX_FINAL),
    ]


def claude_tool_session(project_dir: Path | str) -> list[Step]:
    """Thinking + text + ``Bash ls``; ``Read`` notes.txt; ``Edit`` it; a final answer."""
    notes = str(Path(project_dir) / "notes.txt")
    return [
        Step(
            text="Let me look at the files first.",
            reasoning="The user wants the files listed. Run ls.",
            tool_calls=(ToolCall("Bash", {"command": "ls", "description": "List files"}),),
        ),
        Step(tool_calls=(ToolCall("Read", {"file_path": notes}),)),
        Step(
            tool_calls=(
                ToolCall(
                    "Edit",
                    {
                        "file_path": notes,
                        "old_string": "TODO: count the files",
                        "new_string": "DONE: counted the files",
                    },
                ),
            )
        ),
        Step(text=CLAUDE_FINAL),
    ]


# --- step choice ---------------------------------------------------------------------------
def codex_step_index(body: dict[str, Any]) -> int:
    """Tool-call items after the last ``user`` message item of a Responses ``input``."""
    items = body.get("input")
    if not isinstance(items, list):
        return 0
    last_user = max(
        (
            i
            for i, it in enumerate(items)
            if isinstance(it, dict)
            and it.get("type", "message") == "message"
            and it.get("role") == "user"
        ),
        default=-1,
    )
    return sum(
        1
        for it in items[last_user + 1 :]
        if isinstance(it, dict) and it.get("type") in ("function_call", "custom_tool_call")
    )


def claude_step_index(body: dict[str, Any]) -> int:
    """Assistant messages after the last user message that is not only tool results."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0

    def real_user(m: Any) -> bool:
        if not isinstance(m, dict) or m.get("role") != "user":
            return False
        content = m.get("content")
        if isinstance(content, str):
            return True
        return not any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)

    last_user = max((i for i, m in enumerate(messages) if real_user(m)), default=-1)
    return sum(
        1 for m in messages[last_user + 1 :] if isinstance(m, dict) and m.get("role") == "assistant"
    )


# --- helpers -------------------------------------------------------------------------------
def _chunks(text: str, n: int) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)] or [""]


_JSON_PIECES = re.compile(r'"(?:[^"\\]|\\.)*"|[^"]+')


def _json_chunks(text: str) -> list[str]:
    """Tool-call argument deltas: JSON strings whole, punctuation between them separate (so a
    path inside a value is never split across deltas and can be scrubbed from a recording)."""
    return _JSON_PIECES.findall(text) or [""]


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _error_body(api: Api, status: int, message: str) -> dict[str, Any]:
    if api == "messages":
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            429: "rate_limit_error",
            529: "overloaded_error",
        }.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _final_message(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The non-streaming message equal to a scripted event list."""
    msg: dict[str, Any] = {}
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for name, data in events:
        if name == "message_start":
            msg = dict(data["message"])
        elif name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            b, d = blocks[data["index"]], data["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + d["partial_json"]
        elif name == "message_delta":
            msg.update(data["delta"])
            msg["usage"] = dict(msg["usage"], **data["usage"])
    for i, text in partial.items():
        blocks[i]["input"] = json.loads(text)
    msg["content"] = blocks
    return msg


def scrub_line(line: dict[str, Any], replacements: list[tuple[str, str]]) -> dict[str, Any]:
    """A recorded line with each ``(old, new)`` replaced in every string, body re-parsed from
    the scrubbed ``body_raw`` and ``Content-Length`` recomputed (original kept)."""

    def fix(v: Any) -> Any:
        if isinstance(v, str):
            for old, new in replacements:
                v = v.replace(old, new)
            return v
        if isinstance(v, list):
            return [fix(x) for x in v]
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        return v

    out = {k: fix(v) for k, v in line.items() if k != "body"}
    body_raw = out["body_raw"]
    out["body"] = None
    if body_raw:
        with contextlib.suppress(ValueError):
            out["body"] = json.loads(body_raw)
    new_len = str(len(body_raw.encode("utf-8")))
    for h in out["headers"]:
        if h[0].lower() == "content-length" and h[1] != new_len:
            out["content_length_original"] = h[1]
            h[1] = new_len
    keys = [
        "seq",
        "ts",
        "ts_done",
        "method",
        "path",
        "query",
        "http_version",
        "headers",
        "body_raw",
        "body",
        "classification",
        "status",
        "response_raw",
    ]
    return {k: out[k] for k in keys if k in out} | {k: v for k, v in out.items() if k not in keys}


@contextlib.asynccontextmanager
async def running(config: FakeServerConfig) -> AsyncIterator[FakeHarnessServer]:
    server = FakeHarnessServer(config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
