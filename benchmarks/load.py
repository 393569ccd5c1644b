"""Load benchmark (issue 7 item 5): N concurrent streaming rollouts through the proxy.

Runs the scripted engine and the proxy as separate processes (``capture-proxy scripted-engine``
and ``capture-proxy serve`` on a temporary store) and the load generator in this process, with
one aiohttp ClientSession whose connector holds a connection per rollout. Each rollout is a
multi-step streaming agent session (default 3 calls: a tool call, a tool call, an answer), sent
back like OpenCode does: the assistant message echoed with content ``""`` and its tool calls,
then one tool result per tool call.

Phases, in one run, all against the same two processes:

1. warm-up: a few sessions direct and through the proxy (not measured, verified).
2. light: ``--light-rollouts`` sessions one after the other, each run three ways in turn:
   direct, relayed (the same bytes through the proxy's pass-through path, nothing captured)
   and captured. Per-call latency without queueing: the proxy's own overhead, split into the
   hop through an aiohttp process at all (relay - direct) and the capture (proxy - relay).
3. load: ``--rollouts`` concurrent sessions against the engine directly (baseline), then the
   same sessions through the proxy. On a saturated machine latency is mostly queueing, so the
   difference of the two distributions, and the CPU each process spent per call, say what the
   proxy costs.

The direct baseline sends the body the proxy sends upstream (``augment_chat_request``: log
probs, ``return_token_ids``, usage), so the engine does the same work in both. Per-call pairing
of direct and proxied calls is impossible (different calls), so distributions are compared:
latency (request sent to ``[DONE]`` read) and time to first byte (request sent to the first
body bytes) at p50/p99.

Afterwards every proxied rollout is checked over REST: each call the harness saw (by its
``X-Capture-Call-Id``) is stored ``complete`` with the token counts the engine reported in
``usage``, and each rollout is one chain of ``--steps`` calls with nothing unlinked or
incomplete. ``--kill-after N`` SIGKILLs the proxy after N completed proxied calls of the load
phase, restarts it on the same store and checks that every call whose ``[DONE]`` the harness
saw is readable (the crash-safety variant; the chain checks then cover only rollouts that
finished before the kill).

Every wait is bounded (``--duration-limit-s`` for the whole run, deadlines on start-up). The
engine, the proxy and this generator share the machine's cores; the report prints how many.

``--sweep`` runs the concurrency sweep instead (``cpu_sweep.py``): proxy CPU per call at 1, 16
and 256 clients, in both prompt modes, streaming and not.

Run: ``.venv/bin/python benchmarks/load.py [--rollouts 1024] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from capture_proxy.core.capture import augment_chat_request
from capture_proxy.core.sse import SSEStreamDecoder

ROOT = Path(__file__).resolve().parents[1]
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

    def system(self) -> dict[str, Any]:
        return {"role": "system", "content": SYSTEM["content"] + _filler(self.system_prompt_kb)}

    def tool_output(self, text: str) -> str:
        return text + _filler(self.tool_output_kb)


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
# processes


def free_port() -> int:
    """A loopback port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def cli_command() -> list[str]:
    """How to run ``capture-proxy``: the venv's script, else this interpreter's module."""
    script = Path(sys.executable).parent / "capture-proxy"
    return [str(script)] if script.exists() else [sys.executable, "-m", "capture_proxy.cli"]


