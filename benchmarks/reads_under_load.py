"""The read API under load (issue "A thousand agents on many engines"; rule "every read bounded
in time"): how long a trainer's reads take while the proxy relays many streams, against the
same reads on the same store with no load, in one run.

Processes, all on this machine: the paced engine (``paced_engine.py``: cheap, paced like a
batching engine), ``capture-proxy serve --workers W`` on a new store, and ``--client-procs``
load clients (``paced_client.py``: agent sessions under the capture path, no think time, so
about ``--calls-in-flight`` streaming calls are in flight the whole time). The reads are sent
from this process, ``--readers`` loops in parallel, each one read at a time in turn:

- ``list``: ``GET /captures/rollouts?limit=100``;
- ``summary``: ``GET /captures/rollouts/<id>``;
- ``chains``: ``GET /captures/rollouts/<id>/chains``;
- ``npz``: ``GET /captures/rollouts/<id>/chains?format=npz``;

each of a rollout stored before the phases (``--seed-sessions`` sessions of ``--seed-calls``
calls), so both phases read the same rows. Phases: ``idle`` (no load, ``--idle-s``), then
``load`` (the clients ramp up over ``--ramp-s``; reads are timed from then on for
``--duration-s``). A read's time is from sending it to its body read whole; a read that does
not answer 200 is counted by its status (a 503 ``read_timeout`` is the deadline,
``Settings.read_api_timeout_s``; the slowest of them is printed). Printed per kind and phase:
count, p50, p99 and max (ms) of the 200s, and the load phase's p50/p99 over the idle phase's
(``x``); the proxy's event-loop lag over each phase (``capture_proxy_event_loop_lag_seconds``,
p99 as a bucket's upper bound; with workers, the one that answered the scrape).

``--src DIR`` runs the proxy from another source tree (e.g. ``git archive <commit> | tar -x -C
DIR``: a before/after pair of runs); by default from this one (``PYTHONPATH`` and the
working directory, which its workers' ``python -m`` imports from first).

Ports: ``--port-base`` and the next one (the engine, the proxy), loopback only. Every wait is
bounded: start-up deadlines, a client timeout on each read (``--read-client-timeout-s``), the
clients' own duration and drain.

Run: ``.venv/bin/python benchmarks/reads_under_load.py [--calls-in-flight 800] [--workers 2]
[--duration-s 60]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.saturation_procs import bucket_quantile, histogram_buckets  # noqa: E402
from benchmarks.services import Service, cli_command, raise_fd_limit  # noqa: E402

HERE = Path(__file__).resolve().parent
LAG = "capture_proxy_event_loop_lag_seconds"
KINDS = ("list", "summary", "chains", "npz")


def _paths(rollout_id: str) -> dict[str, str]:
    base = f"/captures/rollouts/{rollout_id}"
    return {
        "list": "/captures/rollouts?limit=100",
        "summary": base,
        "chains": base + "/chains",
        "npz": base + "/chains?format=npz",
    }


def client_argv(args: argparse.Namespace, url: str, out: Path, proc: int, **over: Any) -> list[str]:
    """A ``paced_client`` process under the capture path; ``over``: its options to change."""
    opts: dict[str, Any] = {
        "sessions": args.calls_in_flight // args.client_procs,
        "calls": args.calls,
        "tokens": args.tokens,
        "rate": args.rate,
        "ttft-ms": "100-400",
        "think-s": "0-0",
        "duration-s": args.duration_s + args.ramp_s,
        "ramp-s": args.ramp_s,
        "drain-s": 30,
        "run": "load",
        "proc": proc,
        "seed": proc + 1,
    } | over
    argv = [sys.executable, str(HERE / "paced_client.py"), "--url", url, "--out", str(out)]
    for key, value in opts.items():
        argv += [f"--{key}", str(value)]
    return argv + ["--capture"]


async def run_client(argv: list[str], work: Path) -> asyncio.subprocess.Process:
    log = (work / "clients.log").open("ab")
    try:
        return await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=log
        )
    finally:
        log.close()


async def scrape_lag(http: aiohttp.ClientSession, url: str) -> dict[float, float]:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status == 200:
                return histogram_buckets(await resp.text(), LAG)
    return {}


class Reads:
    """Times of the read API's reads in one phase, by kind (seconds), and their failures."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        self.failed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        #: the longest time to an answer that was not a 200 (a 503 included), by kind
        self.failed_max: dict[str, float] = defaultdict(float)

    async def one(self, http: aiohttp.ClientSession, url: str, kind: str, path: str,
                  timeout_s: float) -> None:  # fmt: skip
        t0 = time.monotonic()
        try:
            async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                body = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.failed[kind][type(exc).__name__] += 1
            return
        if status != 200:
            self.failed_max[kind] = max(self.failed_max[kind], time.monotonic() - t0)
            code = ""
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                import json

                code = json.loads(body)["error"]["code"]
            self.failed[kind][f"{status} {code}".strip()] += 1
            return
        self.times[kind].append(time.monotonic() - t0)

    async def loop(self, http: aiohttp.ClientSession, url: str, rollouts: list[str],
                   until: float, timeout_s: float, seed: int) -> None:  # fmt: skip
        rng = random.Random(seed)
        while time.monotonic() < until:
            paths = _paths(rng.choice(rollouts))
            for kind in KINDS:
                if time.monotonic() >= until:
                    return
                await self.one(http, url, kind, paths[kind], timeout_s)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def timed_phase(
    http: aiohttp.ClientSession, url: str, rollouts: list[str], seconds: float,
    args: argparse.Namespace,
) -> tuple[Reads, float | None]:  # fmt: skip
    """Reads for ``seconds`` from ``--readers`` loops; the loop lag's p99 (ms) meanwhile."""
    reads = Reads()
    print(f"  reads from {time.strftime('%H:%M:%S')} for {seconds:g} s", flush=True)
    lag0 = await scrape_lag(http, url)
    until = time.monotonic() + seconds
    await asyncio.gather(
        *(
            reads.loop(http, url, rollouts, until, args.read_client_timeout_s, i)
            for i in range(args.readers)
        )
    )
    lag1 = await scrape_lag(http, url)
    lag = bucket_quantile(lag0, lag1, 0.99) * 1e3 if lag1 else None
    return reads, lag


