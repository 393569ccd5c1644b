"""The load benchmark's concurrency sweep (issue 16 item 4, issue 22): CPU per call at C clients.

``load.py --sweep`` runs this instead of its load phases. One scripted engine, two proxies (one
per prompt mode: ``backend_template`` and ``exact_tokens`` with the scripted engine's tokenizer),
each on its own store, and ``direct``: the same sessions sent to the engine without a proxy,
with the body the proxy sends upstream (``Target(augment=True)``). For each target, streaming
and not, and each concurrency C (default 1, 16, 256), ``max(C, ceil(--sweep-calls / --steps))``
agent sessions of ``--steps`` calls run with C at a time (a new session starts when one ends),
all against the same processes. Each session is its own rollout, or with
``--sweep-one-rollout`` every session of a cell shares ONE rollout id (the peers' shape:
16 clients, one rollout). Every answer is a text of exactly ``--answer-tokens`` generation
tokens (default 32: a policy file for the scripted engine; 0: the engine's default policy,
two tool calls then an answer); the count per call is printed.

The figure is the proxy process's CPU time (``/proc/<pid>/stat``, all threads; for ``direct``
the engine's) over the phase divided by the calls served, so it is per call whatever the
phase's length; beside it the engine's CPU, the proxy's CPU by thread (the event loop's main
thread, the store's writer and reader, other; user and system apart: the proxies run under
``named_threads.py`` so that ``/proc/<pid>/task/*/comm`` names them) and the latency, with the
direct call's figures and the ratios. The CPU clock ticks in 10 ms, so 1,000 calls per cell
resolve 0.01 ms. The calls and sessions have the same shape at every C, so a rise with C is
what concurrency costs. Cells are run ``--repeat`` times, interleaved (the machine's noise
spreads over all of them), and the tables give medians (and the range). The targets of issue
22 are printed with PASS or FAIL. Every call must succeed, and every session is checked to be
one chain (by call ids, also when sessions share a rollout).

``--baseline-src DIR`` also runs both proxies from another source tree (``MODE@base``), in the
same run against the same engine.

Run: ``.venv/bin/python benchmarks/load.py --sweep [--repeat 3] [--sweep-concurrency 1,16,256]
[--sweep-one-rollout]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.services import (  # noqa: E402
    ROOT,
    Service,
    baseline_env,
    cli_command,
    free_port,
    one_process,
    proc_cpu_s,
    raise_fd_limit,
    thread_cpu_s,
)
from benchmarks.sessions import (  # noqa: E402
    CALL_ID_HEADER,
    CallResult,
    Target,
    Workload,
    client_session,
    request_body,
    stream_call,
)
from benchmarks.sweep_report import DIRECT, Cell, Cells, report  # noqa: E402
from benchmarks.verification import (  # noqa: E402
    Verification,
    by_rollout,
    verify_chains,
    verify_shared_chains,
)

MODES = ("backend_template", "exact_tokens")
NAMED_THREADS = Path(__file__).resolve().parent / "named_threads.py"
#: words of one token each after a space (Qwen's vocabulary): n of them and a full stop are
#: n + 1 tokens, and the engine ends the turn with ``<|im_end|>``
WORDS = (
    "Step",
    "one",
    "of",
    "the",
    "plan",
    "is",
    "done",
    "and",
    "the",
    "next",
    "step",
    "reads",
    "the",
    "module",
    "tests",
    "then",
    "runs",
    "them",
    "again",
    "so",
    "we",
    "see",
    "whether",
    "the",
    "fix",
    "holds",
    "for",
    "every",
    "case",
    "we",
    "know",
)


def answer_text(tokens: int) -> str:
    """A text the scripted engine answers in exactly ``tokens`` generation tokens (at least 3):
    ``tokens - 2`` words, a full stop, ``<|im_end|>``."""
    words = [WORDS[i % len(WORDS)] for i in range(tokens - 2)]
    return " ".join(words) + "."


def write_policy(work: Path, tokens: int) -> Path:
    """A scripted-engine policy answering every agent call with ``answer_text(tokens)``."""
    path = work / "policy.json"
    path.write_text(json.dumps({"steps": [], "final": answer_text(tokens)}))
    return path


async def whole_call(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], result: CallResult
) -> CallResult:
    """POST a non-streaming chat request, filling ``result`` (message echoed as OpenCode)."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, json={**body, "stream": False}) as resp:
            result.call_id = resp.headers.get(CALL_ID_HEADER)
            data = await resp.json(content_type=None)
            if resp.status != 200:
                result.error = f"http {resp.status}"
                return result
        message = data["choices"][0]["message"]
        out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        for key in ("reasoning_content", "tool_calls"):
            if message.get(key):
                out[key] = message[key]
        result.message, result.usage, result.done = out, data.get("usage"), True
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as exc:
        result.error = type(exc).__name__
    finally:
        result.latency_s = time.perf_counter() - t0
    return result


