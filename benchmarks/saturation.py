"""A thousand agent sessions where the proxy is the bottleneck (issue 35): calls/s and streamed
tokens/s per proxy core, the latency the proxy adds, its event loop's lag, its memory per open
stream, and every acknowledged call and chain checked; the bare relay in the same run is the
floor, the engine direct the baseline.

Processes, all on this machine: the paced engine (``paced_engine.py``: pre-encoded events,
paced like a batching engine: time to first token, tokens per second per stream; cheap, so it
is not the limit), ``--client-procs`` load clients (``paced_client.py``: bare asyncio, events
counted, not parsed), and one target at a time, started fresh for each phase:

- ``direct``: the engine itself (the body the proxy would send it);
- ``relay``: ``bare_relay.py`` (aiohttp, one write per read: the floor); ``relay-event``: the
  same writing one SSE event at a time;
- ``proxy`` / ``proxy:N``: ``capture-proxy serve`` with its defaults (SQLite, an fsync'd
  commit per call group) and ``--workers N`` (default 1 here), on a new store.

Each phase runs ``--sessions`` agent sessions (``paced_client``'s: 512-2,048-token answers,
think time, tool outputs) for ``--duration-s``; figures are taken over the window from
``--ramp-s`` + 5 s to the end, when every session is running: tokens and calls per second,
the target's CPU (its whole process tree) per second of the window and per token and call,
time to first token and the gaps between token events as the clients read them (p50/p99; the
``added`` lines subtract the direct phase's), the event loop's lag (the target's
``capture_proxy_event_loop_lag_seconds`` over the window, p99 as a bucket's upper bound), and
memory per open stream (the target's proportional set size, a second after the last session
started and before any call ended, less before the phase, over the open streams). Then, for
the proxy, every acknowledged call is read back (``GET /captures/rollouts/<id>/chains``):
``lost`` counts those not stored, ``false links`` those whose parent is not the session's
previous call, ``missed links`` those left without one; each stored call's generation ids
must be the ones the engine sent.

``--pin`` gives the target CPUs of its own (one per worker; the others run the engine and the
clients), as a proxy has in production: on a machine of few cores the engine, the clients and
the proxy otherwise burst on the same cores at every engine step (every stream's token at
once), and the target's lag is the scheduler's. With as many workers as CPUs they share all.

``--rates`` runs the phases at several tokens per second per stream (offered load = open
streams x rate); targets take turns within each rate. The proxy is saturated when its cores
reach what it is given (1 per worker) and the tokens/s fall behind the direct phase's.

Run: ``.venv/bin/python benchmarks/saturation.py [--sessions 1024] [--rates 20,40]
[--targets direct,relay,proxy,proxy:2] [--duration-s 90]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import paced_wire as wire  # noqa: E402
from benchmarks.paced_client import BIN_S  # noqa: E402
from benchmarks.saturation_procs import (  # noqa: E402
    bucket_quantile,
    gaps_quantile,
    histogram_buckets,
    tree_cpu_s,
    tree_pids,
    tree_pss_kib,
)
from benchmarks.saturation_report import report  # noqa: E402
from benchmarks.services import (  # noqa: E402
    Service,
    cli_command,
    free_port,
    proc_cpu_s,
    raise_fd_limit,
)

HERE = Path(__file__).resolve().parent
LAG = "capture_proxy_event_loop_lag_seconds"


def target_service(name: str, engine_url: str, work: Path, args: argparse.Namespace) -> Service:
    port = free_port()
    if name.startswith("relay"):
        argv = [sys.executable, str(HERE / "bare_relay.py"), "--backend", engine_url]
        argv += ["--port", str(port), "--lag"] + (["--per-event"] if name == "relay-event" else [])
        return Service(name, argv, port, work / f"{name}.log")
    workers = name.partition(":")[2] or "1"
    store = work / f"store-{name.replace(':', '-')}-{time.monotonic_ns()}"
    argv = [*cli_command(), "serve", "--backend", engine_url, "--port", str(port)]
    argv += ["--store", str(store), "--log-level", args.proxy_log_level]
    argv += ["--workers", workers]
    return Service(name, argv, port, work / f"{name.replace(':', '-')}.log")


def client_argv(args: argparse.Namespace, url: str, name: str, proc: int, out: Path,
                sessions: int, rate: float, **over: Any) -> list[str]:  # fmt: skip
    capture = name.startswith("proxy")
    argv = [sys.executable, str(HERE / "paced_client.py"), "--url", url, "--out", str(out)]
    argv += ["--sessions", str(sessions), "--rate", f"{rate:g}", "--proc", str(proc)]
    argv += ["--run", over.get("run", f"{name.replace(':', 'w')}-r{rate:g}"), "--seed", str(proc)]
    opts = {
        "calls": args.calls, "tokens": args.tokens, "ttft-ms": args.ttft_ms,
        "think-s": args.think_s, "duration-s": args.duration_s, "ramp-s": args.ramp_s,
        "tool-output-kb": args.tool_output_kb, "system-kb": args.system_kb,
    } | over  # fmt: skip
    for key, value in opts.items():
        if key != "run":
            argv += [f"--{key}", str(value)]
    argv += ["--capture"] if capture else ["--augment"]
    return argv + ([] if args.stream else ["--no-stream"])


def pin(root: int, cpus: set[int]) -> None:
    """Run ``root``'s process tree (every thread) on ``cpus`` only."""
    for pid in tree_pids(root):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cpus)


