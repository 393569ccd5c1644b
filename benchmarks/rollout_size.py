"""Rollout-size benchmark (issue 22): proxy CPU per call as ONE rollout grows to N calls.

One scripted engine (zero delay) and, per shape, one proxy per store and source tree (this
tree, and ``--baseline-src`` as ``STORE@base``), each on a store of its own: SQLite (embedded,
``--store-synchronous``) and PostgreSQL (a throwaway server, ``benchmarks/infra.py``; skipped
with a message when it is not installed: ``scripts/install-postgres``). One client sends
non-streaming chat calls one at a time. Shapes, all calls in one rollout:

- ``roots``: N independent first calls (a new task each: an evaluation sweep under one id);
- ``chains``: agent sessions of ``--steps`` calls, one after the other (every call but a
  session's first continues the one before);
- ``mix``: sessions of a side call without tools (a title request: a root) then
  ``--steps - 1`` agent calls;
- ``mix-split``: ``mix`` with a new rollout every 100 calls (100 rollouts x 100 calls for
  N = 10,000), to compare with one rollout of N.

The proxies of a shape advance in lockstep, 100 calls at a time each in turn, so the machine's
noise spreads over all of them. The figure is the proxy process's CPU over a block of 100
calls (``/proc/<pid>/stat``, all threads) divided by 100; for PostgreSQL the server's CPU
(postmaster and backends) over the same block is printed beside it. Each proxy first serves
an unmeasured warm-up rollout. Afterwards each rollout's chains are read over REST and checked
(every session one chain, each title call a chain of its own), and the read is timed. After
each block the proxy answers ``HEALTH_READS`` ``/health`` requests (the store's counts), their
proxy CPU per read reported for the first and the last blocks. Each shape's ratio of calls
9,001-10,000 (the last 1,000) to calls 1-100 is marked ``pass`` or ``FAIL`` against issue 22's
1.2x. ``--repeat R`` runs each shape R times (new proxies and stores each time) and reports
medians (one 100-call block is a noisy baseline on shared cores). ``--control`` adds per
store a control proxy of this tree (``STORE~split``) that makes the same calls in lockstep
but starts a new rollout every 100 calls, on a store as large: the ratio of one rollout's CPU
per call to the control's, late against early, is the cost of the rollout's size with the
machine's noise (which both see) taken out; every block's CPU, and its
system part, go to ``blocks.json`` in the work directory. ``--py-spy NAMES`` samples those
proxies (py-spy on ``PATH``) over the first and the last 10 blocks, to see what grows (not in
a measuring run: the sampler shares the cores).

Run: ``.venv/bin/python benchmarks/rollout_size.py [--calls 10000] [--baseline-src DIR]``
(``--calls 2000`` for a quick run).

``--listing``: the store-level read of one listing page instead (no proxy): per store, 10
rollouts of agent sessions (``--steps`` calls each, every call but the first continuing the one
before) put directly, at each size of ``--listing-sizes`` calls per rollout; then the page of 10
read as ``GET /captures/rollouts`` reads it (the store's rows, the kept number of chains) and as
it read it before (every rollout's calls loaded and its chains built), CPU (this process, all
threads) and wall time per page.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from infra import PostgresServer, postgres_bin_dir  # noqa: E402
from replicas import tree_cpu_s  # noqa: E402
from services import (  # noqa: E402
    Service,
    baseline_env,
    cli_command,
    free_port,
    one_process,
    proc_cpu_s,
    proc_user_sys_s,
    raise_fd_limit,
    start_py_spy,
    stop_py_spy,
)
from sessions import CALL_ID_HEADER, MODEL, SYSTEM, TOOLS  # noqa: E402

CAPTURE = "/ng-rollout/{rollout}/training-token-capture/v1/chat/completions"
SHAPES = ("roots", "chains", "mix", "mix-split")
BLOCK = 100
#: ``/health`` reads after each block (their proxy CPU, per read, is reported beside; the
#: CPU clock ticks in 10 ms, so 100 reads resolve 0.1 ms).
HEALTH_READS = 100
#: issue 22: calls 9,001-10,000 of one rollout cost at most this times calls 1-100
RATIO_TARGET = 1.2
#: the name suffix of ``--control``'s targets
CONTROL = "~split"


@dataclass
class Target:
    """One proxy serving one shape: its calls' session plan and what it measured per block."""

    name: str
    shape: str
    service: Service
    steps: int
    rollout_prefix: str
    cpu_ms: list[float] = field(default_factory=list)  # per block, proxy CPU per call
    db_cpu_ms: list[float] = field(default_factory=list)  # per block, PostgreSQL per call
    wall_s: list[float] = field(default_factory=list)  # per block
    health_ms: list[float] = field(default_factory=list)  # per block, proxy CPU per /health
    sessions: dict[str, list[list[str]]] = field(default_factory=dict)  # rollout -> chains
    sys_ms: list[float] = field(default_factory=list)  # the system part of ``cpu_ms``
    #: ``--control``: the same calls, a new rollout every ``BLOCK`` calls
    split: bool = False
    _messages: list[dict[str, Any]] = field(default_factory=list)
    _step: int = 0
    _session: int = 0
    calls: int = 0

    def rollout_id(self) -> str:
        if self.shape == "mix-split" or self.split:
            return f"{self.rollout_prefix}-{self.calls // BLOCK}"
        return self.rollout_prefix


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, json=body) as resp:
        data = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {data}")
        return data, resp.headers[CALL_ID_HEADER]