@dataclass
class Service:
    """A child process serving HTTP on ``port``; its output goes to ``log_path``."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    #: extra environment (``PYTHONPATH`` of another source tree: a baseline in the same run)
    env: dict[str, str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env} if self.env else None,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def wait_healthy(self, session: aiohttp.ClientSession, deadline_s: float) -> None:
        """Poll ``/health`` until 200, the process exits, or ``deadline_s`` passes."""
        assert self.proc is not None
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(
                    self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy after {deadline_s} s: {self.tail()}")

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL and reap (bounded)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGINT (aiohttp's graceful exit, lets a profiler write), then SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


def baseline_env(src: str | None) -> dict[str, str] | None:
    """The environment that runs ``capture-proxy`` from the source tree ``src`` (e.g. a
    ``git archive`` of the fork point), so a baseline is measured in the same run."""
    return {"PYTHONPATH": str(Path(src).resolve())} if src else None


def engine_service(work: Path, port: int | None = None) -> Service:
    port = port or free_port()
    argv = [*cli_command(), "scripted-engine", "--port", str(port)]
    return Service("engine", argv, port, work / "engine.log")


def proxy_service(
    work: Path,
    backend: str,
    store: Path | str,
    port: int | None = None,
    *,
    log_level: str = "INFO",
    profile_to: Path | None = None,
    store_synchronous: str = "full",
    name: str = "proxy",
) -> Service:
    port = port or free_port()
    args = ["serve", "--backend", backend, "--port", str(port), "--store", str(store)]
    args += ["--log-level", log_level, "--store-synchronous", store_synchronous]
    if profile_to is not None:
        argv = [sys.executable, "-m", "cProfile", "-o", str(profile_to)]
        argv += ["-m", "capture_proxy.cli", *args]
    else:
        argv = [*cli_command(), *args]
    return Service(name, argv, port, work / f"{name}.log")


def proc_status_kib(pid: int, field_name: str) -> int | None:
    """A ``/proc/<pid>/status`` field in KiB (e.g. ``VmHWM``: peak resident set)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (``/proc/<pid>/stat``, all threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def start_py_spy(out: str, pid: int) -> subprocess.Popen[bytes]:
    """``py-spy record`` on ``pid`` (all threads, native frames off) until stopped."""
    argv = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--threads"]
    argv += ["--rate", "250", "--output", out]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_py_spy(proc: subprocess.Popen[bytes], out: str) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    print(f"  py-spy samples of the proxy during this phase: {out}")


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


def request_body(target: Target, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "tools": TOOLS,
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
        body = request_body(target, list(messages))
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


# ---------------------------------------------------------------------------------------------
# verification over REST


@dataclass
class Verification:
    rollouts_checked: int = 0
    calls_checked: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.problems.append(text)


async def _get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def verify_calls(
    session: aiohttp.ClientSession, proxy_url: str, calls: list[CallResult], v: Verification
) -> None:
    """Every call whose ``[DONE]`` the harness saw is stored complete, with the engine's token
    counts (``usage``) and, when the harness asked for them, the exact ids and log probs."""
    sem = asyncio.Semaphore(32)

    async def one(r: CallResult) -> None:
        if r.call_id is None:
            v.problem(f"{r.rollout_id} step {r.step}: completed without {CALL_ID_HEADER}")
            return
        async with sem:
            status, rec = await _get_json(session, f"{proxy_url}/captures/calls/{r.call_id}")
        v.calls_checked += 1
        if status != 200:
            v.problem(f"{r.call_id}: GET answered {status}")
            return
        problems = check_record(r, rec)
        v.problems += [f"{r.call_id}: {p}" for p in problems]

    await asyncio.gather(*(one(r) for r in calls if r.done))


def check_record(r: CallResult, rec: dict[str, Any]) -> list[str]:
    """What differs between a stored call and what the harness received."""
    out = []
    if rec.get("status") != "complete":
        out.append(f"status {rec.get('status')}")
    if rec.get("rollout_id") not in (None, r.rollout_id):
        out.append(f"rollout {rec.get('rollout_id')} != {r.rollout_id}")
    prompt, gen = rec.get("prompt_token_ids") or [], rec.get("generation_token_ids") or []
    if r.usage is not None and (
        len(prompt) != r.usage.get("prompt_tokens") or len(gen) != r.usage.get("completion_tokens")
    ):
        out.append(f"token counts {len(prompt)}/{len(gen)} != usage {r.usage}")
    if r.prompt_token_ids is not None and prompt != r.prompt_token_ids:
        out.append("prompt token ids differ from what the engine sent")
    if r.generation_token_ids and gen != r.generation_token_ids:
        out.append("generation token ids differ from what the engine sent")
    if r.generation_log_probs:
        import numpy as np

        want = np.asarray(r.generation_log_probs, dtype=np.float32)
        got = np.asarray(rec.get("generation_log_probs") or [], dtype=np.float32)
        if want.shape != got.shape or not np.array_equal(want, got):
            out.append("generation log probs differ from what the engine sent")
    return out


async def verify_chains(
    session: aiohttp.ClientSession,
    proxy_url: str,
    sessions: dict[str, list[CallResult]],
    steps: int,
    v: Verification,
) -> None:
    """Each rollout whose every call completed is one chain of its calls, in order, linked
    parent to child, nothing unlinked, not incomplete."""
    sem = asyncio.Semaphore(32)

    async def one(rollout_id: str, calls: list[CallResult]) -> None:
        async with sem:
            status, body = await _get_json(
                session, f"{proxy_url}/captures/rollouts/{rollout_id}/chains"
            )
        v.rollouts_checked += 1
        if status != 200:
            v.problem(f"{rollout_id}: chains answered {status}")
            return
        want = [r.call_id for r in calls]
        got = [[c["call_id"] for c in ch["calls"]] for ch in body.get("chains", [])]
        if got != [want]:
            v.problem(f"{rollout_id}: chains {got} != [{want}]")
        for ch in body.get("chains", []):
            parents = [c["parent_call_id"] for c in ch["calls"]]
            ids = [c["call_id"] for c in ch["calls"]]
            if parents != [None, *ids[:-1]]:
                v.problem(f"{rollout_id}: parents {parents} do not follow {ids}")
        if body.get("unlinked_calls"):
            v.problem(f"{rollout_id}: {len(body['unlinked_calls'])} unlinked calls")
        if body.get("incomplete"):
            v.problem(f"{rollout_id}: marked incomplete ({body.get('diagnostics')})")

    full = {
        rid: calls
        for rid, calls in sessions.items()
        if len(calls) == steps and all(c.ok for c in calls)
    }
    await asyncio.gather(*(one(rid, calls) for rid, calls in full.items()))


async def stored_call_count(session: aiohttp.ClientSession, proxy_url: str) -> int:
    status, body = await _get_json(session, proxy_url + "/health")
    return int(body["store"]["calls"]) if status == 200 else -1


# ---------------------------------------------------------------------------------------------
# the run


def by_rollout(results: list[CallResult]) -> dict[str, list[CallResult]]:
    out: dict[str, list[CallResult]] = {}
    for r in sorted(results, key=lambda r: r.step):
        out.setdefault(r.rollout_id, []).append(r)
    return out


async def main_async(args: argparse.Namespace) -> int:
    start = time.monotonic()
    deadline = start + args.duration_limit_s
    fd_limit = raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="capture-load-"))
    store = Path(args.store) if args.store else work / "store"
    run = uuid.uuid4().hex[:6]
    engine = engine_service(work)
    proxy = proxy_service(
        work,
        engine.url,
        store,
        log_level=args.proxy_log_level,
        profile_to=Path(args.profile_proxy) if args.profile_proxy else None,
        store_synchronous=args.store_synchronous,
    )
    print(
        f"load: {args.rollouts} rollouts x {args.steps} streaming calls (system prompt "
        f"+{args.system_prompt_kb:g} KB, tool outputs +{args.tool_output_kb:g} KB); "
        f"{os.cpu_count()} CPUs shared by engine, proxy and generator; open-file limit "
        f"{fd_limit}; work dir {work}",
        flush=True,
    )
    engine.start()
    proxy.start()
    exit_code = 0
    connections = max(args.rollouts, args.light_rollouts, 1) + 16
    session = client_session(connections, read_timeout_s=args.duration_limit_s)
    try:
        await engine.wait_healthy(session, 120)
        await proxy.wait_healthy(session, 120)
        pids = {"engine": engine.pid, "proxy": proxy.pid}
        workload = Workload(args.system_prompt_kb, args.tool_output_kb)
        direct = Target("direct", engine.url, capture=False, augment=True)
        proxied = Target("proxy", proxy.url, capture=True, ask_tokens=args.ask_tokens)
        if args.ask_tokens:
            direct = Target("direct", engine.url, capture=False, augment=True, ask_tokens=True)
        # The direct bytes through the proxy's pass-through path: the cost of the hop alone.
        relay = Target("relay", proxy.url, capture=False, augment=True, ask_tokens=args.ask_tokens)
        proxied_results: list[CallResult] = []

        def keep(r: CallResult) -> None:
            proxied_results.append(r)

        # 1. warm-up
        warm = [f"warm-{run}-{i}" for i in range(8)]
        await run_phase(
            "warm direct",
            session,
            direct,
            warm,
            args.steps,
            concurrent=True,
            deadline=deadline,
            pids=pids,
            workload=workload,
        )
        await run_phase(
            "warm proxy",
            session,
            proxied,
            warm,
            args.steps,
            concurrent=True,
            deadline=deadline,
            pids=pids,
            workload=workload,
            on_call=keep,
        )

        # 2. light: one call at a time; direct, relayed and captured in turn
        light: dict[str, list[CallResult]] = {"direct": [], "relay": [], "proxy": []}
        targets = {"direct": direct, "relay": relay, "proxy": proxied}
        t_light = time.perf_counter()
        for i in range(args.light_rollouts):
            rid = f"light-{run}-{i:04d}"
            for name, target in targets.items():
                phase = await run_phase(
                    name[0],
                    session,
                    target,
                    [rid],
                    args.steps,
                    concurrent=False,
                    deadline=deadline,
                    pids=pids,
                    workload=workload,
                    on_call=keep if target is proxied else None,
                )
                light[name] += phase.results
        light_wall = time.perf_counter() - t_light
        print(
            f"\nlight load: {args.light_rollouts} sessions one call at a time ({light_wall:.1f} s)"
        )
        phases = {name: Phase(name, r, light_wall / 3, {}) for name, r in light.items()}
        for name, phase in phases.items():
            for line in describe(phase, args.light_rollouts * args.steps)[1:4]:
                print(f"  {name:6s}" + line[3:])
        for line in compare(phases["direct"], phases["proxy"]):
            print(line)
        print("    of which:")
        for line in compare(phases["direct"], phases["relay"], "relay - direct"):
            print("  " + line.replace("added", "hop   "))
        for line in compare(phases["relay"], phases["proxy"], "proxy - relay"):
            print("  " + line.replace("added", "capture"))

        # 3. load: all rollouts at once, direct, then through the proxy
        rollouts = [f"load-{run}-{i:05d}" for i in range(args.rollouts)]
        expected = args.rollouts * args.steps
        print(f"\nfull load: {args.rollouts} concurrent sessions")
        d = await run_phase(
            "direct",
            session,
            direct,
            rollouts,
            args.steps,
            concurrent=True,
            deadline=deadline,
            pids=pids,
            workload=workload,
        )
        for line in describe(d, expected):
            print(line, flush=True)

        completed: list[CallResult] = []
        killed_at: int | None = None
        rss_kib = None

        def on_proxied(r: CallResult) -> None:
            nonlocal killed_at, rss_kib
            keep(r)
            if r.done:
                completed.append(r)
            if args.kill_after and killed_at is None and len(completed) >= args.kill_after:
                rss_kib = proc_status_kib(proxy.pid, "VmHWM")
                proxy.kill()
                killed_at = len(completed)

        spy = start_py_spy(args.py_spy, proxy.pid) if args.py_spy else None
        p = await run_phase(
            "proxy",
            session,
            proxied,
            rollouts,
            args.steps,
            concurrent=True,
            deadline=deadline,
            pids=pids,
            workload=workload,
            on_call=on_proxied,
        )
        if spy is not None:
            stop_py_spy(spy, args.py_spy)
        for line in describe(p, expected):
            print(line)
        for line in compare(d, p):
            print(line)
        if rss_kib is None:
            rss_kib = proc_status_kib(proxy.pid, "VmHWM")
        engine_rss = proc_status_kib(engine.pid, "VmHWM")
        print(
            f"  peak RSS (VmHWM): proxy {rss_kib / 1024 if rss_kib else float('nan'):.1f} MiB, "
            f"engine {engine_rss / 1024 if engine_rss else float('nan'):.1f} MiB"
        )

        if killed_at is not None:
            print(
                f"\ncrash: SIGKILLed the proxy after {killed_at} completed proxied calls; "
                "restarting on the same store"
            )
            proxy.start()
            await proxy.wait_healthy(session, 120)

        # 4. verification over REST
        v = Verification()
        await verify_calls(session, proxy.url, [r for r in proxied_results if r.done], v)
        await verify_chains(session, proxy.url, by_rollout(proxied_results), args.steps, v)
        stored = await stored_call_count(session, proxy.url)
        done_calls = sum(1 for r in proxied_results if r.done)
        print(
            f"\nverify: {v.calls_checked} completed calls read back, {v.rollouts_checked} "
            f"complete rollouts' chains checked, {stored} calls in the store "
            f"({done_calls} completed by the harness), problems: {len(v.problems)}"
        )
        for text in v.problems[:20]:
            print("  " + text)
        lost = sum(1 for t in v.problems if "GET answered 404" in t)
        errors = p.errors() + d.errors()
        if killed_at is None and (errors or p.timed_out or d.timed_out):
            exit_code = 1
        if v.problems or lost:
            exit_code = 1
        print(
            "\nresult: "
            + ("PASS" if exit_code == 0 else "FAIL")
            + f" (errors direct {sum(d.errors().values())}, proxy {sum(p.errors().values())}; "
            f"lost calls {lost}; total {time.monotonic() - start:.1f} s)"
        )
    finally:
        await session.close()
        proxy.stop()
        engine.stop()
        if args.profile_proxy:
            print(f"proxy profile: {args.profile_proxy}")
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    return exit_code


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=1024, help="concurrent sessions (1024)")
    ap.add_argument("--steps", type=int, default=3, help="streaming calls per session (3)")
    ap.add_argument(
        "--light-rollouts",
        type=int,
        default=20,
        help="sessions run one call at a time for the unloaded overhead (20)",
    )
    ap.add_argument(
        "--duration-limit-s",
        type=float,
        default=600.0,
        help="bound on the whole run, seconds (600)",
    )
    ap.add_argument(
        "--store-synchronous",
        choices=["full", "normal"],
        default="full",
        help="the proxy's store_synchronous setting (full, the default)",
    )
    ap.add_argument(
        "--kill-after",
        type=int,
        default=0,
        help="SIGKILL the proxy after N completed proxied calls, restart, verify",
    )
    ap.add_argument(
        "--ask-tokens",
        action="store_true",
        help="the harness asks return_token_ids + logprobs; verify ids exactly",
    )
    ap.add_argument("--proxy-log-level", default="INFO", help="proxy --log-level (INFO)")
    ap.add_argument(
        "--profile-proxy",
        metavar="FILE",
        help="run the proxy under cProfile, writing stats to FILE",
    )
    ap.add_argument(
        "--py-spy",
        metavar="FILE",
        help="sample the proxy with py-spy (on PATH) during the proxied load phase; "
        "collapsed stacks to FILE",
    )
    ap.add_argument(
        "--system-prompt-kb",
        type=float,
        default=0.0,
        help="pad the system prompt to about this many KB (OpenCode: ~8 KB + 20 KB of tools)",
    )
    ap.add_argument(
        "--tool-output-kb",
        type=float,
        default=0.0,
        help="size of each tool result in KB (files the agent reads)",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the load phases: proxy CPU per call at C clients, both prompt modes, "
        "streaming and not (benchmarks/cpu_sweep.py)",
    )
    ap.add_argument("--sweep-concurrency", default="1,16,256", help="sweep: C values (1,16,256)")
    ap.add_argument(
        "--sweep-sessions", type=int, default=32, help="sweep: sessions per cell, at least C (32)"
    )
    ap.add_argument("--repeat", type=int, default=3, help="sweep: repeats of every cell (3)")
    ap.add_argument(
        "--baseline-src",
        metavar="DIR",
        help="sweep: also run the proxies from this source tree (MODE@base), in the same run",
    )
    ap.add_argument("--store", help="store directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, store)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rollouts < 1 or args.steps < 1:
        print("--rollouts and --steps must be positive", file=sys.stderr)
        return 2
    if args.sweep:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from cpu_sweep import run_sweep

        return asyncio.run(run_sweep(args))
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
