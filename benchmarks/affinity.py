"""Engine affinity with ``--backend`` repeated (no router): how often a rollout's calls leave
the engine that holds its prefix, and how even the engines' load is, with ``serve --workers N``
and no failures; against any source tree, and a baseline tree in the same run.

Processes, all on loopback ports from ``--port-base`` (44100): ``--engines`` paced engines
(``paced_engine.py``, one process each, every stream one token per ``--token-delay`` after a
first-byte delay, each writing a served-request log: the ``X-Request-Id`` the proxy sends, its
call id, and when the answer started and ended), ``capture-proxy serve --workers N --backend
e1 --backend e2 ...`` on a new store, run from ``--src`` (``PYTHONPATH=DIR``, this interpreter,
working directory outside every tree), and the harness in this process.

The harness (deterministic from ``--seed``: the same prompts, answer lengths, first-byte
delays, think times and start times for every tree): ``--rollouts`` rollouts x ``--sessions``
concurrent agent sessions x ``--calls`` streamed chat calls; each session on its own
keep-alive connection (``paced_client.Conn``); each call's prompt the previous one's, its
answer and a tool output (``--tool-output-kb``); ``--think-max`` s of think time (uniform)
before each call after the first; rollouts start spread over ``--ramp-s``, a rollout's sessions
within half a second of it. Calls are matched to engines exactly: the answer's
``X-Capture-Call-Id`` is the ``X-Request-Id`` an engine logged.

Figures per run (``Figures``): continuations (call k+1 of a session after call k) served by
another engine than call k; sessions and rollouts served by more than one engine; per engine
calls and mean requests in flight (busy time over the load's wall time); the busiest engine's
calls over the mean; calls, errors (non-200, a stream cut or short, no answer before
``--call-timeout-s``) and calls not sent (a session ends at its first error); calls no engine
logged; wall time; the proxy's ``capture_proxy_backend_key_moves`` (moves per rollout, all its
sessions' calls in arrival order, summed over workers) and its UNHEALTHY log lines.

``--baseline-src DIR`` runs the same workload against DIR too (ABBA order over ``--repeat``)
and prints both side by side with their ratio. Proxy settings: environment variables
(``CAPTURE_PROXY_BACKEND_BALANCE_FACTOR=2.0``) reach both trees; ``--proxy-arg`` adds a flag.

Run: ``.venv/bin/python benchmarks/affinity.py [--engines 3] [--workers 2] [--rollouts 100]
[--sessions 3] [--calls 6] [--src DIR] [--baseline-src DIR] [--repeat 1]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import paced_wire as wire  # noqa: E402
from benchmarks.paced_client import CAPTURE, Conn, Stats  # noqa: E402
from benchmarks.services import ROOT, Service, raise_fd_limit  # noqa: E402

#: The loopback ports the bench may use (the machine is shared).
#: The ports a run may take (all loopback TCP ports above the privileged ones).
PORT_RANGE = range(1024, 65536)
SYSTEM = "You are a coding agent working in a repository. Keep edits small. " * 30
WORDS = ("alpha", "beta", "gamma", "delta", "file.py", "line", "ok", "FAILED", "def", "test")


@dataclass(frozen=True)
class ClientCall:
    """One call as the harness saw it: ``t_send`` / ``t_end`` on ``time.monotonic()``."""

    rollout: str
    session: int
    step: int
    call_id: str | None
    error: str | None
    t_send: float
    t_end: float


@dataclass(frozen=True)
class ServedCall:
    """One chat request as an engine logged it (``paced_engine --served-log``)."""

    engine: int
    request_id: str | None
    key: str | None
    t0: float
    t1: float
    status: int
    cut: bool


@dataclass
class Figures:
    """What one run measured (module docstring)."""

    calls: int = 0
    errors: int = 0
    not_sent: int = 0
    unmatched: int = 0
    #: answered calls whose engine request carried another routing key than their rollout id
    wrong_key: int = 0
    continuations: int = 0
    moved: int = 0
    sessions: int = 0
    sessions_multi: int = 0
    rollouts: int = 0
    rollouts_multi: int = 0
    engine_calls: list[int] = field(default_factory=list)
    engine_in_flight: list[float] = field(default_factory=list)
    #: per engine, the continuations that moved away from it (their previous call's engine)
    moved_from: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    key_moves: float | None = None
    unhealthy_lines: int = 0

    @property
    def moved_share(self) -> float:
        return self.moved / self.continuations if self.continuations else float("nan")

    @property
    def sessions_multi_share(self) -> float:
        return self.sessions_multi / self.sessions if self.sessions else float("nan")

    @property
    def rollouts_multi_share(self) -> float:
        return self.rollouts_multi / self.rollouts if self.rollouts else float("nan")

    @property
    def busiest_over_mean(self) -> float:
        mean = statistics.fmean(self.engine_calls) if self.engine_calls else 0.0
        return max(self.engine_calls) / mean if mean else float("nan")

    @property
    def busiest_in_flight_over_mean(self) -> float:
        mean = statistics.fmean(self.engine_in_flight) if self.engine_in_flight else 0.0
        return max(self.engine_in_flight) / mean if mean else float("nan")


# --- the figures (pure) ---------------------------------------------------------------------


def count_moves(engines_by_step: dict[int, int]) -> tuple[int, int]:
    """(continuations, moved) of one session: each step whose previous step was served too,
    and those of them served by another engine than that previous step."""
    continuations = moved = 0
    for step, engine in engines_by_step.items():
        before = engines_by_step.get(step - 1)
        if before is not None:
            continuations += 1
            moved += engine != before
    return continuations, moved


def engines_of_sessions(
    calls: Iterable[ClientCall], served: dict[str, ServedCall]
) -> dict[tuple[str, int], dict[int, int]]:
    """Per (rollout, session), the engine of each answered call (by step) that an engine
    logged under the call's id."""
    out: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    for c in calls:
        s = served.get(c.call_id) if c.error is None and c.call_id else None
        if s is not None:
            out[(c.rollout, c.session)][c.step] = s.engine
    return dict(out)


