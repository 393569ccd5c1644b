"""The load benchmark's concurrency sweep (issue 16 item 4): proxy CPU per call at C clients.

``load.py --sweep`` runs this instead of its load phases. One scripted engine, two proxies (one
per prompt mode: ``backend_template`` and ``exact_tokens`` with the scripted engine's tokenizer),
each on its own store. For each prompt mode, streaming and not, and each concurrency C
(default 1, 16, 256), ``max(C, --sweep-sessions)`` agent sessions of ``--steps`` calls run with
C at a time (a new session starts when one ends), all against the same processes. The figure is
the proxy process's CPU time (``/proc/<pid>/stat``, all threads) over the phase divided by the
calls served, so it is per call whatever the phase's length; the calls and sessions have the
same shape at every C, so a rise with C is what concurrency costs. Cells are run ``--repeat``
times, interleaved (the machine's noise spreads over all of them), and the table gives the
median and the range. Every call must succeed, and every session is checked to be one chain.

``--baseline-src DIR`` also runs both proxies from another source tree (``MODE@base``), in the
same run against the same engine.

Run: ``.venv/bin/python benchmarks/load.py --sweep [--repeat 3] [--sweep-concurrency 1,16,256]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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
    proc_cpu_s,
    raise_fd_limit,
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
from benchmarks.verification import Verification, by_rollout, verify_chains  # noqa: E402

MODES = ("backend_template", "exact_tokens")


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
    steps: int,
    stream: bool,
    workload: Workload,
) -> list[CallResult]:
    """One agent session (as ``sessions.run_session``), streaming or not."""
    messages: list[dict[str, Any]] = [
        workload.system(),
        {"role": "user", "content": f"Task {rollout_id}."},
    ]
    results = []
    for step in range(steps):
        body = request_body(target, list(messages))
        if not stream:
            body.pop("stream_options", None)
        call = stream_call if stream else whole_call
        result = await call(session, target.url(rollout_id), body, CallResult(rollout_id, step))
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
class Cell:
    """One phase: a prompt mode, streaming or not, C clients."""

    mode: str
    stream: bool
    clients: int
    cpu_ms_per_call: float
    calls: int
    calls_per_s: float
    results: list[CallResult]


async def run_cell(
    session: aiohttp.ClientSession,
    proxy: Service,
    mode: str,
    stream: bool,
    clients: int,
    sessions: int,
    steps: int,
    workload: Workload,
    tag: str,
) -> Cell:
    target = Target(mode, proxy.url, capture=True)
    pending = [f"sweep-{tag}-{mode[0]}{int(stream)}-c{clients}-{i:04d}" for i in range(sessions)]
    results: list[CallResult] = []

    async def client() -> None:
        while pending:
            rollout = pending.pop()
            results.extend(await sweep_session(session, target, rollout, steps, stream, workload))

    cpu0, t0 = proc_cpu_s(proxy.pid), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    cpu1, wall = proc_cpu_s(proxy.pid), time.perf_counter() - t0
    assert cpu0 is not None and cpu1 is not None
    ok = [r for r in results if r.ok]
    return Cell(
        mode,
        stream,
        clients,
        (cpu1 - cpu0) * 1000 / max(1, len(ok)),
        len(ok),
        len(ok) / wall,
        results,
    )


def proxy_argv(
    mode: str, engine_url: str, port: int, store: Path, args: argparse.Namespace, tokenizer: Path
) -> list[str]:
    argv = [*cli_command(), "serve", "--backend", engine_url, "--port", str(port)]
    argv += ["--store", str(store), "--log-level", args.proxy_log_level]
    argv += ["--store-synchronous", args.store_synchronous]
    if mode.startswith("exact_tokens"):
        argv += ["--prompt-mode", "exact_tokens", "--tokenizer", str(tokenizer)]
    return argv


def _services(args: argparse.Namespace, work: Path) -> tuple[Service, dict[str, Service]]:
    """The engine and one proxy per mode (``MODE@base``: from ``--baseline-src``), not started.
    Writes the scripted engine's tokenizer for exact_tokens into ``work``."""
    tokenizer = work / "tokenizer"
    subprocess.run(
        [*cli_command(), "export-tokenizer", str(tokenizer)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    port = free_port()
    engine = Service(
        "engine",
        [*cli_command(), "scripted-engine", "--port", str(port)],
        port,
        work / "engine.log",
    )
    modes = [*MODES, *(f"{m}@base" for m in MODES if args.baseline_src)]
    proxies = {}
    for mode in modes:
        p = free_port()
        argv = proxy_argv(mode, engine.url, p, work / f"store-{mode}", args, tokenizer)
        env = baseline_env(args.baseline_src) if mode.endswith("@base") else None
        proxies[mode] = Service(mode, argv, p, work / f"{mode}.log", env=env)
    return engine, proxies


async def _sweep_cells(
    args: argparse.Namespace,
    session: aiohttp.ClientSession,
    proxies: dict[str, Service],
    clients: list[int],
    workload: Workload,
) -> tuple[dict[tuple[str, bool, int], list[Cell]], bool]:
    """Every cell ``--repeat`` times, interleaved; the cells and whether a call failed."""
    cells: dict[tuple[str, bool, int], list[Cell]] = {}
    failed = False
    for rep in range(args.repeat):
        for c in clients:
            for mode, proxy in proxies.items():
                for stream in (True, False):
                    sessions = max(c, args.sweep_sessions)
                    cell = await run_cell(
                        session, proxy, mode, stream, c, sessions, args.steps, workload, f"r{rep}"
                    )
                    cells.setdefault((mode, stream, c), []).append(cell)
                    bad = [r for r in cell.results if not r.ok]
                    if bad:
                        failed = True
                        print(
                            f"  {mode} stream={stream} C={c}: {len(bad)} calls failed: "
                            f"{sorted({r.error for r in bad})}"
                        )
        print(f"  repeat {rep + 1} done", flush=True)
    return cells, failed


async def _verify_sessions(
    session: aiohttp.ClientSession,
    proxies: dict[str, Service],
    cells: dict[tuple[str, bool, int], list[Cell]],
    steps: int,
) -> bool:
    """Every session one chain (the last repeat's; every cell's calls were checked already).
    True when a problem was found."""
    v = Verification()
    for mode, proxy in proxies.items():
        for (m, _, _), runs in cells.items():
            if m == mode:
                await verify_chains(session, proxy.url, by_rollout(runs[-1].results), steps, v)
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
    workload = Workload(args.system_prompt_kb, args.tool_output_kb)
    print(
        f"sweep: proxy CPU per call at C clients; sessions of {args.steps} calls "
        f"(max(C, {args.sweep_sessions}) sessions per cell), {args.repeat} repeats; "
        f"{os.cpu_count()} CPUs shared by engine, proxies and generator; store_synchronous "
        f"{args.store_synchronous}, log level {args.proxy_log_level}; work dir {work}",
        flush=True,
    )
    cells: dict[tuple[str, bool, int], list[Cell]] = {}
    failed = False
    session = client_session(max(clients) + 16, read_timeout_s=args.duration_limit_s)
    try:
        for s in (engine, *proxies.values()):
            s.start()
        for s in (engine, *proxies.values()):
            await s.wait_healthy(session, 120)
        for mode, proxy in proxies.items():  # warm-up: imports, tokenizer, connections
            for stream in (True, False):
                await run_cell(session, proxy, mode, stream, 8, 8, args.steps, workload, "warm")
        cells, failed = await _sweep_cells(args, session, proxies, clients, workload)
        failed = await _verify_sessions(session, proxies, cells, args.steps) or failed
    finally:
        await session.close()
        for s in (*proxies.values(), engine):
            s.stop()
    report(cells, clients, list(proxies))
    return 1 if failed else 0


def report(
    cells: dict[tuple[str, bool, int], list[Cell]], clients: list[int], modes: list[str]
) -> None:
    print("\nproxy CPU ms per call: median (min-max over repeats); calls/s median")
    head = f"  {'mode':<22}{'stream':<8}" + "".join(f"{'C=' + str(c):>26}" for c in clients)
    print(head + "".join(f"{f'C={c}/C={clients[0]}':>12}" for c in clients[1:]))
    for mode in modes:
        for stream in (True, False):
            row = f"  {mode:<22}{'yes' if stream else 'no':<8}"
            med = {}
            for c in clients:
                runs = cells[(mode, stream, c)]
                cpu = [r.cpu_ms_per_call for r in runs]
                med[c] = statistics.median(cpu)
                rate = statistics.median(r.calls_per_s for r in runs)
                row += f"{med[c]:>7.2f} ({min(cpu):.2f}-{max(cpu):.2f}) {rate:>6.0f}/s"
            row += "".join(f"{med[c] / med[clients[0]]:>11.2f}x" for c in clients[1:])
            print(row)
    print("target: C=16/C=1 <= 1.3x in both prompt modes, streaming and not")
    print(
        json.dumps(
            {
                f"{m}|{'stream' if s else 'whole'}|{c}": [r.cpu_ms_per_call for r in v]
                for (m, s, c), v in cells.items()
            }
        )
    )
