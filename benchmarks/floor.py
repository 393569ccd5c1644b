"""The floor under one client's CPU per call (issue 22): the proxy vs a bare aiohttp relay and a
bare SQLite commit, in the same run.

What a captured call costs the proxy is the sum of what any aiohttp reverse proxy costs (its
server parsing the request and writing the answer, its client sending upstream and reading the
engine's answer, the event loop between them), what a durable store costs per call (one
commit, fsynced), and the capture itself. This benchmark measures the first two alone, so the
capture's own share is the difference:

- ``proxy``: ``capture-proxy serve`` with the default settings (SQLite, ``store_synchronous``
  full: an fsync per call; ``backend_template``), the process's CPU per call (all threads);
- ``relay``: ``bare_relay.py``, one aiohttp handler that relays the request to the engine and
  the answer back (whole, or chunk by chunk when streamed), on the same event loop kind, with
  no middleware, access log, parsing or store; sent the body the proxy sends upstream
  (``Target(augment=True)``), so the engine does the same work;
- ``direct``: the same calls to the engine, its CPU per call (for scale);
- ``commit``: one SQLite transaction per call in WAL mode with ``synchronous=FULL`` inserting
  one row of ``--commit-kb`` KB (a short call's stored bytes), this process's thread CPU per
  commit (user + system), on a new database in the work directory.

Calls are agent sessions of 3 chat calls, one at a time (one client), each session its own
rollout, every answer exactly 32 generation tokens (``cpu_sweep.write_policy``), non-streaming
and streaming; ``--rounds`` rounds, the targets in turn, medians printed. The lines at the end
set the floors against issue 22's one-client targets (1.0 ms non-stream, 1.5 ms stream).

Run: ``.venv/bin/python benchmarks/floor.py [--sessions 200] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_sweep import sweep_session, write_policy  # noqa: E402
from benchmarks.services import (  # noqa: E402
    Service,
    engine_service,
    free_port,
    proc_cpu_s,
    proxy_service,
)
from benchmarks.sessions import Target, Workload, client_session  # noqa: E402

TARGETS = {False: 1.0, True: 1.5}  # issue 22: ms per call at one client
RELAY = Path(__file__).resolve().with_name("bare_relay.py")


async def cpu_per_call_ms(
    http: aiohttp.ClientSession, target: Target, pid: int, stream: bool, sessions: int, tag: str
) -> float:
    """``sessions`` sessions of 3 calls through ``target``: ``pid``'s CPU ms per call."""
    workload = Workload(0.0, 0.0)
    cpu0 = proc_cpu_s(pid)
    calls = 0
    for i in range(sessions):
        rid = f"{tag}-{i:05d}"
        results = await sweep_session(http, target, rid, rid, 3, stream, workload)
        bad = [r for r in results if not r.ok]
        if bad:
            raise RuntimeError(f"{target.name}: a call failed: {bad[0].error}")
        calls += len(results)
    cpu1 = proc_cpu_s(pid)
    assert cpu0 is not None and cpu1 is not None
    return (cpu1 - cpu0) * 1000 / calls


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
    cpu = (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)
    return cpu * 1000 / commits


async def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="floor-"))
    engine = engine_service(work, policy=write_policy(work, 32))
    proxy = proxy_service(work, engine.url, work / "store", log_level="WARNING")
    rport = free_port()
    relay_argv = [sys.executable, str(RELAY), "--backend", engine.url, "--port", str(rport)]
    relay = Service("relay", relay_argv, rport, work / "relay.log")
    figures: dict[tuple[str, bool], list[float]] = {}
    http = client_session(8, read_timeout_s=120)
    try:
        for service in (engine, proxy, relay):
            service.start()
        for service in (engine, proxy, relay):
            await service.wait_healthy(http, 120)
        targets = [
            (Target("proxy", proxy.url, capture=True), proxy.pid),
            (Target("relay", relay.url, capture=False, augment=True), relay.pid),
            (Target("direct", engine.url, capture=False, augment=True), engine.pid),
        ]
        for target, pid in targets:  # warm-up, unmeasured
            for stream in (False, True):
                await cpu_per_call_ms(http, target, pid, stream, 10, f"warm-{target.name}")
        for r in range(args.rounds):
            for stream in (False, True):
                for target, pid in targets:
                    tag = f"r{r}-{int(stream)}-{target.name}"
                    ms = await cpu_per_call_ms(http, target, pid, stream, args.sessions, tag)
                    figures.setdefault((target.name, stream), []).append(ms)
            commit = commit_cpu_ms(work / "commit.sqlite3", args.sessions * 3, args.commit_kb)
            figures.setdefault(("commit", False), []).append(commit)
            print(f"  round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    finally:
        await http.close()
        for service in (relay, proxy, engine):
            service.stop()
    report(figures, args)
    return 0


def report(figures: dict[tuple[str, bool], list[float]], args: argparse.Namespace) -> None:
    def med(name: str, stream: bool) -> float:
        return statistics.median(figures[(name, stream)])

    def spread(name: str, stream: bool) -> str:
        values = figures[(name, stream)]
        return f"{min(values):.2f}-{max(values):.2f}"

    n = args.sessions * 3
    print(f"\nCPU ms per call at one client ({n} calls per cell, medians of {args.rounds})")
    commit = med("commit", False)
    print(f"  commit  one {args.commit_kb} KB row, WAL, synchronous=FULL: {commit:.2f} ms")
    for stream in (False, True):
        mode = "32-token stream" if stream else "non-stream"
        proxy, relay, direct = med("proxy", stream), med("relay", stream), med("direct", stream)
        floor = relay + commit
        print(
            f"  {mode:<16} proxy {proxy:.2f} ({spread('proxy', stream)})"
            f" | relay {relay:.2f} ({spread('relay', stream)})"
            f" | direct engine {direct:.2f}"
            f" | proxy - relay {proxy - relay:.2f} | relay + commit {floor:.2f}"
            f" vs target {TARGETS[stream]:.1f}: {floor / TARGETS[stream]:.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=200, help="sessions of 3 calls per cell")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--commit-kb", type=int, default=4, help="bytes of the commit's row (KB)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    code = asyncio.run(run(args))
    print(f"({time.perf_counter() - t0:.0f} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