async def sweep_session(
    session: aiohttp.ClientSession,
    target: Target,
    rollout_id: str,
    session_id: str,
    steps: int,
    stream: bool,
    workload: Workload,
) -> list[CallResult]:
    """One agent session (as ``sessions.run_session``), streaming or not; its task names
    ``session_id``, so sessions sharing a rollout differ from the first call."""
    messages: list[dict[str, Any]] = [
        workload.system(),
        {"role": "user", "content": f"Task {session_id}."},
    ]
    results = []
    for step in range(steps):
        body = request_body(target, list(messages), workload.tools)
        if not stream:
            body.pop("stream_options", None)
        call = stream_call if stream else whole_call
        result = CallResult(rollout_id, step, session_id=session_id)
        result = await call(session, target.url(rollout_id), body, result)
        results.append(result)
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


@dataclass
class Sweep:
    """What every cell of one sweep shares."""

    args: argparse.Namespace
    session: aiohttp.ClientSession
    workload: Workload
    engine: Service


def _thread_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], calls: int
) -> dict[str, tuple[float, float]]:
    """(user, system) ms per call of each thread role between two ``thread_cpu_s`` reads."""
    out = {}
    for role, (u1, s1) in after.items():
        u0, s0 = before.get(role, (0.0, 0.0))
        out[role] = ((u1 - u0) * 1000 / calls, (s1 - s0) * 1000 / calls)
    return out


async def run_cell(
    sw: Sweep, name: str, target: Target, pid: int, stream: bool, clients: int, tag: str
) -> Cell:
    """One phase: ``name``'s sessions (``pid``: the process measured) at ``clients``."""
    n = max(clients, math.ceil(sw.args.sweep_calls / sw.args.steps))
    cell_id = f"sweep-{tag}-{name[0]}{name.count('@')}{int(stream)}-c{clients}"
    if sw.args.sweep_one_rollout:
        pending = [(cell_id, f"{cell_id}-{i:04d}") for i in range(n)]
    else:
        pending = [(f"{cell_id}-{i:04d}",) * 2 for i in range(n)]
    pending.reverse()
    results: list[CallResult] = []

    async def client() -> None:
        while pending:
            rollout, sid = pending.pop()
            results.extend(
                await sweep_session(
                    sw.session, target, rollout, sid, sw.args.steps, stream, sw.workload
                )
            )

    threads0 = thread_cpu_s(pid) if name != DIRECT else {}
    cpu0, eng0, t0 = proc_cpu_s(pid), proc_cpu_s(sw.engine.pid), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    cpu1, eng1, wall = proc_cpu_s(pid), proc_cpu_s(sw.engine.pid), time.perf_counter() - t0
    threads1 = thread_cpu_s(pid) if name != DIRECT else {}
    assert cpu0 is not None and cpu1 is not None and eng0 is not None and eng1 is not None
    ok = max(1, sum(1 for r in results if r.ok))
    return Cell(
        name,
        stream,
        clients,
        (cpu1 - cpu0) * 1000 / ok,
        (eng1 - eng0) * 1000 / ok,
        ok,
        ok / wall,
        results,
        _thread_delta(threads0, threads1, ok),
    )


def proxy_argv(
    mode: str, engine_url: str, port: int, store: Path, args: argparse.Namespace, tokenizer: Path
) -> list[str]:
    argv = [sys.executable, str(NAMED_THREADS), "serve", "--backend", engine_url]
    argv += ["--port", str(port), "--store", str(store), "--log-level", args.proxy_log_level]
    argv += ["--store-synchronous", args.store_synchronous]
    if mode.startswith("exact_tokens"):
        argv += ["--prompt-mode", "exact_tokens", "--tokenizer", str(tokenizer)]
    return one_process(argv, args.baseline_src if mode.endswith("@base") else None)