def mean_in_flight(served: Iterable[ServedCall], engines: int, t0: float, t1: float) -> list[float]:
    """Per engine, its requests in flight averaged over [t0, t1] (busy seconds / seconds)."""
    busy = [0.0] * engines
    for s in served:
        busy[s.engine] += max(0.0, min(s.t1, t1) - max(s.t0, t0))
    return [b / (t1 - t0) if t1 > t0 else float("nan") for b in busy]


def figures(
    calls: list[ClientCall], served: dict[str, ServedCall], engines: int, expected: int
) -> Figures:
    """The run's figures from the harness's calls and the engines' logs (by call id)."""
    f = Figures(calls=len(calls), not_sent=expected - len(calls))
    f.errors = sum(c.error is not None for c in calls)
    answered = [c for c in calls if c.error is None]
    f.unmatched = sum(c.call_id not in served for c in answered)
    f.wrong_key = sum(served[c.call_id].key != c.rollout for c in answered if c.call_id in served)
    by_session = engines_of_sessions(answered, served)
    by_rollout: dict[str, set[int]] = defaultdict(set)
    f.moved_from = [0] * engines
    for (rollout, _), steps in by_session.items():
        cont, moved = count_moves(steps)
        for step, engine in steps.items():
            before = steps.get(step - 1)
            if before is not None and before != engine:
                f.moved_from[before] += 1
        f.continuations += cont
        f.moved += moved
        f.sessions += 1
        f.sessions_multi += len(set(steps.values())) > 1
        by_rollout[rollout] |= set(steps.values())
    f.rollouts = len(by_rollout)
    f.rollouts_multi = sum(len(e) > 1 for e in by_rollout.values())
    mine = [served[c.call_id] for c in answered if c.call_id in served]
    f.engine_calls = [sum(s.engine == i for s in mine) for i in range(engines)]
    if calls:
        t0, t1 = min(c.t_send for c in calls), max(c.t_end for c in calls)
        f.wall_s = t1 - t0
        f.engine_in_flight = mean_in_flight(served.values(), engines, t0, t1)
    return f