def _echo(message: dict[str, Any]) -> dict[str, Any]:
    out = {"role": "assistant", "content": message.get("content") or ""}
    for key in ("reasoning_content", "tool_calls"):
        if message.get(key):
            out[key] = message[key]
    return out


async def next_call(session: aiohttp.ClientSession, t: Target) -> None:
    """The target's next call in its shape's plan."""
    rollout = t.rollout_id()
    chains = t.sessions.setdefault(rollout, [])
    url = t.service.url + CAPTURE.format(rollout=rollout)
    task = {"role": "user", "content": f"Task {t._session}: read module {t._session * 7 % 101}."}
    if t.shape == "roots":
        body = {"model": MODEL, "messages": [SYSTEM, task], "tools": TOOLS}
        _, call_id = await _post(session, url, body)
        chains.append([call_id])
        t._session += 1
    else:
        side = t.shape != "chains" and t._step == 0
        if side:  # a title request: no tools, a root of its own
            title = {"role": "system", "content": "Write a short title for the conversation."}
            body = {"model": MODEL, "messages": [title, task]}
            _, call_id = await _post(session, url, body)
            chains.append([call_id])
        else:
            if not t._messages:
                t._messages = [SYSTEM, task]
                chains.append([])
            body = {"model": MODEL, "messages": list(t._messages), "tools": TOOLS}
            data, call_id = await _post(session, url, body)
            chains[-1].append(call_id)
            message = data["choices"][0]["message"]
            t._messages.append(_echo(message))
            for tc in message.get("tool_calls") or []:
                out = f"output of {tc['function']['name']} at step {t._step}"
                t._messages.append({"role": "tool", "tool_call_id": tc["id"], "content": out})
            if not message.get("tool_calls"):
                t._messages.append({"role": "user", "content": "Continue."})
        t._step += 1
        split = t.shape == "mix-split" or t.split
        if t._step == t.steps or (split and (t.calls + 1) % BLOCK == 0):
            t._step, t._messages = 0, []
            t._session += 1
    t.calls += 1


async def check_chains(session: aiohttp.ClientSession, t: Target) -> tuple[str | None, float]:
    """(a mismatch or None, seconds to read the chains of every rollout of the target)."""
    read_s = 0.0
    for rollout, want in t.sessions.items():
        url = f"{t.service.url}/captures/rollouts/{rollout}/chains"
        t0 = time.perf_counter()
        async with session.get(url) as resp:
            data = await resp.json()
        read_s += time.perf_counter() - t0
        got = sorted([c["call_id"] for c in ch["calls"]] for ch in data["chains"])
        if got != sorted(w for w in want if w):
            return f"{t.name} {rollout}: {len(got)} chains, expected {len(want)}", read_s
    return None, read_s


