"""A proxy process's memory as it serves calls, with its caches bounded small and at full size
(``cache_memory_mb``; ``config/memory_budget.py``, ``proxy/cache_bounds.py``): the caches'
estimates must hold, so a small bound keeps the process flat while the full one grows.

For each ``--budgets`` (MB; ``full``: 1,232 MB; ``default``: the setting unset, as ``serve``
sizes it) ``capture-proxy serve --workers 1`` (``--workers``; ``default``: unset) in front of
the scripted engine, ``--calls`` chat calls in agent sessions of 3 (each its own rollout; an 8
KB system prompt and 4 KB tool outputs, as ``sessions.Workload``), ``--clients`` at once;
``--prompt-mode exact_tokens``: with the scripted engine's tokenizer. Printed every sixth of the
calls: the proxy's resident memory (``VmRSS``) and its anonymous memory (``smaps_rollup``), MB,
summed over its processes, and the growth per call since the first sixth.

``--cgroup DIR``: the proxy runs in that cgroup (its pid written to ``DIR/cgroup.procs``
first; the workers inherit it), e.g. one made with a memory limit (v1:
``memory.limit_in_bytes``, v2: ``memory.max``): a proxy the kernel kills for memory is
reported with the calls it served. ``--baseline-src DIR``: each budget also with the proxy of
another source tree (a ``git archive`` of an older commit), in the same run.

Run: ``.venv/bin/python benchmarks/worker_memory.py [--calls 6000] [--budgets 32,full]
[--workers default] [--prompt-mode exact_tokens] [--cgroup DIR] [--baseline-src DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_sweep import sweep_session  # noqa: E402
from benchmarks.saturation_procs import tree_pids  # noqa: E402
from benchmarks.services import Service, baseline_env, cli_command, free_port  # noqa: E402
from benchmarks.sessions import Target, Workload, client_session  # noqa: E402
from capture_proxy.config.memory_budget import FULL_CACHE_MB  # noqa: E402

WORKLOAD = Workload(system_prompt_kb=8, tool_output_kb=4)


def memory_mb(root: int) -> tuple[float, float]:
    """(resident, anonymous) MB of process ``root`` and its descendants."""
    rss = anon = 0.0
    for pid in tree_pids(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue  # gone meanwhile
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) / 1024
        for line in rollup.splitlines():
            if line.startswith("Anonymous:"):
                anon += int(line.split()[1]) / 1024
    return rss, anon


def oom_kills(cgroup: str | None) -> int:
    """The cgroup's count of OOM kills (v1 ``memory.oom_control``, v2 ``memory.events``:
    ``oom_kill N``); 0 without one."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (Path(cgroup) / name).read_text() if cgroup else ""
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def _proxy(
    work: Path, engine: Service, budget: str, tree: str | None, args: argparse.Namespace
) -> Service:
    name = f"{budget}-{'baseline' if tree else 'this'}"
    port = free_port()
    command = [sys.executable, "-m", "capture_proxy.cli"] if tree else cli_command()
    argv = [*command, "serve", "--backend", engine.url, "--port", str(port)]
    argv += ["--store", str(work / f"store-{name}"), "--log-level", "INFO"]
    argv += [] if args.workers == "default" else ["--workers", args.workers]
    if args.prompt_mode == "exact_tokens":
        argv += ["--prompt-mode", "exact_tokens", "--tokenizer", str(work / "tokenizer")]
    if args.cgroup:  # join the cgroup, then become the proxy
        argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', args.cgroup, *argv]
    env = dict(baseline_env(tree) or {})
    if budget not in ("full", "default"):
        env["CAPTURE_PROXY_CACHE_MEMORY_MB"] = budget
    elif budget == "full":
        env["CAPTURE_PROXY_CACHE_MEMORY_MB"] = str(FULL_CACHE_MB)
    cwd = Path(tree) if tree else None
    return Service(f"proxy-{name}", argv, port, work / f"proxy-{name}.log", env=env, cwd=cwd)


async def one_budget(
    work: Path, engine: Service, budget: str, tree: str | None, args: argparse.Namespace
) -> None:
    proxy = _proxy(work, engine, budget, tree, args)
    kills_at_start = oom_kills(args.cgroup)
    http = client_session(64, read_timeout_s=300)
    proxy.start()
    try:
        try:
            await proxy.wait_healthy(http, 120)
        except RuntimeError as exc:  # it exited: e.g. a worker killed for memory at start-up
            print(f"\ncache_memory_mb {budget}, {tree or 'this tree'}: DID NOT START "
                  f"(the cgroup's oom_kill: +{oom_kills(args.cgroup) - kills_at_start}): "
                  f"{str(exc).splitlines()[-1]}")  # fmt: skip
            return
        target = Target("proxy", proxy.url, capture=True, augment=False)
        sessions = list(range(args.calls // 3))
        sessions.reverse()
        step = max(1, args.calls // 6)
        rows: list[tuple[int, float, float]] = []
        done, failed, kills, t0 = 0, 0, oom_kills(args.cgroup), time.monotonic()

        async def client() -> None:
            nonlocal done, failed
            while sessions:
                i = sessions.pop()
                results = await sweep_session(http, target, f"m-{i}", f"s{i}", 3, False, WORKLOAD)
                if proxy.proc is not None and proxy.proc.poll() is not None:
                    sessions.clear()  # the proxy died: stop
                    return
                failed += sum(not r.ok for r in results)
                done += len(results)
                if done // step > len(rows):
                    rows.append((done, *memory_mb(proxy.pid)))

        await asyncio.gather(*(client() for _ in range(args.clients)))
        source = f"the tree {tree}" if tree else "this tree"
        print(f"\ncache_memory_mb {budget}, {source} ({time.monotonic() - t0:.0f} s)")
        assert proxy.proc is not None
        if proxy.proc.poll() is not None:
            print(f"THE PROXY DIED (status {proxy.proc.returncode}) after {done:,} calls")
        killed = oom_kills(args.cgroup) - kills
        print(f"calls failed: {failed:,} of {done:,}; processes the kernel killed for memory "
              f"(the cgroup's oom_kill): {killed if args.cgroup else 'no --cgroup'}")  # fmt: skip
        log = proxy.log_path.read_text(errors="replace").splitlines()
        lines = [line for line in log if "memory this process" in line]
        print(*(line.split("capture_proxy: ", 1)[-1] for line in lines[:1]))
        if not rows:
            return
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
    if args.prompt_mode == "exact_tokens":  # the scripted engine's tokenizer
        subprocess.run([*cli_command(), "export-tokenizer", str(work / "tokenizer")], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    engine.start()
    try:
        await engine.wait_healthy(http, 120)
        for budget in args.budgets.split(","):
            for tree in (None, *([args.baseline_src] if args.baseline_src else [])):
                await one_budget(work, engine, budget, tree, args)
    finally:
        await http.close()
        engine.stop()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=6000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--budgets", default="32,full", help="cache_memory_mb: MB, full or default")
    ap.add_argument("--workers", default="1", help="serve --workers (default: unset)")
    ap.add_argument("--cgroup", help="run the proxy in this cgroup (a directory)")
    ap.add_argument("--prompt-mode", default="backend_template", help="or exact_tokens")
    ap.add_argument("--baseline-src", help="also run the proxy of this source tree")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