def read_served(paths: list[Path]) -> dict[str, ServedCall]:
    """The engines' served-request logs by call id (engine ``i``: ``paths[i]``). A call id
    logged twice (an engine request sent again) keeps its last answer."""
    out: dict[str, ServedCall] = {}
    for engine, path in enumerate(paths):
        for line in path.read_text().splitlines() if path.exists() else []:
            d = orjson.loads(line)
            s = ServedCall(engine, d["id"], d["key"], d["t0"], d["t1"], d["status"], d["cut"])
            if s.request_id is not None:
                before = out.get(s.request_id)
                if before is None or before.t1 <= s.t1:
                    out[s.request_id] = s
    return out


# --- the harness -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What the harness sends (the same for every tree): see the module docstring."""

    rollouts: int
    sessions: int
    calls: int
    think_max_s: float
    token_delay_s: float
    answer_tokens: tuple[int, int]
    first_byte_ms: tuple[float, float]
    ramp_s: float
    tool_output_kb: float
    seed: int
    call_timeout_s: float

    @property
    def expected(self) -> int:
        return self.rollouts * self.sessions * self.calls

    def rollout_id(self, r: int) -> str:
        return f"aff-{self.seed}-r{r:04d}"


class Harness:
    """The sessions of one run against ``host:port`` (module docstring)."""

    def __init__(self, w: Workload, host: str, port: int) -> None:
        self.w, self.host, self.port = w, host, port
        self.stats = Stats()  # paced_client's figures, unused here
        self.calls: list[ClientCall] = []

    async def run(self, deadline_s: float) -> list[ClientCall]:
        w = self.w
        start = time.monotonic() + 0.2
        tasks = []
        for r in range(w.rollouts):
            for s in range(w.sessions):
                rng = random.Random(f"{w.seed}:{r}:{s}")
                at = start + w.ramp_s * r / max(1, w.rollouts) + rng.uniform(0.0, 0.5)
                tasks.append(asyncio.create_task(self.session(r, s, rng, at)))
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return self.calls

    async def session(self, r: int, s: int, rng: random.Random, at: float) -> None:
        w = self.w
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        rollout = w.rollout_id(r)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {rollout} session {s}: fix the failing test."},
        ]
        loop = asyncio.get_running_loop()
        host = f"{self.host}:{self.port}"
        _, conn = await loop.create_connection(lambda: Conn(self.stats, host), self.host, self.port)
        try:
            for step in range(w.calls):
                if step and w.think_max_s > 0:
                    await asyncio.sleep(rng.uniform(0.0, w.think_max_s))
                seed, tokens = rng.getrandbits(31), rng.randint(*w.answer_tokens)
                d = wire.directive(seed, tokens, 1 / w.token_delay_s, rng.uniform(*w.first_byte_ms))
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + " " + d}
                if not await self.call(conn, rollout, s, step, messages, tokens):
                    return  # a session ends at its first error, as a harness gives up
                tool = " ".join(rng.choice(WORDS) for _ in range(int(w.tool_output_kb * 170)))
                messages += [
                    {"role": "assistant", "content": wire.answer_text(seed, tokens)},
                    {"role": "user", "content": f"Tool output {step}: {tool}"},
                ]
        finally:
            if conn.transport is not None:
                conn.transport.close()

    async def call(self, conn: Conn, rollout: str, s: int, step: int,
                   messages: list[dict[str, str]], tokens: int) -> bool:  # fmt: skip
        body = {"model": wire.MODEL, "messages": messages, "stream": True}
        body["stream_options"] = {"include_usage": True}
        path = CAPTURE.format(rollout=rollout) + "/v1/chat/completions"
        t_send, call_id, error = time.monotonic(), None, None
        try:
            answer = await asyncio.wait_for(
                conn.call(path, orjson.dumps(body), False, tokens), self.w.call_timeout_s
            )
            call_id = answer.call_id
            if answer.status != 200:
                error = f"http {answer.status}"
            elif answer.events != tokens + 3:  # role, tokens, usage, [DONE]
                error = "stream short"
        except (ConnectionError, OSError, TimeoutError) as exc:
            error = type(exc).__name__
        self.calls.append(ClientCall(rollout, s, step, call_id, error, t_send, time.monotonic()))
        return error is None


# --- the processes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """A source tree whose ``capture_proxy`` the proxy runs: its label, path and revision."""

    label: str
    src: Path
    revision: str


