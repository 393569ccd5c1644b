"""Load benchmark (issue 7 item 5): N concurrent streaming rollouts through the proxy.

Runs the scripted engine and the proxy as separate processes (``capture-proxy scripted-engine``
and ``capture-proxy serve`` on a temporary store) and the load generator in this process, with
one aiohttp ClientSession whose connector holds a connection per rollout. Each rollout is a
multi-step streaming agent session (default 3 calls: a tool call, a tool call, an answer), sent
back like OpenCode does: the assistant message echoed with content ``""`` and its tool calls,
then one tool result per tool call.

Phases, in one run, all against the same two processes:

1. warm-up: a few sessions direct and through the proxy (not measured, verified).
2. light: ``--light-rollouts`` sessions one after the other, each run three ways in turn:
   direct, relayed (the same bytes through the proxy's pass-through path, nothing captured)
   and captured. Per-call latency without queueing: the proxy's own overhead, split into the
   hop through an aiohttp process at all (relay - direct) and the capture (proxy - relay).
3. load: ``--rollouts`` concurrent sessions against the engine directly (baseline), then the
   same sessions through the proxy. On a saturated machine latency is mostly queueing, so the
   difference of the two distributions, and the CPU each process spent per call, say what the
   proxy costs.

The direct baseline sends the body the proxy sends upstream (``augment_chat_request``: log
probs, ``return_token_ids``, usage), so the engine does the same work in both. Per-call pairing
of direct and proxied calls is impossible (different calls), so distributions are compared:
latency (request sent to ``[DONE]`` read) and time to first byte (request sent to the first
body bytes) at p50/p99.

Afterwards every proxied rollout is checked over REST: each call the harness saw (by its
``X-Capture-Call-Id``) is stored ``complete`` with the token counts the engine reported in
``usage``, and each rollout is one chain of ``--steps`` calls with nothing unlinked or
incomplete. ``--kill-after N`` SIGKILLs the proxy after N completed proxied calls of the load
phase, restarts it on the same store and checks that every call whose ``[DONE]`` the harness
saw is readable (the crash-safety variant; the chain checks then cover only rollouts that
finished before the kill).

Every wait is bounded (``--duration-limit-s`` for the whole run, deadlines on start-up). The
engine, the proxy and this generator share the machine's cores; the report prints how many.

``--sweep`` runs the concurrency sweep instead (``cpu_sweep.py``): proxy CPU per call at 1, 16
and 256 clients, in both prompt modes, streaming and not, beside the same calls sent direct;
``--sweep-one-rollout`` puts every session of a cell in one rollout.

Run: ``.venv/bin/python benchmarks/load.py [--rollouts 1024] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.services import (  # noqa: E402
    Service,
    engine_service,
    proc_status_kib,
    proxy_service,
    raise_fd_limit,
    start_py_spy,
    stop_py_spy,
)
from benchmarks.sessions import (  # noqa: E402
    CallResult,
    Phase,
    Target,
    Workload,
    client_session,
    compare,
    describe,
    run_phase,
)
from benchmarks.verification import (  # noqa: E402
    Verification,
    by_rollout,
    stored_call_count,
    verify_calls,
    verify_chains,
)


@dataclass
class _Run:
    """One load run: its arguments, the client session, the processes' pids and the three
    targets (direct, relayed through the proxy's pass-through path, captured)."""

    args: argparse.Namespace
    session: aiohttp.ClientSession
    start: float  # time.monotonic() at the run's start
    run_id: str
    pids: dict[str, int]
    workload: Workload
    direct: Target
    relay: Target
    proxied: Target
    proxied_results: list[CallResult] = field(default_factory=list)

    @property
    def deadline(self) -> float:
        return self.start + self.args.duration_limit_s

    def keep(self, r: CallResult) -> None:
        self.proxied_results.append(r)

    async def phase(
        self,
        name: str,
        target: Target,
        rollouts: list[str],
        *,
        concurrent: bool,
        on_call: Any = None,
    ) -> Phase:
        return await run_phase(
            name,
            self.session,
            target,
            rollouts,
            self.args.steps,
            concurrent=concurrent,
            deadline=self.deadline,
            pids=self.pids,
            workload=self.workload,
            on_call=on_call,
        )


def _targets(args: argparse.Namespace, engine_url: str, proxy_url: str) -> tuple[Target, ...]:
    """direct, relay and proxied."""
    direct = Target("direct", engine_url, capture=False, augment=True)
    proxied = Target("proxy", proxy_url, capture=True, ask_tokens=args.ask_tokens)
    if args.ask_tokens:
        direct = Target("direct", engine_url, capture=False, augment=True, ask_tokens=True)
    # The direct bytes through the proxy's pass-through path: the cost of the hop alone.
    relay = Target("relay", proxy_url, capture=False, augment=True, ask_tokens=args.ask_tokens)
    return direct, relay, proxied


async def _warm_up(run: _Run) -> None:
    """1. A few sessions direct and through the proxy (not measured, verified)."""
    warm = [f"warm-{run.run_id}-{i}" for i in range(8)]
    await run.phase("warm direct", run.direct, warm, concurrent=True)
    await run.phase("warm proxy", run.proxied, warm, concurrent=True, on_call=run.keep)


async def _light_load(run: _Run) -> None:
    """2. One call at a time; direct, relayed and captured in turn; prints the overheads."""
    args = run.args
    light: dict[str, list[CallResult]] = {"direct": [], "relay": [], "proxy": []}
    targets = {"direct": run.direct, "relay": run.relay, "proxy": run.proxied}
    t_light = time.perf_counter()
    for i in range(args.light_rollouts):
        rid = f"light-{run.run_id}-{i:04d}"
        for name, target in targets.items():
            on_call = run.keep if target is run.proxied else None
            phase = await run.phase(name[0], target, [rid], concurrent=False, on_call=on_call)
            light[name] += phase.results
    light_wall = time.perf_counter() - t_light
    print(f"\nlight load: {args.light_rollouts} sessions one call at a time ({light_wall:.1f} s)")
    phases = {name: Phase(name, r, light_wall / 3, {}) for name, r in light.items()}
    for name, phase in phases.items():
        for line in describe(phase, args.light_rollouts * args.steps)[1:4]:
            print(f"  {name:6s}" + line[3:])
    for line in compare(phases["direct"], phases["proxy"]):
        print(line)
    print("    of which:")
    for line in compare(phases["direct"], phases["relay"], "relay - direct"):
        print("  " + line.replace("added", "hop   "))
    for line in compare(phases["relay"], phases["proxy"], "proxy - relay"):
        print("  " + line.replace("added", "capture"))


async def _full_load(run: _Run, engine: Service, proxy: Service) -> tuple[Phase, Phase, int | None]:
    """3. All rollouts at once, direct, then through the proxy (SIGKILLed after
    ``--kill-after`` completed calls and restarted). The two phases and the kill point."""
    args = run.args
    rollouts = [f"load-{run.run_id}-{i:05d}" for i in range(args.rollouts)]
    expected = args.rollouts * args.steps
    print(f"\nfull load: {args.rollouts} concurrent sessions")
    d = await run.phase("direct", run.direct, rollouts, concurrent=True)
    for line in describe(d, expected):
        print(line, flush=True)
    completed: list[CallResult] = []
    killed_at: int | None = None
    rss_kib = None

    def on_proxied(r: CallResult) -> None:
        nonlocal killed_at, rss_kib
        run.keep(r)
        if r.done:
            completed.append(r)
        if args.kill_after and killed_at is None and len(completed) >= args.kill_after:
            rss_kib = proc_status_kib(proxy.pid, "VmHWM")
            proxy.kill()
            killed_at = len(completed)

    spy = start_py_spy(args.py_spy, proxy.pid) if args.py_spy else None
    p = await run.phase("proxy", run.proxied, rollouts, concurrent=True, on_call=on_proxied)
    if spy is not None:
        stop_py_spy(spy, args.py_spy)
    for line in describe(p, expected):
        print(line)
    for line in compare(d, p):
        print(line)
    if rss_kib is None:
        rss_kib = proc_status_kib(proxy.pid, "VmHWM")
    engine_rss = proc_status_kib(engine.pid, "VmHWM")
    print(
        f"  peak RSS (VmHWM): proxy {rss_kib / 1024 if rss_kib else float('nan'):.1f} MiB, "
        f"engine {engine_rss / 1024 if engine_rss else float('nan'):.1f} MiB"
    )
    if killed_at is not None:
        print(
            f"\ncrash: SIGKILLed the proxy after {killed_at} completed proxied calls; "
            "restarting on the same store"
        )
        proxy.start()
        await proxy.wait_healthy(run.session, 120)
    return d, p, killed_at


async def _verify(run: _Run, proxy_url: str, d: Phase, p: Phase, killed_at: int | None) -> int:
    """4. Every proxied call and rollout read back over REST; prints them; the exit code."""
    session, results = run.session, run.proxied_results
    v = Verification()
    await verify_calls(session, proxy_url, [r for r in results if r.done], v)
    await verify_chains(session, proxy_url, by_rollout(results), run.args.steps, v)
    stored = await stored_call_count(session, proxy_url)
    done_calls = sum(1 for r in results if r.done)
    print(
        f"\nverify: {v.calls_checked} completed calls read back, {v.rollouts_checked} "
        f"complete rollouts' chains checked, {stored} calls in the store "
        f"({done_calls} completed by the harness), problems: {len(v.problems)}"
    )
    for text in v.problems[:20]:
        print("  " + text)
    lost = sum(1 for t in v.problems if "GET answered 404" in t)
    errors = p.errors() + d.errors()
    exit_code = 0
    if killed_at is None and (errors or p.timed_out or d.timed_out):
        exit_code = 1
    if v.problems or lost:
        exit_code = 1
    print(
        "\nresult: "
        + ("PASS" if exit_code == 0 else "FAIL")
        + f" (errors direct {sum(d.errors().values())}, proxy {sum(p.errors().values())}; "
        f"lost calls {lost}; total {time.monotonic() - run.start:.1f} s)"
    )
    return exit_code


async def main_async(args: argparse.Namespace) -> int:
    """The load run (see the module docstring): its exit code (0: PASS)."""
    start = time.monotonic()
    fd_limit = raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="capture-load-"))
    store = Path(args.store) if args.store else work / "store"
    engine = engine_service(work)
    proxy = proxy_service(
        work,
        engine.url,
        store,
        log_level=args.proxy_log_level,
        profile_to=Path(args.profile_proxy) if args.profile_proxy else None,
        store_synchronous=args.store_synchronous,
    )
    print(
        f"load: {args.rollouts} rollouts x {args.steps} streaming calls (system prompt "
        f"+{args.system_prompt_kb:g} KB, tool outputs +{args.tool_output_kb:g} KB); "
        f"{os.cpu_count()} CPUs shared by engine, proxy and generator; open-file limit "
        f"{fd_limit}; work dir {work}",
        flush=True,
    )
    engine.start()
    proxy.start()
    connections = max(args.rollouts, args.light_rollouts, 1) + 16
    session = client_session(connections, read_timeout_s=args.duration_limit_s)
    try:
        await engine.wait_healthy(session, 120)
        await proxy.wait_healthy(session, 120)
        run = _Run(
            args,
            session,
            start,
            uuid.uuid4().hex[:6],
            {"engine": engine.pid, "proxy": proxy.pid},
            Workload(args.system_prompt_kb, args.tool_output_kb),
            *_targets(args, engine.url, proxy.url),
        )
        await _warm_up(run)
        await _light_load(run)
        d, p, killed_at = await _full_load(run, engine, proxy)
        return await _verify(run, proxy.url, d, p, killed_at)
    finally:
        await session.close()
        proxy.stop()
        engine.stop()
        if args.profile_proxy:
            print(f"proxy profile: {args.profile_proxy}")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=1024, help="concurrent sessions (1024)")
    ap.add_argument("--steps", type=int, default=3, help="streaming calls per session (3)")
    ap.add_argument(
        "--light-rollouts",
        type=int,
        default=20,
        help="sessions run one call at a time for the unloaded overhead (20)",
    )
    ap.add_argument(
        "--duration-limit-s",
        type=float,
        default=600.0,
        help="bound on the whole run, seconds (600)",
    )
    ap.add_argument(
        "--store-synchronous",
        choices=["full", "normal"],
        default="full",
        help="the proxy's store_synchronous setting (full, the default)",
    )
    ap.add_argument(
        "--kill-after",
        type=int,
        default=0,
        help="SIGKILL the proxy after N completed proxied calls, restart, verify",
    )
    ap.add_argument(
        "--ask-tokens",
        action="store_true",
        help="the harness asks return_token_ids + logprobs; verify ids exactly",
    )
    ap.add_argument("--proxy-log-level", default="INFO", help="proxy --log-level (INFO)")
    ap.add_argument(
        "--profile-proxy",
        metavar="FILE",
        help="run the proxy under cProfile, writing stats to FILE",
    )
    ap.add_argument(
        "--py-spy",
        metavar="FILE",
        help="sample the proxy with py-spy (on PATH) during the proxied load phase; "
        "collapsed stacks to FILE",
    )
    ap.add_argument(
        "--system-prompt-kb",
        type=float,
        default=0.0,
        help="pad the system prompt to about this many KB (OpenCode: ~8 KB + 20 KB of tools)",
    )
    ap.add_argument(
        "--tool-output-kb",
        type=float,
        default=0.0,
        help="size of each tool result in KB (files the agent reads)",
    )
    _add_sweep_arguments(ap)
    ap.add_argument("--store", help="store directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, store)")
    return ap


