"""A proxy process's memory as it serves calls, with its caches bounded small and at full size
(``cache_memory_mb``; ``config/memory_budget.py``, ``proxy/cache_bounds.py``): the caches'
estimates must hold, so a small bound keeps the process flat while the full one grows.

For each ``--budgets`` (MB; ``full``: the default, 1,232 MB): ``capture-proxy serve --workers
1`` (one process: its resident memory is the one to read) in front of the scripted engine,
``--calls`` chat calls in agent sessions of 3 (each its own rollout; an 8 KB system prompt and
4 KB tool outputs, as ``sessions.Workload``), ``--clients`` at once. Printed every sixth of
the calls: the process's resident memory (``VmRSS``) and its anonymous memory
(``smaps_rollup``), MB, and the growth per call since the first sixth.

Run: ``.venv/bin/python benchmarks/worker_memory.py [--calls 6000] [--budgets 32,full]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_sweep import sweep_session  # noqa: E402
from benchmarks.services import Service, cli_command, free_port  # noqa: E402
from benchmarks.sessions import Target, Workload, client_session  # noqa: E402

WORKLOAD = Workload(system_prompt_kb=8, tool_output_kb=4)


def memory_mb(pid: int) -> tuple[float, float]:
    """(resident, anonymous) MB of process ``pid``."""
    rss = anon = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            anon = int(line.split()[1]) / 1024
    return rss, anon


async def one_budget(work: Path, engine: Service, budget: str, args: argparse.Namespace) -> None:
    port = free_port()
    argv = [*cli_command(), "serve", "--backend", engine.url, "--port", str(port), "--workers", "1"]
    argv += ["--store", str(work / f"store-{budget}"), "--log-level", "WARNING"]
    env = {} if budget == "full" else {"CAPTURE_PROXY_CACHE_MEMORY_MB": budget}
    proxy = Service(f"proxy-{budget}", argv, port, work / f"proxy-{budget}.log", env=env)
    http = client_session(64, read_timeout_s=300)
    proxy.start()
    try:
        await proxy.wait_healthy(http, 120)
        target = Target("proxy", proxy.url, capture=True, augment=False)
        sessions = list(range(args.calls // 3))
        sessions.reverse()
        step = max(1, args.calls // 6)
        done, rows, t0 = 0, [], time.monotonic()

        async def client() -> None:
            nonlocal done
            while sessions:
                i = sessions.pop()
                results = await sweep_session(
                    http, target, f"m{budget}-{i}", f"s{i}", 3, False, WORKLOAD
                )
                if not all(r.ok for r in results):
                    raise RuntimeError(f"{proxy.name}: a call failed: {results}")
                done += len(results)
                if done // step > len(rows):
                    rows.append((done, *memory_mb(proxy.pid)))

        await asyncio.gather(*(client() for _ in range(args.clients)))
        print(f"\ncache_memory_mb {budget} ({time.monotonic() - t0:.0f} s)")
        print("| calls | resident MB | anonymous MB | KB per call since the first row |")
        print("| --- | --- | --- | --- |")
        first = rows[0]
        for calls, rss, anon in rows:
            per = (anon - first[2]) * 1024 / (calls - first[0]) if calls > first[0] else 0.0
            print(f"| {calls:,} | {rss:.0f} | {anon:.0f} | {per:.1f} |")
    finally:
        await http.close()
        proxy.stop()


async def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="worker-memory-"))
    port = free_port()
    engine = Service("engine", [*cli_command(), "scripted-engine", "--port", str(port)], port,
                     work / "engine.log")  # fmt: skip
    http = client_session(4, read_timeout_s=60)
    engine.start()
    try:
        await engine.wait_healthy(http, 120)
        for budget in args.budgets.split(","):
            await one_budget(work, engine, budget, args)
    finally:
        await http.close()
        engine.stop()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=6000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--budgets", default="32,full", help="cache_memory_mb values, MB or full")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