def describe_tree(label: str, src: Path, cwd: Path) -> Tree:
    """The tree at ``src``; checks that this interpreter, run as the proxy is (``PYTHONPATH``,
    working directory ``cwd``), imports its ``capture_proxy``. Raises SystemExit if not."""
    probe = "import capture_proxy; print(capture_proxy.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=cwd,
        env={**os.environ, **tree_env(src, cwd / "pycache")},
        capture_output=True,
        text=True,
    )
    if not out.stdout.strip().startswith(str(src)):
        raise SystemExit(f"{label}: PYTHONPATH={src} imports {out.stdout.strip() or out.stderr}")
    git = ["git", "-C", str(src)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "capture_proxy"], capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    revision = (head.stdout.strip() or "no git") + (" + uncommitted changes" if dirty else "")
    return Tree(label, src, revision)


def tree_env(src: Path, pycache: Path) -> dict[str, str]:
    """What a process of the tree ``src`` runs with: its package first, its bytecode cache in
    ``pycache`` (nothing is written into the tree: it may be another engineer's checkout)."""
    return {"PYTHONPATH": str(src), "PYTHONPYCACHEPREFIX": str(pycache)}


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def ports(base: int, count: int) -> list[int]:
    """``count`` ports from ``base``, all in ``PORT_RANGE`` and free now: the same ports for
    every run, so every tree ranks the same engine URLs. Raises SystemExit if not."""
    wanted = list(range(base, base + count))
    if wanted[0] not in PORT_RANGE or wanted[-1] not in PORT_RANGE:
        raise SystemExit(f"ports {wanted[0]}-{wanted[-1]} are outside {PORT_RANGE}")
    busy = [p for p in wanted if not port_is_free(p)]
    if busy:
        raise SystemExit(f"ports in use: {busy}")
    return wanted


def _services(args: argparse.Namespace, tree: Tree, work: Path) -> tuple[list[Service], Service]:
    """The engines and the proxy of one run (not started)."""
    *engine_ports, proxy_port = ports(args.port_base, args.engines + 1)
    engines = []
    for i, port in enumerate(engine_ports):
        argv = [sys.executable, str(ROOT / "benchmarks" / "paced_engine.py"), "--port", str(port)]
        argv += ["--served-log", str(work / f"engine-{i}.jsonl")]
        engines.append(Service(f"engine-{i}", argv, port, work / f"engine-{i}.log"))
    argv = [sys.executable, "-m", "capture_proxy.cli", "serve", "--port", str(proxy_port)]
    for e in engines:
        argv += ["--backend", e.url]
    argv += ["--store", str(work / "store"), "--workers", str(args.workers), *args.proxy_arg]
    env = tree_env(tree.src, work.parent / "pycache")
    proxy = Service("proxy", argv, proxy_port, work / "proxy.log", env=env, cwd=work)
    return engines, proxy


async def key_moves(session: aiohttp.ClientSession, proxy_url: str) -> float | None:
    """The proxy's ``capture_proxy_backend_key_moves`` summed over its samples (None: none)."""
    async with session.get(proxy_url + "/metrics") as resp:
        text = await resp.text()
    pattern = r"^capture_proxy_backend_key_moves(?:\{[^}]*\})? ([0-9.e+]+)$"
    values = [float(v) for v in re.findall(pattern, text, re.MULTILINE)]
    return sum(values) if values else None


async def run_once(args: argparse.Namespace, w: Workload, tree: Tree, work: Path) -> Figures:
    """One run of the workload against ``tree``'s proxy: its figures."""
    work.mkdir(parents=True)
    engines, proxy = _services(args, tree, work)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            for e in engines:
                e.start()
            for e in engines:
                await e.wait_healthy(session, 30)
            proxy.start()
            await proxy.wait_healthy(session, 60)
            calls = await Harness(w, "127.0.0.1", proxy.port).run(args.deadline_s)
            await asyncio.sleep(2.0)  # the workers copy their metrics every second
            moves = await key_moves(session, proxy.url)
        finally:
            proxy.stop()
            for e in engines:
                e.stop()
    served = read_served([work / f"engine-{i}.jsonl" for i in range(args.engines)])
    f = figures(calls, served, args.engines, w.expected)
    f.key_moves = moves
    f.unhealthy_lines = proxy.tail(10**9).count(" is UNHEALTHY")
    return f