async def seed_store(url: str, work: Path, args: argparse.Namespace) -> list[str]:
    """Rollouts to read: ``--seed-sessions`` whole sessions, stored before the phases."""
    out = work / "seed.json"
    argv = client_argv(
        args, url, out, 99, sessions=args.seed_sessions, calls=args.seed_calls, rate=5000,
        **{"duration-s": args.seed_s, "ramp-s": 0, "ttft-ms": "1-5", "run": "seed"},
    )  # fmt: skip
    proc = await run_client(argv, work)
    await asyncio.wait_for(proc.wait(), 300)
    import json

    calls = json.loads(out.read_bytes())["calls"]
    counts: dict[str, int] = defaultdict(int)
    for c in calls:
        counts[c[1]] += 1
    return sorted(r for r, n in counts.items() if n == args.seed_calls)


def report(phases: dict[str, tuple[Reads, float | None]]) -> None:
    idle = phases["idle"][0]
    print(f"{'phase':<6} {'read':<8} {'n':>5} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} "
          f"{'p50 x':>7} {'p99 x':>7}  failed")  # fmt: skip
    for name, (reads, _) in phases.items():
        for kind in KINDS:
            t = reads.times.get(kind, [])
            p50, p99, top = _pct(t, 0.5) * 1e3, _pct(t, 0.99) * 1e3, max(t, default=0) * 1e3
            b = idle.times.get(kind, [])
            x50 = p50 / (_pct(b, 0.5) * 1e3) if b else float("nan")
            x99 = p99 / (_pct(b, 0.99) * 1e3) if b else float("nan")
            failed = dict(reads.failed.get(kind, {})) or ""
            if kind in reads.failed_max:
                failed = f"{failed} (slowest {reads.failed_max[kind] * 1e3:.0f} ms)"
            print(f"{name:<6} {kind:<8} {len(t):>5} {p50:>9.1f} {p99:>9.1f} {top:>9.1f} "
                  f"{x50:>7.1f} {x99:>7.1f}  {failed}")  # fmt: skip
    for name, (_, lag) in phases.items():
        print(f"event-loop lag p99 ({name}): {'-' if lag is None else f'{lag:.0f} ms'}")