def pin_target(args: argparse.Namespace, name: str, pid: int | None) -> set[int] | None:
    """``--pin``: the target on its own CPUs (one per worker; the relay and one worker: one),
    the engine and the clients on the others (when any are left, else with it); the CPUs
    the engine and the clients get, or None without ``--pin``."""
    cpus = sorted(os.sched_getaffinity(0))
    if not args.pin or len(cpus) < 2:
        return None
    workers = int(name.partition(":")[2] or 1) if name.startswith("proxy") else 1
    mine = set(cpus[: min(workers, len(cpus))])
    rest = set(cpus) - mine or set(cpus)
    if pid is not None:
        pin(pid, mine)
    pin(args.engine_pid, rest)
    return rest


async def run_clients(argvs: list[list[str]], work: Path) -> list[Any]:
    procs = [
        await asyncio.create_subprocess_exec(
            *a, stdout=asyncio.subprocess.DEVNULL, stderr=(work / "clients.log").open("ab")
        )  # fmt: skip
        for a in argvs
    ]
    return procs


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            return await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        return ""


async def phase(args: argparse.Namespace, http: aiohttp.ClientSession, engine: Service,
                name: str, rate: float, work: Path) -> dict[str, Any]:  # fmt: skip
    """One target at one rate: its figures (see the module docstring)."""
    svc = None if name == "direct" else target_service(name, engine.url, work, args)
    if svc is not None:
        svc.start()
        await svc.wait_healthy(http, 120)
    rest = pin_target(args, name, svc.pid if svc is not None else None)
    url = engine.url if svc is None else svc.url
    metrics_url = (
        None
        if svc is None
        else url + ("/_relay/metrics" if name.startswith("relay") else "/metrics")
    )
    quick = {"duration-s": 2, "ramp-s": 0, "think-s": "0-0", "tokens": "16-32"}
    warm = client_argv(args, url, name, 99, work / "warm.json", 16, 1000.0, run="warm", **quick)
    for p in await run_clients([warm], work):
        await p.wait()
    pid = svc.pid if svc is not None else engine.pid
    pss0 = tree_pss_kib(pid) if svc is not None else 0
    outs = [
        work / f"{name.replace(':', '-')}-r{rate:g}-c{i}.json" for i in range(args.client_procs)
    ]
    per = [args.sessions // args.client_procs + (i < args.sessions % args.client_procs)
           for i in range(args.client_procs)]  # fmt: skip
    procs = await run_clients(
        [client_argv(args, url, name, i, outs[i], per[i], rate) for i in range(args.client_procs)],
        work,
    )
    for p in procs if rest else ():
        pin(p.pid, rest)
    t0 = time.monotonic()
    w0, w1 = t0 + args.ramp_s + 5, t0 + args.duration_s
    samples: list[tuple[float, int]] = []
    marks: dict[str, Any] = {}

    def cpu_now() -> dict[str, float]:
        out = {"engine": tree_cpu_s(engine.pid), "clients": sum(tree_cpu_s(p.pid) for p in procs)}
        if svc is not None:
            out["target"] = tree_cpu_s(svc.pid)
        if name.startswith("proxy:"):  # the supervisor alone: the store's one writer
            out["writer"] = proc_cpu_s(svc.pid) or 0.0
        return out

    timeline: list[tuple[float, float]] = []  # (monotonic s, the target's CPU s so far)
    while any(p.returncode is None for p in procs):
        now = time.monotonic()
        timeline.append((now, tree_cpu_s(pid)))
        if svc is not None and now < w0:
            samples.append((now, tree_pss_kib(svc.pid)))
        for mark, at in (("start", w0), ("end", w1)):
            if mark not in marks and now >= at:
                marks[mark] = (
                    now,
                    cpu_now(),
                    await scrape(http, metrics_url) if metrics_url else "",
                )
        await asyncio.sleep(0.5)
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(p.wait(), 0.01)
    results = [json.loads(o.read_bytes()) for o in outs]
    figures = measure(name, rate, results, marks, samples, pss0)
    figures["timeline"] = _timeline(t0, timeline, results)
    if name.startswith("proxy") and svc is not None:
        figures |= await verify(http, svc.url, [c for r in results for c in r["calls"]])
    if svc is not None:
        svc.stop()
    return figures