# --- the report ------------------------------------------------------------------------------


def _share(part: int, whole: int) -> str:
    return f"{part} of {whole} ({100 * part / whole:.1f}%)" if whole else f"{part} of 0"


def describe_run(f: Figures) -> list[str]:
    """One run's figures, a few lines."""
    engines = " / ".join(str(n) for n in f.engine_calls)
    flight = " / ".join(f"{x:.1f}" for x in f.engine_in_flight)
    moves = "n/a" if f.key_moves is None else f"{f.key_moves:.0f}"
    return [
        f"  calls {f.calls}, errors {f.errors}, not sent {f.not_sent}, answered calls no engine "
        f"logged {f.unmatched}, with another routing key {f.wrong_key}; wall {f.wall_s:.1f} s",
        f"  continuations on another engine than their previous call: "
        f"{_share(f.moved, f.continuations)}; moved away from each engine: "
        + " / ".join(str(n) for n in f.moved_from),
        f"  sessions on more than one engine: {_share(f.sessions_multi, f.sessions)}; "
        f"rollouts: {_share(f.rollouts_multi, f.rollouts)}",
        f"  calls per engine: {engines} (busiest {f.busiest_over_mean:.2f}x the mean); "
        f"mean in flight per engine: {flight}",
        f"  proxy: capture_proxy_backend_key_moves {moves}, UNHEALTHY log lines "
        f"{f.unhealthy_lines}",
    ]


#: The summary's rows: a name and how to read the figure from one run.
ROWS = (
    ("continuations on another engine", lambda f: 100 * f.moved_share, "%"),
    ("sessions on >1 engine", lambda f: 100 * f.sessions_multi_share, "%"),
    ("rollouts on >1 engine", lambda f: 100 * f.rollouts_multi_share, "%"),
    ("busiest engine's calls / mean", lambda f: f.busiest_over_mean, "x"),
    ("busiest engine's in flight / mean", lambda f: f.busiest_in_flight_over_mean, "x"),
    ("mean in flight, all engines", lambda f: sum(f.engine_in_flight), ""),
    ("proxy key_moves", lambda f: float("nan") if f.key_moves is None else f.key_moves, ""),
    ("errors + not sent + unmatched", lambda f: f.errors + f.not_sent + f.unmatched, ""),
    ("wall time s", lambda f: f.wall_s, ""),
)


def summary(results: dict[str, list[Figures]], labels: list[str]) -> list[str]:
    """The figures' means over the repeats, one column per tree, and their ratio."""
    head = f"{'figure (mean of runs)':36s}" + "".join(f"{x:>14s}" for x in labels)
    if len(labels) == 2:
        head += f"{labels[0] + ' / ' + labels[1]:>22s}"
    lines = [head]
    for name, read, unit in ROWS:
        means = [statistics.fmean(read(f) for f in results[x]) for x in labels]
        spreads = [_spread([read(f) for f in results[x]]) for x in labels]
        line = f"{name:36s}" + "".join(
            f"{f'{m:.2f}{unit}{s}':>14s}" for m, s in zip(means, spreads, strict=True)
        )
        if len(labels) == 2:
            ratio = f"{means[0] / means[1]:.2f}x" if means[1] else "-"
            line += f"{ratio:>22s}"
        lines.append(line)
    return lines


def _spread(values: list[float]) -> str:
    return "" if len(values) < 2 else f" ±{(max(values) - min(values)) / 2:.2f}"


# --- the command -----------------------------------------------------------------------------