async def health_cpu_ms(session: aiohttp.ClientSession, t: Target) -> float:
    """Proxy CPU per ``GET /health`` (its store counts), over ``HEALTH_READS`` reads."""
    cpu0 = proc_cpu_s(t.service.pid)
    for _ in range(HEALTH_READS):
        async with session.get(f"{t.service.url}/health") as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{t.name}: /health answered {resp.status}")
    cpu1 = proc_cpu_s(t.service.pid)
    assert cpu0 is not None and cpu1 is not None
    return (cpu1 - cpu0) * 1000 / HEALTH_READS


def proxy_argv(
    store: str, engine_url: str, port: int, args: argparse.Namespace, baseline: bool = False
) -> list[str]:
    argv = [*cli_command(), "serve", "--backend", engine_url, "--port", str(port)]
    argv += ["--store", store, "--log-level", "WARNING"]
    if not store.startswith("postgresql://"):
        argv += ["--store-synchronous", args.store_synchronous]
    return one_process(argv, args.baseline_src if baseline else None)


async def _measure_blocks(
    shape: str,
    targets: list[Target],
    args: argparse.Namespace,
    pg_pid: int | None,
    session: aiohttp.ClientSession,
    work: Path,
) -> None:
    """The shape's calls, ``BLOCK`` per target in turn, each block's CPU and wall time; with
    ``--py-spy NAMES`` those targets are sampled over the first and the last 10 blocks."""
    blocks = args.calls // BLOCK
    spied = [t for t in targets if t.name in (args.py_spy or "").split(",")]
    # the first 10 blocks and the last 10 (those after the first 10)
    windows = {0: "first", max(10, blocks - 10): "last"}
    ends = {min(10, blocks) - 1, blocks - 1}
    spies: list[tuple[Any, str]] = []
    for block in range(blocks):
        if block in windows and block < blocks:
            outs = [str(work / f"{shape}-{t.name}-{windows[block]}.pyspy") for t in spied]
            spies = [(start_py_spy(o, t.service.pid), o) for o, t in zip(outs, spied, strict=True)]
        for t in targets:
            cpu0, db0, t0 = proc_user_sys_s(t.service.pid), 0.0, time.perf_counter()
            if pg_pid and t.name.startswith("postgres"):
                db0 = tree_cpu_s(pg_pid)
            for _ in range(BLOCK):
                await next_call(session, t)
            t.wall_s.append(time.perf_counter() - t0)
            cpu1 = proc_user_sys_s(t.service.pid)
            assert cpu0 is not None and cpu1 is not None
            t.cpu_ms.append((sum(cpu1) - sum(cpu0)) * 1000 / BLOCK)
            t.sys_ms.append((cpu1[1] - cpu0[1]) * 1000 / BLOCK)
            if pg_pid and t.name.startswith("postgres"):
                t.db_cpu_ms.append((tree_cpu_s(pg_pid) - db0) * 1000 / BLOCK)
            t.health_ms.append(await health_cpu_ms(session, t))
        if block in ends:
            for proc, out in spies:
                stop_py_spy(proc, out)
            spies = []
        if (block + 1) % 10 == 0:
            print(f"  {shape}: {(block + 1) * BLOCK} calls", file=sys.stderr)