def measure(
    name: str,
    rate: float,
    results: list[dict[str, Any]],
    marks: dict[str, Any],
    samples: list[tuple[float, int]],
    pss0: int,
) -> dict[str, Any]:
    (t_a, cpu_a, m_a), (t_b, cpu_b, m_b) = marks["start"], marks["end"]
    wall = t_b - t_a
    s_a, s_b = int(t_a) + 1, int(t_b)  # whole seconds inside the window
    tokens = sum(n for r in results for s, n in r["tokens_by_s"].items() if s_a <= int(s) < s_b)
    calls = [c for r in results for c in r["calls"]]
    ended = sorted(c[5] + c[7] for c in calls)
    done_in = sum(1 for e in ended if t_a <= e < t_b)
    gaps = np.sum([np.array(r["gaps"]) for r in results], axis=0)
    ttft = sorted(t for r in results for t in r["ttft_s"])
    first_end = ended[0] if ended else float("inf")
    mem = [(t, pss) for t, pss in samples if t < first_end]
    open_at = {int(s): 0 for r in results for s in r["open_by_s"]}
    for r in results:
        for s, n in r["open_by_s"].items():
            open_at[int(s)] += n
    mem_per_stream = None
    if mem and pss0:
        t, pss = mem[-1]
        streams = open_at.get(int(t), 0) or max(open_at.values(), default=0)
        mem_per_stream = (pss - pss0) / max(1, streams)
    cores = {k: (cpu_b[k] - cpu_a[k]) / wall for k in cpu_b}
    lag = histogram_buckets(m_a, LAG), histogram_buckets(m_b, LAG)
    return {
        "target": name, "rate": rate, "window_s": wall, "tokens_per_s": tokens / max(1, s_b - s_a),
        "calls_per_s": done_in / wall, "calls": len(calls), "cores": cores,
        "ttft_ms": [_pct(ttft, 50) * 1e3, _pct(ttft, 99) * 1e3],
        "gap_ms": [gaps_quantile(gaps, q, BIN_S) * 1e3 for q in (0.5, 0.99)],
        "lag_p99_ms": bucket_quantile(*lag, 0.99) * 1e3 if lag[1] else None,
        "lag_p50_ms": bucket_quantile(*lag, 0.5) * 1e3 if lag[1] else None,
        "mem_per_stream_kib": mem_per_stream,
        "open_streams_max": max(open_at.values(), default=0),
        "errors": {k: v for r in results for k, v in r["errors"].items()},
        "cut": sum(r["cut"] for r in results),
    }  # fmt: skip


