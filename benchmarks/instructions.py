"""Instructions per captured call (issue 22): the proxy under callgrind, A/B without the noise.

CPU time on a shared 2-core machine moves by 10-30% from one run to the next (the engine, the
load client and other work share the cores, and every figure is counted in 10 ms ticks).
Instructions do not: callgrind counts every instruction the proxy process executes (all its
threads; the kernel's work for its system calls is not counted) and the count repeats within
0.1%. So a change of 1% is seen in one run, where a CPU-time A/B needs dozens.

One scripted engine (zero delay) and one proxy per source tree (this one, and
``--baseline-src`` as ``base``), each run in turn under ``valgrind --tool=callgrind`` on a
store of its own (SQLite, the default settings: fsync per call). Instrumentation is off while
the proxy starts and serves an unmeasured warm-up; it is switched on (``callgrind_control``)
for ``--sessions`` agent sessions of 3 calls, one at a time, non-streaming and streaming,
then off. The figure is the instructions counted over the measured calls / the calls. Every
call must succeed.

``--rollout-size N`` (issue 22's rollout size, without the noise): every session, warm-up and
measured, in ONE rollout, and N calls of such sessions sent into it first with instrumentation
off; the figure is then the instructions per call at calls N+1 ... of one rollout. Run once with
0 and once with 9,000 for the ratio (``--modes whole``: the non-streaming calls only).
``--steps 1``: sessions of one call (every call a root). ``--postgres``: the proxy on a
PostgreSQL store (a throwaway server, ``benchmarks/infra.py``; the server's own work is not
counted, only the proxy process's). ``--tools-from FILE``: every request offers the tools of a
recorded harness session (e.g. OpenCode's 21 KB, ``tests/fixtures/opencode/logs/*.jsonl``)
instead of two small ones. ``--answer-tokens N``: the engine answers every call with exactly N
generation tokens (``cpu_sweep.write_policy``; a streamed call is then N + 3 events), so two
runs, e.g. 32 and 512, give the instructions per streamed token: (I(512) - I(32)) / 480.
``--relay-event``: also the floor, ``bare_relay.py --per-event`` (one write per SSE event) in
front of the same engine, measured the same way (as ``relay``; its client sends the body the
proxy would send upstream), so the proxy's instructions are read against the relay's.
``--workers N``: the proxy as ``serve --workers N`` (the supervisor, the store's one writer, and
N worker processes), every process under callgrind (``--trace-children``), the figure the sum
of all of them: what the hop of each put to the supervisor costs, against ``--workers 1``.

Needs valgrind (Debian's ``valgrind`` package; the benchmark says so and exits 2 without it).
Under callgrind the proxy runs ~50x slower: 30 sessions take about a minute per tree and mode.

Run: ``.venv/bin/python benchmarks/instructions.py [--sessions 30] [--baseline-src DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_sweep import sweep_session, write_policy  # noqa: E402
from benchmarks.infra import PostgresServer, postgres_bin_dir  # noqa: E402
from benchmarks.saturation_procs import tree_pids  # noqa: E402
from benchmarks.services import (  # noqa: E402
    ROOT,
    Service,
    cli_command,
    engine_service,
    free_port,
    proxy_service,
)
from benchmarks.sessions import (  # noqa: E402
    CallResult,
    Target,
    Workload,
    client_session,
    recorded_tools,
)

#: The bare relay (``floor.py``'s ``relay-event``) and its name among the trees.
RELAY = Path(__file__).resolve().with_name("bare_relay.py")
RELAY_TREE = "relay"

#: What callgrind prints at exit: the instructions counted while instrumentation was on.
_COLLECTED = re.compile(r"Collected : (\d+)")


@dataclass
class Figure:
    tree: str
    stream: bool
    calls: int
    instructions: int

    @property
    def per_call_m(self) -> float:
        return self.instructions / self.calls / 1e6


def _under_callgrind(proxy: Service, src: Path) -> None:
    """Run ``proxy`` under callgrind, importing ``capture_proxy`` from ``src`` (``-c`` puts
    no directory of its own first on sys.path, so ``src`` wins over the installed tree), its
    child processes too (``serve --workers``' workers: a file each). The relay (a script, its
    argv ``python bare_relay.py ...``) runs as it is."""
    if proxy.name == RELAY_TREE:
        program = proxy.argv
    else:
        code = (
            f"import sys; sys.path.insert(0, {str(src)!r}); "
            "from capture_proxy.cli import main; sys.exit(main())"
        )
        program = [sys.executable, "-c", code, *proxy.argv[1:]]  # after the capture-proxy script
    proxy.argv = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--trace-children=yes",
        f"--callgrind-out-file={proxy.log_path.with_suffix('')}.%p.callgrind",
        *program,
    ]


async def measure(
    tree: str,
    src: Path,
    stream: bool,
    sessions: int,
    rollout_size: int | None = None,
    *,
    steps: int = 3,
    store: str | None = None,
    workload: Workload | None = None,
    answer_tokens: int | None = None,
    exact_tokens: Path | None = None,
    workers: int = 1,
) -> Figure:
    """One proxy from ``src`` under callgrind: the instructions of ``sessions`` sessions of
    ``steps`` calls (``rollout_size``: all in one rollout, after that many calls sent into it
    unmeasured), on ``store`` (default: a new SQLite store in the work directory), with
    ``workload``'s requests; ``answer_tokens``: every answer that long (None: the scripted
    engine's default policy); ``exact_tokens``: the proxy in exact-token mode with this
    tokenizer directory (``capture-proxy export-tokenizer``); ``workers``: its ``--workers``
    (every process counted)."""
    work = Path(tempfile.mkdtemp(prefix=f"instructions-{tree}-"))
    policy = write_policy(work, answer_tokens) if answer_tokens else None
    engine = engine_service(work, policy=policy)
    if tree == RELAY_TREE:
        port = free_port()
        argv = [sys.executable, str(RELAY), "--backend", engine.url, "--port", str(port)]
        proxy = Service(RELAY_TREE, [*argv, "--per-event"], port, work / "relay.log")
        target = Target(RELAY_TREE, proxy.url, capture=False, augment=True)
    else:
        proxy = proxy_service(work, engine.url, store or work / "store", workers=workers)
        if exact_tokens is not None:
            proxy.argv += ["--prompt-mode", "exact_tokens", "--tokenizer", str(exact_tokens)]
        target = Target("backend_template", proxy.url, capture=True)
    _under_callgrind(proxy, src)
    http = client_session(8, read_timeout_s=600)
    try:
        engine.start()
        await engine.wait_healthy(http, 60)
        proxy.start()
        await proxy.wait_healthy(http, 600)
        one = f"one-{tree}-{int(stream)}" if rollout_size is not None else None
        load = (http, target, stream, workload or Workload())
        results = await _sessions(*load, 10, f"warm-{tree}", one, steps)
        if rollout_size:
            fill = -(-rollout_size // steps)
            results += await _sessions(*load, fill, f"fill-{tree}", one, steps)
        _control(proxy, "-i", "on")
        measured = await _sessions(*load, sessions, f"m-{tree}", one, steps)
        _control(proxy, "-i", "off")
        results += measured
    finally:
        await http.close()
        proxy.stop()
        engine.stop()
    bad = [r for r in results if not r.ok]  # warm-up and fill calls too
    if bad:
        errors = sorted({str(r.error) for r in bad})
        raise RuntimeError(f"{tree}: {len(bad)} calls failed: {errors}")
    # one count per process (the supervisor and each worker print theirs as they end)
    found = [int(n) for n in _COLLECTED.findall(proxy.tail(1_000_000))]
    expected = 1 if tree == RELAY_TREE or workers == 1 else 1 + workers
    if len(found) != expected:
        raise RuntimeError(f"{tree}: {len(found)} callgrind counts, not {expected}: {proxy.tail()}")
    return Figure(tree, stream, len(measured), sum(found))


async def _sessions(
    http: aiohttp.ClientSession,
    target: Target,
    stream: bool,
    workload: Workload,
    n: int,
    tag: str,
    rollout_id: str | None = None,
    steps: int = 3,
) -> list[CallResult]:
    """``n`` agent sessions of ``steps`` calls, one at a time, each in its own rollout (or all
    in ``rollout_id``)."""
    results: list[CallResult] = []
    for i in range(n):
        sid = f"{tag}-{int(stream)}-{i:05d}"
        rid = rollout_id or sid
        results += await sweep_session(http, target, rid, sid, steps, stream, workload)
    return results


def _control(proxy: Service, *args: str) -> None:
    """``callgrind_control`` on the proxy's process and its children (the workers)."""
    for pid in tree_pids(proxy.pid):
        _control_one(pid, *args)