async def run_shape(
    shape: str,
    args: argparse.Namespace,
    engine: Service,
    work: Path,
    pg: PostgresServer | None,
    session: aiohttp.ClientSession,
) -> list[Target]:
    stores = ["sqlite"] + (["postgres"] if pg is not None else [])
    codes = [""] + (["@base"] if args.baseline_src else [])
    if args.control and shape != "mix-split":
        codes.append(CONTROL)
    targets = []
    for store in stores:
        for code in codes:
            name = f"{store}{code}"
            where = pg.create_database() if pg is not None and store == "postgres" else None
            path = where or str(work / f"store-{shape}-{name}")
            port = free_port()
            env = baseline_env(args.baseline_src) if code == "@base" else None
            log = work / f"{shape}-{name}.log"
            argv = proxy_argv(path, engine.url, port, args, baseline=env is not None)
            service = Service(name, argv, port, log, env=env)
            rollout = f"{shape}-{name.replace('@', '.').replace(CONTROL, '.split')}"
            split = code == CONTROL
            targets.append(Target(name, shape, service, args.steps, rollout, split=split))
    try:
        for t in targets:
            t.service.start()
        for t in targets:
            await t.service.wait_healthy(session, 120)
            warm = Target(t.name, "chains", t.service, args.steps, "warmup-" + t.rollout_prefix)
            for _ in range(2 * args.steps):
                await next_call(session, warm)
        pg_pid = pg.proc.pid if pg is not None and pg.proc is not None else None
        await _measure_blocks(shape, targets, args, pg_pid, session, work)
        for t in targets:
            problem, read_s = await check_chains(session, t)
            if problem:
                raise RuntimeError(problem)
            t.read_ms_per_call = read_s * 1000 / t.calls  # type: ignore[attr-defined]
    finally:
        for t in targets:
            t.service.stop()
    return targets


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _report_controls(
    results: dict[str, list[list[Target]]], last: int, lo: int, n: int
) -> None:
    """Each one-rollout target against its control (``CONTROL``): CPU per call, first and last
    blocks, and their ratio."""
    controls = [
        (shape, i, j)
        for shape, runs in results.items()
        for i, t in enumerate(runs[0])
        for j, c in enumerate(runs[0])
        if c.name == t.name + CONTROL
    ]
    if controls:
        print(
            f"against the control ({CONTROL}: the same proxy code and calls in lockstep, a new "
            f"rollout every {BLOCK} calls, its store as large): CPU per call of one rollout / "
            f"the control's, calls 1-{last * BLOCK} and {lo}-{n}; their ratio is what the "
            "rollout's size costs, the machine's noise taken out"
        )
    for shape, i, j in controls:
        runs = results[shape]
        r0 = statistics.median(
            _mean(run[i].cpu_ms[:last]) / _mean(run[j].cpu_ms[:last]) for run in runs
        )
        r1 = statistics.median(
            _mean(run[i].cpu_ms[-last:]) / _mean(run[j].cpu_ms[-last:]) for run in runs
        )
        verdict = "pass" if r1 <= RATIO_TARGET * r0 else "FAIL"
        print(
            f"  {shape:<10} {runs[0][i].name:<14} {r0:5.2f}x | {r1:5.2f}x | "
            f"{r1 / r0:5.2f}x {verdict}"
        )