def _add_sweep_arguments(ap: argparse.ArgumentParser) -> None:
    """``--sweep`` and its options (``cpu_sweep.py``)."""
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the load phases: proxy CPU per call at C clients, both prompt modes, "
        "streaming and not (benchmarks/cpu_sweep.py)",
    )
    ap.add_argument("--sweep-concurrency", default="1,16,256", help="sweep: C values (1,16,256)")
    ap.add_argument(
        "--sweep-calls",
        type=int,
        default=1000,
        help="sweep: calls per cell, in sessions of --steps, at least C sessions (1000: the "
        "CPU clock's 10 ms tick resolves 0.01 ms per call)",
    )
    ap.add_argument(
        "--sweep-one-rollout",
        action="store_true",
        help="sweep: every session of a cell in ONE rollout (the peers' shape), not one each",
    )
    ap.add_argument(
        "--answer-tokens",
        type=int,
        default=32,
        help="sweep: every answer a text of exactly N generation tokens (32; 0: the scripted "
        "engine's default policy, tool calls then an answer)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="sweep: repeats of every cell (3)")
    ap.add_argument(
        "--baseline-src",
        metavar="DIR",
        help="sweep: also run the proxies from this source tree (MODE@base), in the same run",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rollouts < 1 or args.steps < 1:
        print("--rollouts and --steps must be positive", file=sys.stderr)
        return 2
    if args.answer_tokens and args.answer_tokens < 3:
        print("--answer-tokens: 0, or at least 3", file=sys.stderr)
        return 2
    if args.sweep:
        from benchmarks.cpu_sweep import run_sweep

        return asyncio.run(run_sweep(args))
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
