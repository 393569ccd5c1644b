"""The proxy beside the bare relay, side by side (issues 22 and 35): CPU per call and per
streamed token, in the shapes of issue 35's table, both prompt modes, in one run.

Targets, each its own process(es), all in front of scripted engines answering every call with
exactly 32 or 512 generation tokens (``cpu_sweep.write_policy``; one engine per length):

- ``relay``: ``bare_relay.py``: one aiohttp handler relaying request and answer (a stream one
  write per read, whatever the read holds); ``relay-event``: the same writing one SSE event
  at a time (a relay that looks at each event);
- ``backend_template`` and ``exact_tokens``: ``capture-proxy serve`` with its defaults (SQLite,
  ``store_synchronous`` full: each group commit fsynced before its calls' answers end;
  ``--workers``: the default, one per CPU, unless ``--proxy-workers`` says), the second with
  ``--prompt-mode exact_tokens`` and the scripted engine's tokenizer. Their CPU is the
  process tree's (the supervisor, its writer thread included, and the workers).

``least`` (``--least``): ``least_capture.py``, the least a durable capture can do in Python
on aiohttp (the request and answer parsed and written again with orjson, the token data taken
as numpy arrays, one SQLite row per call committed by one writer thread with group commit
before the answer ends; no validation, linking, record format or metrics): its ratio to the
relay is what any durable capture costs, the proxy's ratio to it what the proxy's own work
costs. Not a proxy: its sessions are not checked for chains.

Shapes: non-streamed at 1 client and at 16 clients in ONE rollout (16 agent sessions at once,
each its own task), 32-token and 512-token streams at 1 client and at 16 clients in one
rollout. Sessions of 3 chat calls (the relays get the body the proxy sends upstream, so
the engine does the same work). Each cell ``--calls`` calls; ``--rounds`` rounds, targets in
turn within each shape (the machine's noise spreads over all), medians printed with ranges.
Every call must succeed, and every proxy session is checked to be one chain (by call ids).

Per streamed token: a 512-token call's CPU less a 32-token call's, over 480 (the marginal
cost: what a longer answer adds), at 1 and at 16 clients; beside it, for reference, a
512-token call's whole CPU over 512 (per-call costs spread over the tokens; those are held to
the per-call lines). Issue 35's lines: proxy marginal per token <= ``relay-event``'s;
non-streamed per call <= 2x the relay's at 1 client and <= 3x at 16, each with PASS or FAIL.
Also, as before: one SQLite WAL commit of a ``--commit-kb`` row with ``synchronous=FULL``
(this process's thread CPU).

A mode named ``<mode>-python`` (``--modes backend_template,backend_template-python``) is the
same proxy with ``CAPTURE_PROXY_NO_COMPILED`` set: its Python path alone, beside the compiled
chunk scan (``core/chunk_scan.py``) in the same run.

Run: ``.venv/bin/python benchmarks/floor.py [--calls 600] [--rounds 3]
[--proxy-workers N] [--modes backend_template,exact_tokens] [--streams-only] [--least]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_sweep import sweep_session, write_policy  # noqa: E402
from benchmarks.saturation_procs import tree_cpu_s  # noqa: E402
from benchmarks.services import ROOT, Service, cli_command, free_port  # noqa: E402
from benchmarks.sessions import CallResult, Target, Workload, client_session  # noqa: E402
from benchmarks.verification import Verification, verify_shared_chains  # noqa: E402

RELAY = Path(__file__).resolve().with_name("bare_relay.py")
LEAST = Path(__file__).resolve().with_name("least_capture.py")
RELAYS = ("relay", "relay-event")
#: the least durable capture (``least_capture.py``): a floor, not a proxy (no chains to check)
FLOORS = (*RELAYS, "least")
PYTHON_PATH = "-python"


@dataclass(frozen=True)
class Shape:
    name: str
    stream: bool
    tokens: int
    clients: int


SHAPES = (
    Shape("non-stream, 1 client", False, 32, 1),
    Shape("non-stream, 16 clients, one rollout", False, 32, 16),
    Shape("32-token stream, 1 client", True, 32, 1),
    Shape("512-token stream, 1 client", True, 512, 1),
    Shape("32-token stream, 16 clients", True, 32, 16),
    Shape("512-token stream, 16 clients", True, 512, 16),
)


Targets = dict[tuple[str, int], Service]


def _services(args: argparse.Namespace, work: Path) -> tuple[list[Service], Targets]:
    """Two engines (32 and 512 tokens) and, per engine, every target; not started."""
    tokenizer = work / "tokenizer"
    subprocess.run([*cli_command(), "export-tokenizer", str(tokenizer)], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    engines, targets = [], {}
    for tokens in (32, 512):
        (work / str(tokens)).mkdir()
        port = free_port()
        argv = [*cli_command(), "scripted-engine", "--port", str(port)]
        argv += ["--policy", str(write_policy(work / str(tokens), tokens))]
        engine = Service(f"engine{tokens}", argv, port, work / f"engine{tokens}.log")
        engines.append(engine)
        for name in args.targets:
            port = free_port()
            log = work / f"{name}-{tokens}.log"
            if name in RELAYS:
                argv = [sys.executable, str(RELAY), "--backend", engine.url, "--port", str(port)]
                argv += ["--per-event"] if name == "relay-event" else []
            elif name == "least":
                argv = [sys.executable, str(LEAST), "--backend", engine.url, "--port", str(port)]
                argv += ["--store", str(work / f"least-{tokens}.sqlite3")]
            else:
                argv = [*cli_command(), "serve", "--backend", engine.url, "--port", str(port)]
                argv += ["--store", str(work / f"store-{name}-{tokens}"), "--log-level", "WARNING"]
                if args.proxy_workers:
                    argv += ["--workers", str(args.proxy_workers)]
                if name.startswith("exact_tokens"):
                    argv += ["--prompt-mode", "exact_tokens", "--tokenizer", str(tokenizer)]
            # ``<mode>-python``: the same proxy on its Python path alone (chunk_scan)
            env = {"CAPTURE_PROXY_NO_COMPILED": "1"} if name.endswith(PYTHON_PATH) else None
            targets[(name, tokens)] = Service(name, argv, port, log, env=env)
    return engines, targets


async def _cell(http: aiohttp.ClientSession, svc: Service, shape: Shape, calls: int,
                tag: str) -> tuple[float, list[CallResult]]:  # fmt: skip
    """``calls`` calls of ``shape`` through ``svc``: its CPU ms per call, and the calls."""
    capture = svc.name not in RELAYS
    target = Target(svc.name, svc.url, capture=capture, augment=not capture)
    sessions = max(shape.clients, calls // 3)
    rollout = f"{tag}-one"  # the 16-client shapes: one rollout; 1 client: one per session
    todo = [(rollout if shape.clients > 1 else f"{tag}-{i}", f"{tag}-{i}") for i in range(sessions)]
    todo.reverse()
    results: list[CallResult] = []

    async def client() -> None:
        while todo:
            rid, sid = todo.pop()
            done = await sweep_session(http, target, rid, sid, 3, shape.stream, Workload())
            results.extend(done)

    cpu0 = tree_cpu_s(svc.pid)
    await asyncio.gather(*(client() for _ in range(shape.clients)))
    cpu1 = tree_cpu_s(svc.pid)
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{svc.name} {shape.name}: {len(bad)} calls failed: {bad[0].error}")
    return (cpu1 - cpu0) * 1000 / len(results), results


def commit_cpu_ms(path: Path, commits: int, kb: int) -> float:
    """Thread CPU ms (user + system) per WAL commit, ``synchronous=FULL``, of one ``kb`` row."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE IF NOT EXISTS calls (call_id TEXT PRIMARY KEY, data BLOB)")
        payload = os.urandom(kb * 1024)
        u0 = resource.getrusage(resource.RUSAGE_THREAD)
        for _ in range(commits):
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO calls VALUES (?, ?)", (os.urandom(16).hex(), payload))
            db.execute("COMMIT")
        u1 = resource.getrusage(resource.RUSAGE_THREAD)
    finally:
        db.close()
    return ((u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)) * 1000 / commits