def _timeline(
    t0: float, cpu: list[tuple[float, float]], results: list[dict[str, Any]]
) -> list[list[float]]:
    """Per second of the phase: tokens read, most streams open, the target's cores used."""
    out = []
    for (ta, ca), (tb, cb) in zip(cpu[::2], cpu[2::2], strict=False):
        second = int(ta)
        tokens = sum(r["tokens_by_s"].get(str(second), 0) for r in results)
        open_ = sum(r["open_by_s"].get(str(second), 0) for r in results)
        out.append([round(ta - t0, 1), tokens, open_, round((cb - ca) / (tb - ta), 2)])
    return out


def _pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else float("nan")


async def verify(http: aiohttp.ClientSession, url: str, calls: list[list[Any]]) -> dict[str, Any]:
    """Every acknowledged call read back by its rollout's chains (see the module docstring)."""
    by_rollout: dict[str, list[list[Any]]] = {}
    for c in calls:
        by_rollout.setdefault(c[1], []).append(c)
    out = {"lost": 0, "false_links": 0, "missed_links": 0, "problems": [], "checked": 0}
    sem = asyncio.Semaphore(4)

    async def one(rollout: str, acked: list[list[Any]]) -> None:
        async with sem, http.get(f"{url}/captures/rollouts/{rollout}/chains") as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else {"chains": []}
        stored = {c["call_id"]: c for ch in data["chains"] for c in ch["calls"]}
        acked.sort(key=lambda c: c[2])
        for i, (call_id, _, step, seed, tokens, *_) in enumerate(acked):
            out["checked"] += 1
            c = stored.get(call_id)
            if c is None:
                out["lost"] += 1
                continue
            parent = acked[i - 1][0] if i and acked[i - 1][2] == step - 1 else None
            if c.get("parent_call_id") != parent:
                out["missed_links" if c.get("parent_call_id") is None else "false_links"] += 1
            if c.get("status") != "complete" or c.get("generation_token_ids") != wire.answer_ids(
                seed, tokens
            ):
                out["problems"].append(f"{call_id}: status {c.get('status')} or ids differ")

    await asyncio.gather(*(one(r, a) for r, a in by_rollout.items()))
    return out


async def main_async(args: argparse.Namespace) -> int:
    raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="capture-saturation-"))
    port = free_port()
    argv = [sys.executable, str(HERE / "paced_engine.py"), "--port", str(port)]
    engine = Service("engine", argv + ["--processes", str(args.engine_procs)], port,
                     work / "engine.log")  # fmt: skip
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=300))
    rows: list[dict[str, Any]] = []
    try:
        engine.start()
        await engine.wait_healthy(http, 60)
        args.engine_pid = engine.pid
        for rate in [float(r) for r in args.rates.split(",")]:
            for rnd in range(args.rounds):
                for name in args.targets.split(","):
                    row = await phase(args, http, engine, name, rate, work)
                    row["round"] = rnd
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        await http.close()
        engine.stop()
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(rows, indent=1))
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return report(rows, args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=1024)
    ap.add_argument("--rates", default="20", help="tokens/s per stream, one phase each (20)")
    ap.add_argument("--targets", default="direct,relay,proxy")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the targets per rate")
    ap.add_argument("--duration-s", type=float, default=90.0)
    ap.add_argument("--ramp-s", type=float, default=10.0)
    ap.add_argument("--calls", type=int, default=4, help="calls per session")
    ap.add_argument("--tokens", default="512-2048", help="answer tokens (uniform)")
    ap.add_argument("--ttft-ms", default="100-400", help="time to first token (uniform)")
    ap.add_argument("--think-s", default="0.5-3", help="agent think time between calls")
    ap.add_argument("--tool-output-kb", type=float, default=2.0)
    ap.add_argument("--system-kb", type=float, default=4.0)
    ap.add_argument("--no-stream", dest="stream", action="store_false")
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--engine-procs", type=int, default=1)
    ap.add_argument("--proxy-log-level", default="INFO")
    ap.add_argument("--timeline", action="store_true", help="print per-second figures")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="the target on its own CPUs (one per worker), the engine and clients on the rest",
    )
    ap.add_argument("--json-out", help="write every phase's figures here (JSON)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
