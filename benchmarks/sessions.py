"""The benchmarks' load client: multi-step streaming agent sessions sent like a harness, one
call's figures as the harness saw them, and phases of sessions with their percentiles.

A session is OpenCode-like: the assistant message echoed with content ``""`` and its tool
calls, then one tool result per tool call. Must not: start processes (``services``) or read
the store (``verification``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from capture_proxy.core.capture import augment_chat_request
from capture_proxy.core.sse import SSEStreamDecoder

# Imported by scripts run by path (``benchmarks/load.py``, ``rollout_size.py`` imports it as
# ``sessions``) and by the tests: with the repository root on sys.path ``benchmarks.`` resolves.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.services import proc_cpu_s  # noqa: E402

CAPTURE_PREFIX = "/ng-rollout/{rollout}/training-token-capture"
CHAT_PATH = "/v1/chat/completions"
CALL_ID_HEADER = "X-Capture-Call-Id"
MODEL = "scripted-qwen"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "description": {"type": "string"},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"filePath": {"type": "string"}},
                "required": ["filePath"],
            },
        },
    },
]
SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools to answer."}


@dataclass(frozen=True)
class Workload:
    """How big a session's requests are: ``system_prompt_kb`` pads the system prompt (OpenCode
    sends about 8 KB of system prompt and 20 KB of tool definitions), ``tool_output_kb`` is the
    size of each tool result (file contents read by the agent make histories grow)."""

    system_prompt_kb: float = 0.0
    tool_output_kb: float = 0.0
    #: the requests' tools (None: ``TOOLS``, two small ones), e.g. a harness's
    #: (``recorded_tools``: OpenCode sends about 21 KB)
    tools: list[dict[str, Any]] | None = None

    def system(self) -> dict[str, Any]:
        return {"role": "system", "content": SYSTEM["content"] + _filler(self.system_prompt_kb)}

    def tool_output(self, text: str) -> str:
        return text + _filler(self.tool_output_kb)


def recorded_tools(path: Path) -> list[dict[str, Any]]:
    """The tools of the first request that has some in a recorded harness session (a
    ``tests/fixtures/*`` JSONL file: one exchange per line, its request as ``body``)."""
    for line in path.read_text().splitlines():
        body = json.loads(line).get("body")
        if isinstance(body, dict) and body.get("tools"):
            return list(body["tools"])
    raise ValueError(f"{path}: no request with tools")


def _filler(kb: float) -> str:
    """About ``kb`` KB of varied, deterministic text lines."""
    lines, size, i = [], 0, 0
    while size < kb * 1024:
        line = (
            f"\nLine {i}: keep edits small, run the tests after each change ({i * 7919 % 10007})."
        )
        lines.append(line)
        size += len(line)
        i += 1
    return "".join(lines)


# ---------------------------------------------------------------------------------------------
# one streaming call, one session


@dataclass
class CallResult:
    """One chat call as the harness saw it. Times in seconds from sending the request."""

    rollout_id: str
    step: int
    latency_s: float = 0.0
    ttfb_s: float | None = None
    error: str | None = None
    done: bool = False
    call_id: str | None = None
    message: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] = field(default_factory=list)
    generation_log_probs: list[float] = field(default_factory=list)
    #: the replica that answered, when a load balancer says (``X-Capture-Replica``)
    served_by: str | None = None
    #: the agent session the call belongs to, when several share one rollout (else None)
    session_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done


class _MessageAssembler:
    """Rebuilds the assistant message from stream deltas (content, reasoning, tool calls)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}

    def add(self, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        for key in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str):
                self.reasoning.append(delta[key])
        for tc in delta.get("tool_calls") or []:
            slot = self.tool_calls.setdefault(
                tc.get("index", 0),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if tc.get("id"):
                slot["id"] = tc["id"]
            fn = tc.get("function") or {}
            if fn.get("name"):
                slot["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                slot["function"]["arguments"] += fn["arguments"]

    def echo(self) -> dict[str, Any]:
        """The message as OpenCode sends it back: content "" rather than null."""
        out: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            out["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return out


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"http {exc.status}"
    return type(exc).__name__


async def stream_call(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    result: CallResult,
    headers: dict[str, str] | None = None,
) -> CallResult:
    """POST a streaming chat request and read it to the end, filling ``result``."""
    t0 = time.perf_counter()
    assembler = _MessageAssembler()
    decoder = SSEStreamDecoder()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            result.call_id = resp.headers.get(CALL_ID_HEADER)
            result.served_by = resp.headers.get("X-Capture-Replica")
            if resp.status != 200:
                await resp.read()
                result.error = f"http {resp.status}"
                return result
            async for data in resp.content.iter_any():
                if result.ttfb_s is None:
                    result.ttfb_s = time.perf_counter() - t0
                for event in decoder.feed(data):
                    _take_event(event.data, assembler, result)
            for event in decoder.close():
                _take_event(event.data, assembler, result)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = _error_kind(exc)
    finally:
        result.latency_s = time.perf_counter() - t0
    if result.error is None and not result.done:
        result.error = "stream ended without [DONE]"
    result.message = assembler.echo()
    return result


def _take_event(data: str, assembler: _MessageAssembler, result: CallResult) -> None:
    if data == "[DONE]":
        result.done = True
        return
    chunk = json.loads(data)
    if "error" in chunk:
        result.error = "in-band error"
        return
    if isinstance(chunk.get("prompt_token_ids"), list):
        result.prompt_token_ids = chunk["prompt_token_ids"]
    if chunk.get("usage"):
        result.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        assembler.add(choice.get("delta") or {})
        result.generation_token_ids += choice.get("token_ids") or []
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            result.generation_log_probs.append(entry["logprob"])


@dataclass(frozen=True)
class Target:
    """Where a session's calls go. ``augment``: send the body the proxy would send upstream
    (the direct baseline); ``ask_tokens``: the harness asks for token ids and log probs."""

    name: str
    base_url: str
    capture: bool
    augment: bool = False
    ask_tokens: bool = False

    def url(self, rollout_id: str) -> str:
        prefix = CAPTURE_PREFIX.format(rollout=rollout_id) if self.capture else ""
        return self.base_url + prefix + CHAT_PATH


def request_body(
    target: Target, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "tools": TOOLS if tools is None else tools,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ask_tokens:
        body |= {"return_token_ids": True, "logprobs": True}
    if target.augment:
        body, _ = augment_chat_request(body)
    return body


async def run_session(
    session: aiohttp.ClientSession,
    target: Target,
    rollout_id: str,
    steps: int,
    on_call: Any = None,
    workload: Workload = Workload(),
) -> list[CallResult]:
    """One agent session of ``steps`` streaming calls; stops at the first failed call.

    Tool calls get one tool result each; an answer without tool calls is followed by a new user
    message, so any number of steps makes one chain. ``on_call(result)`` runs after each call.
    """
    messages: list[dict[str, Any]] = [
        workload.system(),
        {"role": "user", "content": f"Task {rollout_id}."},
    ]
    results: list[CallResult] = []
    for step in range(steps):
        body = request_body(target, list(messages), workload.tools)
        result = await stream_call(
            session, target.url(rollout_id), body, CallResult(rollout_id, step)
        )
        results.append(result)
        if on_call is not None:
            on_call(result)
        if not result.ok:
            break
        assert result.message is not None
        messages.append(result.message)
        calls = result.message.get("tool_calls") or []
        for tc in calls:
            content = workload.tool_output(f"output of {tc['function']['name']} at step {step}")
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": content})
        if not calls:
            messages.append({"role": "user", "content": "Continue."})
    return results


def client_session(connections: int, read_timeout_s: float) -> aiohttp.ClientSession:
    """One session for every rollout: a connection each (aiohttp's default pool is 100)."""
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=read_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# phases and figures


@dataclass
class Phase:
    name: str
    results: list[CallResult]
    wall_s: float
    cpu_s: dict[str, float | None]
    timed_out: bool = False

    @property
    def ok(self) -> list[CallResult]:
        return [r for r in self.results if r.ok]

    def errors(self) -> Counter[str]:
        return Counter(r.error or "no [DONE]" for r in self.results if not r.ok)


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``values``; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def _ms(values: Sequence[float], p: float) -> float:
    return pct(values, p) * 1000


async def run_phase(
    name: str,
    session: aiohttp.ClientSession,
    target: Target,
    rollout_ids: list[str],
    steps: int,
    *,
    concurrent: bool,
    deadline: float,
    pids: dict[str, int],
    on_call: Any = None,
    workload: Workload = Workload(),
) -> Phase:
    """Run the sessions (all at once, or one after the other) until done or ``deadline``."""
    results: list[CallResult] = []

    def record(r: CallResult) -> None:
        results.append(r)
        if on_call is not None:
            on_call(r)

    async def run_all() -> None:
        if concurrent:
            await asyncio.gather(
                *(run_session(session, target, rid, steps, record, workload) for rid in rollout_ids)
            )
        else:
            for rid in rollout_ids:
                await run_session(session, target, rid, steps, record, workload)

    cpu0 = {k: proc_cpu_s(p) for k, p in pids.items()} | {"generator": time.process_time()}
    t0 = time.perf_counter()
    timed_out = False
    try:
        await asyncio.wait_for(run_all(), timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        timed_out = True
    wall = time.perf_counter() - t0
    cpu1 = {k: proc_cpu_s(p) for k, p in pids.items()} | {"generator": time.process_time()}
    cpu = {
        k: (cpu1[k] - cpu0[k]) if cpu0[k] is not None and cpu1[k] is not None else None  # type: ignore[operator]
        for k in cpu0
    }
    return Phase(name, results, wall, cpu, timed_out)


def describe(phase: Phase, expected_calls: int) -> list[str]:
    ok = phase.ok
    lat = [r.latency_s for r in ok]
    ttfb = [r.ttfb_s for r in ok if r.ttfb_s is not None]
    errors = phase.errors()
    lines = [
        f"  {phase.name}: {len(ok)}/{expected_calls} calls ok in {phase.wall_s:.2f} s "
        f"= {len(ok) / phase.wall_s:.1f} calls/s"
        + ("  [DURATION LIMIT HIT]" if phase.timed_out else ""),
        f"    latency ms  p50 {_ms(lat, 50):8.2f}  p99 {_ms(lat, 99):8.2f}  max "
        f"{_ms(lat, 100):8.2f}",
        f"    ttfb ms     p50 {_ms(ttfb, 50):8.2f}  p99 {_ms(ttfb, 99):8.2f}",
        "    errors: " + (", ".join(f"{k} x{v}" for k, v in errors.most_common()) or "none"),
    ]
    if len(ok):
        cpu = ", ".join(
            f"{k} {v * 1000 / len(ok):.2f}" for k, v in phase.cpu_s.items() if v is not None
        )
        lines.append(f"    CPU ms per ok call: {cpu}")
    return lines


def compare(direct: Phase, proxied: Phase, label_of: str = "proxy - direct") -> list[str]:
    out = []
    for label, get in (("latency", lambda r: r.latency_s), ("ttfb", lambda r: r.ttfb_s)):
        d = [get(r) for r in direct.ok if get(r) is not None]
        p = [get(r) for r in proxied.ok if get(r) is not None]
        out.append(
            f"    added {label:7s} ms ({label_of})  p50 {_ms(p, 50) - _ms(d, 50):+8.2f}  "
            f"p99 {_ms(p, 99) - _ms(d, 99):+8.2f}"
        )
    return out