async def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="floor-"))
    engines, targets = _services(args, work)
    figures: dict[tuple[str, str], list[float]] = {}
    checks = Verification()
    http = client_session(64, read_timeout_s=300)
    try:
        for s in (*engines, *targets.values()):
            s.start()
        for s in (*engines, *targets.values()):
            await s.wait_healthy(http, 180)
        for (name, tokens), svc in targets.items():  # warm-up, unmeasured
            for shape in args.shapes:
                if shape.tokens == tokens:
                    await _cell(http, svc, shape, 3 * shape.clients, f"warm-{name}-{tokens}")
        for r in range(args.rounds):
            for shape in args.shapes:
                for name in args.targets:
                    svc = targets[(name, shape.tokens)]
                    tag = f"r{r}-{SHAPES.index(shape)}-{name}"
                    calls = args.calls * (2 if shape.clients > 1 else 1)
                    ms, results = await _cell(http, svc, shape, calls, tag)
                    figures.setdefault((shape.name, name), []).append(ms)
                    if shape.clients > 1 and name not in FLOORS:
                        await verify_shared_chains(http, svc.url, results, 3, checks)
            commit = commit_cpu_ms(work / "commit.sqlite3", args.calls, args.commit_kb)
            figures.setdefault(("commit", "commit"), []).append(commit)
            print(f"  round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    finally:
        await http.close()
        for s in (*targets.values(), *engines):
            s.stop()
    from benchmarks.floor_report import report

    return report(figures, checks, args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=600, help="calls per cell (x2 at 16 clients)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--commit-kb", type=int, default=4, help="bytes of the commit's row (KB)")
    ap.add_argument("--proxy-workers", type=int, help="the proxies' --workers (default: theirs)")
    ap.add_argument("--modes", default="backend_template,exact_tokens", help="proxy prompt modes")
    ap.add_argument("--no-relay-event", dest="relay_event", action="store_false")
    ap.add_argument(
        "--least",
        action="store_true",
        help="also the least durable capture (least_capture.py): what any capture costs",
    )
    ap.add_argument(
        "--streams-only", action="store_true", help="the streamed shapes only (per token)"
    )
    args = ap.parse_args(argv)
    args.shapes = [s for s in SHAPES if s.stream or not args.streams_only]
    args.targets = ["relay", *(["relay-event"] if args.relay_event else [])]
    args.targets += ["least"] if args.least else []
    args.targets += [m for m in args.modes.split(",") if m]
    t0 = time.perf_counter()
    code = asyncio.run(run(args))
    print(f"({time.perf_counter() - t0:.0f} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