def _pair(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    return float(lo), float(hi or lo)


def workload(args: argparse.Namespace) -> Workload:
    lo, hi = args.answer_tokens
    return Workload(
        rollouts=args.rollouts,
        sessions=args.sessions,
        calls=args.calls,
        think_max_s=args.think_max,
        token_delay_s=args.token_delay,
        answer_tokens=(int(lo), int(hi)),
        first_byte_ms=args.first_byte_ms,
        ramp_s=args.ramp_s,
        tool_output_kb=args.tool_output_kb,
        seed=args.seed,
        call_timeout_s=args.call_timeout_s,
    )


def _header(args: argparse.Namespace, trees: list[Tree]) -> list[str]:
    settings = {k: v for k, v in os.environ.items() if k.startswith("CAPTURE_PROXY_")}
    lo, hi = args.answer_tokens
    lines = [
        f"affinity: {args.engines} engines, serve --workers {args.workers}, {args.rollouts} "
        f"rollouts x {args.sessions} sessions x {args.calls} streamed calls; answers "
        f"{lo:g}-{hi:g} tokens at {1000 * args.token_delay:g} ms a token after "
        f"{args.first_byte_ms[0]:g}-{args.first_byte_ms[1]:g} ms; think 0-{args.think_max:g} s; "
        f"ramp {args.ramp_s:g} s; seed {args.seed}",
        f"  {os.cpu_count()} CPUs shared by engines, proxy and harness; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"  proxy settings: environment {settings or 'none'}; flags {args.proxy_arg or 'none'}",
    ]
    lines += [f"  {t.label}: {t.src} @ {t.revision}" for t in trees]
    return lines


async def main_async(args: argparse.Namespace) -> int:
    raise_fd_limit()
    root = Path(tempfile.mkdtemp(prefix="capture-affinity-"))
    try:
        trees = [describe_tree("src", Path(args.src).resolve(), root)]
        if args.baseline_src:
            trees.append(describe_tree("baseline", Path(args.baseline_src).resolve(), root))
        for line in _header(args, trees):
            print(line, flush=True)
        w = workload(args)
        results: dict[str, list[Figures]] = {t.label: [] for t in trees}
        runs = [t for i in range(args.repeat) for t in (trees if i % 2 == 0 else trees[::-1])]
        for n, tree in enumerate(runs, 1):
            f = await run_once(args, w, tree, root / f"run-{n}-{tree.label}")
            results[tree.label].append(f)
            print(f"\nrun {n}/{len(runs)}: {tree.label}", flush=True)
            for line in describe_run(f):
                print(line, flush=True)
        print()
        for line in summary(results, [t.label for t in trees]):
            print(line)
        bad = any(
            f.errors or f.not_sent or f.unmatched or f.wrong_key
            for fs in results.values()
            for f in fs
        )
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--engines", type=int, default=3, help="paced engines, --backend each (3)")
    add("--workers", type=int, default=2, help="serve --workers (2)")
    add("--rollouts", type=int, default=100, help="rollouts (100)")
    add("--sessions", type=int, default=3, help="concurrent sessions per rollout (3)")
    add("--calls", type=int, default=6, help="streamed calls per session (6)")
    add("--think-max", type=float, default=0.5, help="think time before a call, 0-N s (0.5)")
    add("--token-delay", type=float, default=0.02, help="seconds per generated token (0.02)")
    add("--first-byte-ms", type=_pair, default=(50.0, 200.0), help="LO-HI ms (50-200)")
    add("--answer-tokens", type=_pair, default=(24.0, 64.0), help="LO-HI tokens (24-64)")
    add("--tool-output-kb", type=float, default=1.0, help="each tool output's size (1)")
    add("--ramp-s", type=float, default=10.0, help="rollouts start over N s (10)")
    add("--seed", type=int, default=1, help="the workload's seed (1)")
    add("--src", default=str(ROOT), help="the tree the proxy runs from (this repository)")
    add("--baseline-src", metavar="DIR", help="also run the workload against this tree")
    add("--repeat", type=int, default=1, help="runs per tree, ABBA order (1)")
    add("--proxy-arg", action="append", default=[], help="a serve flag, e.g. --proxy-arg=--x=1")
    add("--port-base", type=int, default=44100, help="engines from here, then the proxy")
    add("--call-timeout-s", type=float, default=60.0, help="bound on one call (60)")
    add("--deadline-s", type=float, default=150.0, help="bound on one run's load (150)")
    add("--keep", action="store_true", help="keep the work dir (logs, stores)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.engines, args.workers, args.rollouts, args.sessions, args.calls) < 1:
        print("--engines, --workers, --rollouts, --sessions, --calls must be positive")
        return 2
    if args.answer_tokens[0] < 2 or args.answer_tokens[0] > args.answer_tokens[1]:
        print("--answer-tokens LO-HI: 2 <= LO <= HI")
        return 2
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_async(args))
    return uvloop.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