def _services(args: argparse.Namespace, work: Path) -> tuple[Service, dict[str, Service]]:
    """The engine and one proxy per mode (``MODE@base``: from ``--baseline-src``), not started.
    Writes the scripted engine's tokenizer for exact_tokens (and its policy) into ``work``."""
    tokenizer = work / "tokenizer"
    subprocess.run(
        [*cli_command(), "export-tokenizer", str(tokenizer)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    port = free_port()
    argv = [*cli_command(), "scripted-engine", "--port", str(port)]
    if args.answer_tokens:
        argv += ["--policy", str(write_policy(work, args.answer_tokens))]
    engine = Service("engine", argv, port, work / "engine.log")
    modes = [*MODES, *(f"{m}@base" for m in MODES if args.baseline_src)]
    proxies = {}
    for mode in modes:
        p = free_port()
        argv = proxy_argv(mode, engine.url, p, work / f"store-{mode}", args, tokenizer)
        env = baseline_env(args.baseline_src) if mode.endswith("@base") else None
        proxies[mode] = Service(mode, argv, p, work / f"{mode}.log", env=env)
    return engine, proxies


def _targets(sw: Sweep, proxies: dict[str, Service]) -> dict[str, tuple[Target, int]]:
    """``direct`` (the engine, the proxy's upstream body) and each proxy: target and pid."""
    out = {DIRECT: (Target(DIRECT, sw.engine.url, capture=False, augment=True), sw.engine.pid)}
    for mode, proxy in proxies.items():
        out[mode] = (Target(mode, proxy.url, capture=True), proxy.pid)
    return out


async def _sweep_cells(
    sw: Sweep, proxies: dict[str, Service], clients: list[int]
) -> tuple[Cells, bool]:
    """Every cell ``--repeat`` times, interleaved; the cells and whether a call failed."""
    cells: Cells = {}
    failed = False
    targets = _targets(sw, proxies)
    for rep in range(sw.args.repeat):
        for c in clients:
            for name, (target, pid) in targets.items():
                for stream in (True, False):
                    cell = await run_cell(sw, name, target, pid, stream, c, f"r{rep}")
                    cells.setdefault((name, stream, c), []).append(cell)
                    bad = [r for r in cell.results if not r.ok]
                    if bad:
                        failed = True
                        print(
                            f"  {name} stream={stream} C={c}: {len(bad)} calls failed: "
                            f"{sorted({r.error for r in bad})}"
                        )
        print(f"  repeat {rep + 1} done", flush=True)
    return cells, failed


async def _verify_sessions(sw: Sweep, proxies: dict[str, Service], cells: Cells) -> bool:
    """Every session one chain (the last repeat's; every cell's calls were checked already).
    True when a problem was found."""
    v = Verification()
    for mode, proxy in proxies.items():
        for (m, _, _), runs in cells.items():
            if m != mode:
                continue
            results = runs[-1].results
            if sw.args.sweep_one_rollout:
                await verify_shared_chains(sw.session, proxy.url, results, sw.args.steps, v)
            else:
                await verify_chains(sw.session, proxy.url, by_rollout(results), sw.args.steps, v)
    print(f"verify: {v.rollouts_checked} sessions' chains checked, problems: {len(v.problems)}")
    for text in v.problems[:10]:
        print("  " + text)
    return bool(v.problems)


async def run_sweep(args: argparse.Namespace) -> int:
    """The sweep (see the module docstring): 0 when every call succeeded and every session is
    one chain."""
    raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="capture-sweep-"))
    engine, proxies = _services(args, work)
    clients = [int(c) for c in args.sweep_concurrency.split(",")]
    per_cell = math.ceil(args.sweep_calls / args.steps)
    shape = "one rollout per cell" if args.sweep_one_rollout else "a rollout each"
    print(
        f"sweep: CPU per call at C clients; sessions of {args.steps} calls (max(C, {per_cell}) "
        f"sessions per cell, {shape}), "
        f"answers of {args.answer_tokens or 'the default policy'} tokens, {args.repeat} repeats; "
        f"{os.cpu_count()} CPUs shared by engine, proxies and generator; store_synchronous "
        f"{args.store_synchronous}, log level {args.proxy_log_level}; work dir {work}",
        flush=True,
    )
    cells: Cells = {}
    failed = False
    session = client_session(max(clients) + 16, read_timeout_s=args.duration_limit_s)
    sw = Sweep(args, session, Workload(args.system_prompt_kb, args.tool_output_kb), engine)
    try:
        for s in (engine, *proxies.values()):
            s.start()
        for s in (engine, *proxies.values()):
            await s.wait_healthy(session, 120)
        warm_args = argparse.Namespace(**{**vars(args), "sweep_calls": 8 * args.steps})
        warm = Sweep(warm_args, session, sw.workload, engine)
        for name, (target, pid) in _targets(sw, proxies).items():  # imports, tokenizer, pools
            for stream in (True, False):
                await run_cell(warm, name, target, pid, stream, 8, "warm")
        cells, failed = await _sweep_cells(sw, proxies, clients)
        failed = await _verify_sessions(sw, proxies, cells) or failed
    finally:
        await session.close()
        for s in (*proxies.values(), engine):
            s.stop()
    report(cells, clients, list(proxies))
    return 1 if failed else 0