def _control_one(pid: int, *args: str) -> None:
    subprocess.run(
        ["callgrind_control", *args, str(pid)],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=60,
    )


def report(figures: list[Figure]) -> None:
    print("\ninstructions per captured call (callgrind; all the proxy's threads, no kernel)")
    base = {f.stream: f for f in figures if f.tree == "base"}
    relay = {f.stream: f for f in figures if f.tree == RELAY_TREE}
    for f in figures:
        ratio = ""
        if f.tree not in ("base", RELAY_TREE) and f.stream in base:
            ratio = f"  {f.per_call_m / base[f.stream].per_call_m:.3f}x base"
        if f.tree != RELAY_TREE and f.stream in relay:
            ratio += f"  {f.per_call_m / relay[f.stream].per_call_m:.3f}x relay"
        mode = "stream" if f.stream else "whole"
        print(f"  {f.tree:<6}{mode:<8}{f.calls:>5} calls {f.per_call_m:>9.4f} M{ratio}")


async def main_async(args: argparse.Namespace) -> int:
    trees = [("this", ROOT)]
    if args.baseline_src:
        trees.insert(0, ("base", Path(args.baseline_src).resolve()))
    if args.relay_event:
        trees.insert(0, (RELAY_TREE, ROOT))
    figures = []
    tokenizer = None
    if args.exact_tokens:
        tokenizer = Path(tempfile.mkdtemp(prefix="instructions-tokenizer-"))
        subprocess.run([*cli_command(), "export-tokenizer", str(tokenizer)], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip
    tools = recorded_tools(Path(args.tools_from)) if args.tools_from else None
    workload = Workload(tools=tools)
    modes = {"whole": (False,), "stream": (True,), "both": (False, True)}[args.modes]
    pg = None
    if args.postgres:
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            print("instructions: --postgres needs PostgreSQL (scripts/install-postgres)")
            return 2
        pg = PostgresServer(bin_dir)
        pg.start(deadline_s=60)
    try:
        for stream in modes:
            for tree, src in trees:
                store = pg.create_database() if pg is not None else None
                figure = await measure(
                    tree,
                    src,
                    stream,
                    args.sessions,
                    args.rollout_size,
                    steps=args.steps,
                    store=store,
                    workload=workload,
                    answer_tokens=args.answer_tokens,
                    exact_tokens=tokenizer if tree != RELAY_TREE else None,
                    workers=args.workers,
                )
                figures.append(figure)
                print(f"  {tree} stream={stream}: {figures[-1].per_call_m:.4f} M", flush=True)
    finally:
        if pg is not None:
            pg.stop()
    report(figures)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=30, help="measured sessions of 3 calls (30)")
    ap.add_argument("--baseline-src", metavar="DIR", help="also measure this source tree (base)")
    ap.add_argument(
        "--rollout-size",
        type=int,
        metavar="N",
        help="all sessions in one rollout, after N calls sent into it unmeasured",
    )
    ap.add_argument("--modes", choices=("whole", "stream", "both"), default="both")
    ap.add_argument("--steps", type=int, default=3, help="calls per session (3; 1: roots)")
    ap.add_argument("--postgres", action="store_true", help="a PostgreSQL store (throwaway)")
    ap.add_argument(
        "--tools-from", metavar="FILE", help="the tools of a recorded harness session (JSONL)"
    )
    ap.add_argument(
        "--relay-event", action="store_true", help="also the bare relay, one write per event"
    )
    ap.add_argument(
        "--answer-tokens", type=int, metavar="N", help="every answer exactly N generation tokens"
    )
    ap.add_argument("--exact-tokens", action="store_true", help="the proxies in exact-token mode")
    ap.add_argument(
        "--workers", type=int, default=1, help="the proxies' serve --workers (1); all counted"
    )
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