async def main_async(args: argparse.Namespace) -> int:
    raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="capture-reads-"))
    port_e, port_p = args.port_base, args.port_base + 1
    engine = Service(
        "engine",
        [sys.executable, str(HERE / "paced_engine.py"), "--port", str(port_e)],
        port_e,
        work / "engine.log",
    )
    argv = [*cli_command(), "serve", "--backend", engine.url, "--port", str(port_p)]
    argv += ["--store", str(work / "store"), "--workers", str(args.workers)]
    argv += ["--log-level", "WARNING", *args.proxy_arg]
    # The proxy (its supervisor and workers) runs the code of ``--src``, else of this tree.
    src = Path(args.src).resolve() if args.src else HERE.parent
    proxy = Service(
        "proxy", argv, port_p, work / "proxy.log", env={"PYTHONPATH": str(src)}, cwd=src
    )
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.readers + 4))
    procs: list[asyncio.subprocess.Process] = []
    try:
        engine.start()
        await engine.wait_healthy(http, 60)
        proxy.start()
        await proxy.wait_healthy(http, 120)
        rollouts = await seed_store(proxy.url, work, args)
        print(f"{len(rollouts)} seeded rollouts of {args.seed_calls} calls; workers "
              f"{args.workers}; {args.calls_in_flight} calls in flight; readers {args.readers}",
              flush=True)  # fmt: skip
        if not rollouts:
            print(proxy.tail())
            return 1
        phases = {"idle": await timed_phase(http, proxy.url, rollouts, args.idle_s, args)}
        outs = [work / f"load-{i}.json" for i in range(args.client_procs)]
        procs = [await run_client(client_argv(args, proxy.url, o, i), work)
                 for i, o in enumerate(outs)]  # fmt: skip
        await asyncio.sleep(args.ramp_s)
        phases["load"] = await timed_phase(http, proxy.url, rollouts, args.duration_s, args)
        for p in procs:
            await asyncio.wait_for(p.wait(), 60)
        import json

        results = [json.loads(o.read_bytes()) for o in outs if o.exists()]
        calls = sum(len(r["calls"]) for r in results)
        errors: dict[str, int] = defaultdict(int)
        for r in results:
            for k, v in r["errors"].items():
                errors[k] += v
        opened = max((max(r["open_by_s"].values(), default=0) for r in results), default=0)
        print(f"load: {calls} calls answered, most open at once per client {opened}, "
              f"errors {dict(errors) or 0}")  # fmt: skip
        report(phases)
        return 0
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(p.wait(), 10)
        await http.close()
        proxy.stop()
        engine.stop()
        if args.keep:
            print(f"work directory: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls-in-flight", type=int, default=800, help="streams kept open (800)")
    ap.add_argument("--workers", type=int, default=2, help="serve --workers (2)")
    ap.add_argument("--duration-s", type=float, default=60.0, help="load phase's reads (60)")
    ap.add_argument("--idle-s", type=float, default=20.0, help="idle phase's reads (20)")
    ap.add_argument("--ramp-s", type=float, default=10.0, help="load ramp before reads (10)")
    ap.add_argument("--readers", type=int, default=2, help="read loops in parallel (2)")
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--calls", type=int, default=4, help="calls per load session (4)")
    ap.add_argument("--tokens", default="200-600", help="answer tokens, uniform (200-600)")
    ap.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream (20)")
    ap.add_argument("--seed-sessions", type=int, default=24)
    ap.add_argument("--seed-calls", type=int, default=16, help="calls per read rollout (16)")
    ap.add_argument("--seed-s", type=float, default=8.0, help="seeding sessions start (8)")
    ap.add_argument("--read-client-timeout-s", type=float, default=120.0)
    ap.add_argument("--port-base", type=int, default=43100, help="engine; proxy the next one")
    ap.add_argument("--proxy-arg", action="append", default=[], help="one more serve argument")
    ap.add_argument("--src", help="run the proxy from this source tree (a baseline)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