def report(results: dict[str, list[list[Target]]], args: argparse.Namespace) -> None:
    """``results``: per shape, per repeat, its targets (the same names in every repeat)."""
    n = args.calls
    first_run = next(iter(results.values()))[0]
    last = min(10, len(first_run[0].cpu_ms))
    reps = len(next(iter(results.values())))
    print(f"\nrollout size: {n} calls in one rollout, one client, non-streaming, zero delay")
    lo = n - last * BLOCK + 1
    print(
        f"proxy CPU ms/call, calls 1-100 | calls {lo}-{n} | ratio (target <= {RATIO_TARGET}x)"
        + (f", medians of {reps} repeats (each a new proxy and store)" if reps > 1 else "")
        + "; calls/s in the same buckets; chains read ms/call; system CPU ms/call in calls "
        f"1-{last * BLOCK} and the last; proxy CPU ms per /health read after the first and "
        "the last blocks"
    )
    for shape, runs in results.items():
        for i, t0 in enumerate(runs[0]):
            ts = [run[i] for run in runs]
            first = statistics.median(t.cpu_ms[0] for t in ts)
            end = statistics.median(_mean(t.cpu_ms[-last:]) for t in ts)
            cps0 = statistics.median(BLOCK / t.wall_s[0] for t in ts)
            cps1 = statistics.median(BLOCK * last / sum(t.wall_s[-last:]) for t in ts)
            verdict = "pass" if end <= RATIO_TARGET * first else "FAIL"
            read = statistics.median(t.read_ms_per_call for t in ts)  # type: ignore[attr-defined]
            s0 = statistics.median(_mean(t.sys_ms[:last]) for t in ts)
            s1 = statistics.median(_mean(t.sys_ms[-last:]) for t in ts)
            line = (
                f"  {shape:<10} {t0.name:<14} {first:6.2f} | {end:6.2f} | {end / first:5.2f}x"
                f" {verdict}   {cps0:6.0f} | {cps1:6.0f} calls/s   read {read:.3f}"
                f"   system {s0:4.2f} | {s1:4.2f}"
            )
            h0 = statistics.median(t.health_ms[0] for t in ts)
            h1 = statistics.median(_mean(t.health_ms[-last:]) for t in ts)
            line += f"   /health {h0:5.2f} | {h1:5.2f} | {h1 / max(h0, 1e-9):5.2f}x"
            if t0.db_cpu_ms:
                d0 = statistics.median(t.db_cpu_ms[0] for t in ts)
                d1 = statistics.median(_mean(t.db_cpu_ms[-last:]) for t in ts)
                line += f"   postgres {d0:5.2f} | {d1:5.2f} | {d1 / max(d0, 1e-9):5.2f}x"
            print(line)
            if reps > 1:
                each = " ".join(f"{_mean(t.cpu_ms[-last:]) / t.cpu_ms[0]:.2f}x" for t in ts)
                print(f"  {'':<10} {'':<14} each repeat: {each}")
    _report_controls(results, last, lo, n)
    if "mix" in results and "mix-split" in results:
        print(f"all {n} calls: CPU ms/call, {n // BLOCK} rollouts x {BLOCK} vs one rollout")
        for i, one in enumerate(results["mix"][0]):
            a = statistics.median(_mean(run[i].cpu_ms) for run in results["mix"])
            b = statistics.median(_mean(run[i].cpu_ms) for run in results["mix-split"])
            print(f"  {one.name:<14} one {a:6.2f} | split {b:6.2f} | one / split {a / b:5.2f}x")
    step = max(1, len(first_run[0].cpu_ms) // 10)
    print(f"proxy CPU ms/call per {BLOCK}-call block, every {step * BLOCK} calls (first repeat):")
    for shape, runs in results.items():
        for t in runs[0]:
            cells = " ".join(f"{c:5.2f}" for c in t.cpu_ms[::step])
            print(f"  {shape:<10} {t.name:<14} {cells}")


async def run(args: argparse.Namespace) -> int:
    if args.calls % BLOCK or args.calls < 2 * BLOCK:
        raise SystemExit(f"--calls: a multiple of {BLOCK}, at least {2 * BLOCK}")
    raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="rollout-size-"))
    port = free_port()
    argv = [*cli_command(), "scripted-engine", "--port", str(port)]
    engine = Service("engine", argv, port, work / "engine.log")
    pg = None
    if not args.no_postgres:
        bin_dir = postgres_bin_dir()
        if bin_dir is None or not (bin_dir / "postgres").exists():
            print("PostgreSQL is not installed (scripts/install-postgres): SQLite only")
        else:
            pg = PostgresServer(bin_dir)
            pg.start(deadline_s=60)
    results: dict[str, list[list[Target]]] = {}
    try:
        engine.start()
        timeout = aiohttp.ClientTimeout(total=args.call_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await engine.wait_healthy(session, 60)
            for shape in args.shapes.split(","):
                if shape not in SHAPES:
                    raise SystemExit(f"--shapes: unknown shape {shape!r} (known: {SHAPES})")
                for r in range(args.repeat):
                    (work / f"r{r}").mkdir(exist_ok=True)
                    runs = results.setdefault(shape, [])
                    runs.append(await run_shape(shape, args, engine, work / f"r{r}", pg, session))
    finally:
        engine.stop()
        if pg is not None:
            pg.stop()
    report(results, args)
    raw = {
        shape: [{t.name: {"cpu_ms": t.cpu_ms, "sys_ms": t.sys_ms} for t in run} for run in runs]
        for shape, runs in results.items()
    }
    (work / "blocks.json").write_text(json.dumps(raw))
    print(f"work directory (logs, SQLite stores, blocks.json: every block's figures): {work}")
    return 0


async def listing(args: argparse.Namespace) -> int:
    """``--listing`` (module docstring)."""
    import numpy as np

    from capture_proxy.core.chains import build_chains
    from capture_proxy.core.records import CallRecord
    from capture_proxy.proxy.recorder import Recorder
    from capture_proxy.rest.reads import _listing_json, snapshot_records
    from capture_proxy.rest.rollout_state import RolloutState
    from capture_proxy.store.postgres import PostgresStore
    from capture_proxy.store.sqlite import SQLiteStore

    def session_calls(rid: str, size: int) -> list[CallRecord]:
        out: list[CallRecord] = []
        for n in range(size):
            prev = out[-1] if n % args.steps else None
            head = [] if prev is None else [*prev.prompt_token_ids, *prev.generation_token_ids]
            prompt = np.asarray([*head, 1000 + n % 7, 2000 + n], dtype=np.uint32)
            out.append(
                CallRecord(
                    call_id=f"{rid}-{n:05d}",
                    rollout_id=rid,
                    created_at=float(n),
                    prompt_token_ids=prompt,
                    generation_token_ids=np.asarray([3000 + n, 4], dtype=np.uint32),
                    generation_log_probs=np.asarray([-0.5, -0.1], dtype=np.float32),
                    parent_call_id=None if prev is None else prev.call_id,
                    linking={"verdict": "root" if prev is None else "resolved"},
                )
            )
        return out

    async def page(store: Any, *, build: bool) -> tuple[float, float]:
        recorder = Recorder(store)
        cpu, wall = time.process_time(), time.perf_counter()
        infos = await store.list_rollouts(limit=10)
        rows = []
        for info in infos:
            records = None
            if build or info.num_chains is None:
                records = snapshot_records(info, await store.get_rollout_calls(info.rollout_id))
            rows.append((info, records, RolloutState(info, recorder)))
        body = _listing_json(rows, None)
        assert body.count(b'"num_chains"') == len(infos) == 10
        if build:  # the kept figure is the one built
            assert all(len(build_chains(i.rollout_id, r or []).chains) for i, r, _ in rows)
        return (time.process_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3

    work = Path(tempfile.mkdtemp(prefix="listing-size-"))
    bin_dir = postgres_bin_dir()
    pg = PostgresServer(bin_dir) if bin_dir is not None and not args.no_postgres else None
    if pg is not None:
        pg.start(deadline_s=60)
    print("store       calls/rollout  read           cpu ms/page  wall ms/page")
    try:
        for size in (int(x) for x in args.listing_sizes.split(",")):
            stores: list[tuple[str, Any]] = [
                ("sqlite", SQLiteStore(work / f"s{size}", synchronous="normal"))
            ]
            if pg is not None:
                stores.append(("postgresql", PostgresStore(pg.create_database(), pool_size=2)))
            for name, store in stores:
                await store.open()
                try:
                    for r in range(10):
                        for rec in session_calls(f"r{r:02d}", size):
                            await store.put_call(rec)
                    for build, label, reps in ((False, "kept figures", 50), (True, "built", 3)):
                        await page(store, build=build)  # warm
                        got = [await page(store, build=build) for _ in range(reps)]
                        cpu = sum(g[0] for g in got) / reps
                        wall = sum(g[1] for g in got) / reps
                        print(f"{name:<11} {size:>13}  {label:<13} {cpu:>12.2f} {wall:>13.2f}")
                finally:
                    await store.close()
    finally:
        if pg is not None:
            pg.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=10_000, help="calls in the one rollout")
    p.add_argument("--steps", type=int, default=10, help="calls per session (chains, mix)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + str(SHAPES))
    p.add_argument("--no-postgres", action="store_true", help="SQLite only")
    p.add_argument("--store-synchronous", default="normal", choices=("full", "normal"))
    p.add_argument("--call-timeout-s", type=float, default=120)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each shape this many times (new proxies and stores), medians reported",
    )
    p.add_argument(
        "--baseline-src",
        metavar="DIR",
        help="also run every store from this source tree (e.g. a git archive of the fork "
        "point) as STORE@base, in the same run",
    )
    p.add_argument(
        "--py-spy",
        metavar="NAMES",
        help="sample these proxies (e.g. sqlite,postgres) with py-spy (on PATH) over the "
        "first and the last 10 blocks of each shape; raw stacks in the work directory",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help=f"per store, a control proxy (STORE{CONTROL}) in lockstep: the same calls, a new "
        f"rollout every {BLOCK}",
    )
    p.add_argument("--listing", action="store_true", help="the listing read (docstring)")
    p.add_argument("--listing-sizes", default="100,5000", help="calls per rollout, of 10")
    args = p.parse_args(argv)
    return asyncio.run(listing(args) if args.listing else run(args))


if __name__ == "__main__":
    sys.exit(main())
