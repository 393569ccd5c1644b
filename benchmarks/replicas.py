"""Replica benchmark and failover run (issue 14 item 5): proxy replicas on one PostgreSQL store
behind HAProxy, against the single SQLite process, in one run.

Starts, as separate processes on loopback: the scripted engine, a throwaway PostgreSQL server
(``benchmarks/infra.py``: Debian's packages, a temporary directory), HAProxy with
``configs/haproxy.cfg`` and ``capture-proxy serve`` replicas. Configurations, each measured the
same way (``--rollouts`` concurrent streaming sessions of ``--steps`` calls, after a warm-up):

1. ``sqlite``: one proxy on its embedded store, no load balancer (today's deployment);
2. ``pg x1``: one replica on PostgreSQL behind HAProxy;
3. ``pg x2``: two replicas on PostgreSQL behind HAProxy.

For each: calls/s (completed calls over the phase's wall time), CPU per call of the proxies
(all replicas), of PostgreSQL (the server and its backends) and of HAProxy, latency p50/p99,
errors; then every call is read back over REST and every rollout checked to be one chain.

Failover (``--failover``, on two replicas): sessions run through HAProxy; after
``--kill-after`` completed calls one replica is SIGKILLed. A session whose call was cut sends it
again as a retry (``x-stainless-retry-count``, as OpenAI SDKs do); HAProxy sends it, and every
later call of the rollout, to the live replica, which reloads the rollout's link index from the
store. Passes when every call whose answer completed is readable with the ids the engine sent,
every rollout is one complete chain of the calls its harness completed (a cut call that was
stored before the kill may only appear as a superseded retry), no call is linked to a parent
its harness did not continue from, and rollouts of the killed replica went on on the other.

The machine's cores are shared by everything; the report says how many. Every wait is bounded.

Run: ``.venv/bin/python benchmarks/replicas.py [--rollouts 256] [--steps 3] [--failover]``
(needs ``scripts/install-postgres`` and ``scripts/install-haproxy``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.infra import (  # noqa: E402
    HAProxy,
    PostgresServer,
    haproxy_binary,
    postgres_bin_dir,
)
from benchmarks.services import (  # noqa: E402
    Service,
    engine_service,
    proc_cpu_s,
    proxy_service,
    raise_fd_limit,
)
from benchmarks.sessions import (  # noqa: E402
    CallResult,
    Target,
    client_session,
    pct,
    request_body,
    stream_call,
)
from benchmarks.verification import (  # noqa: E402
    Verification,
    by_rollout,
    get_json,
    verify_calls,
)

RETRY_HEADER = "x-stainless-retry-count"


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children (PostgreSQL's backends)."""
    total = proc_cpu_s(pid) or 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid:
            total += proc_cpu_s(int(entry.name)) or 0.0
    return total


async def retrying_session(
    session: aiohttp.ClientSession,
    target: Target,
    rollout_id: str,
    steps: int,
    on_call: Any = None,
    attempts: int = 4,
) -> list[CallResult]:
    """``benchmarks.sessions.run_session``'s agent session, but a call that fails is sent again
    (up to ``attempts`` times, with the SDKs' retry header); stops when a step never completes.
    Every request names its session as OpenCode does (``x-session-id``): the retry of a call a
    killed replica stored but never finished answering is then known as its retry. Returns
    every attempt."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools to answer."},
        {"role": "user", "content": f"Task {rollout_id}."},
    ]
    results: list[CallResult] = []
    for step in range(steps):
        body = request_body(target, list(messages))
        for attempt in range(attempts):
            headers = {"x-session-id": f"ses_{rollout_id}"}
            if attempt:
                headers[RETRY_HEADER] = str(attempt)
            result = await stream_call(
                session, target.url(rollout_id), body, CallResult(rollout_id, step), headers
            )
            results.append(result)
            if on_call is not None:
                on_call(result)
            if result.ok:
                break
        else:
            return results
        assert result.message is not None
        messages.append(result.message)
        calls = result.message.get("tool_calls") or []
        for tc in calls:
            content = f"output of {tc['function']['name']} at step {step}"
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": content})
        if not calls:
            messages.append({"role": "user", "content": "Continue."})
    return results


async def verify_rollout_chains(
    session: aiohttp.ClientSession,
    base_url: str,
    sessions: dict[str, list[CallResult]],
    steps: int,
    v: Verification,
) -> None:
    """Each rollout is one chain of the calls its harness completed, in order, parent to child;
    the only unlinked calls are superseded retries of a cut call; not incomplete."""
    sem = asyncio.Semaphore(32)

    async def one(rollout_id: str, calls: list[CallResult]) -> None:
        done = [c for c in calls if c.ok]
        if len(done) != steps:
            v.problem(f"{rollout_id}: {len(done)} of {steps} steps completed")
            return
        async with sem:
            status, body = await get_json(
                session, f"{base_url}/captures/rollouts/{rollout_id}/chains"
            )
        v.rollouts_checked += 1
        if status != 200:
            v.problem(f"{rollout_id}: chains answered {status}")
            return
        want = [c.call_id for c in done]
        got = [[c["call_id"] for c in ch["calls"]] for ch in body.get("chains", [])]
        if got != [want]:
            v.problem(f"{rollout_id}: chains {got} != [{want}]")
        for ch in body.get("chains", []):
            parents = [c["parent_call_id"] for c in ch["calls"]]
            ids = [c["call_id"] for c in ch["calls"]]
            if parents != [None, *ids[:-1]]:
                v.problem(f"{rollout_id}: parents {parents} do not follow {ids}")
        cut = {c.call_id for c in calls if not c.ok and c.call_id}
        for u in body.get("unlinked_calls", []):
            if u.get("reason") != "superseded_retry" or u["call_id"] not in cut:
                v.problem(f"{rollout_id}: unlinked call {u}")
        if body.get("incomplete"):
            v.problem(f"{rollout_id}: marked incomplete ({body.get('diagnostics')})")

    await asyncio.gather(*(one(rid, calls) for rid, calls in sessions.items()))


@dataclass
class Figures:
    name: str
    calls: int
    wall_s: float
    cpu_ms: dict[str, float]
    latencies_s: list[float]
    errors: int
    problems: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.calls / self.wall_s if self.wall_s else 0.0

    def line(self) -> str:
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in self.cpu_ms.items())
        return (
            f"  {self.name:7s} {self.rate:7.1f} calls/s  CPU ms/call: {cpu}  "
            f"p50 {pct(self.latencies_s, 50) * 1000:6.1f} ms  p99 "
            f"{pct(self.latencies_s, 99) * 1000:6.1f} ms  errors {self.errors}  "
            f"problems {len(self.problems)}"
        )


@dataclass
class Deployment:
    """What serves one configuration: replicas, and HAProxy in front when ``lb``."""

    name: str
    replicas: list[Service]
    lb: HAProxy | None = None

    @property
    def url(self) -> str:
        return self.lb.url if self.lb is not None else self.replicas[0].url

    def pids(self) -> dict[str, int]:
        out = {f"proxy{i}": r.pid for i, r in enumerate(self.replicas)}
        if self.lb is not None:
            out["haproxy"] = self.lb.pid
        return out

    async def start(self, session: aiohttp.ClientSession, deadline_s: float = 120) -> None:
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            await r.wait_healthy(session, deadline_s)
        if self.lb is not None:
            self.lb.start()
            await wait_backends_up(session, self.lb.url, deadline_s)

    def stop(self) -> None:
        if self.lb is not None:
            self.lb.stop()
        for r in self.replicas:
            r.stop()


async def wait_backends_up(session: aiohttp.ClientSession, url: str, deadline_s: float) -> None:
    """Until HAProxy forwards /health (a replica is up behind it), bounded."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no replica up behind {url} after {deadline_s} s")


async def measure(
    session: aiohttp.ClientSession,
    deployment: Deployment,
    pg: PostgresServer | None,
    rollouts: int,
    steps: int,
    run: str,
) -> Figures:
    target = Target(deployment.name, deployment.url, capture=True, ask_tokens=True)
    warm = [f"warm-{deployment.name}-{run}-{i}" for i in range(8)]
    await asyncio.gather(*(retrying_session(session, target, r, steps, attempts=1) for r in warm))
    pids = deployment.pids()

    def cpu() -> dict[str, float]:
        out = {k: proc_cpu_s(p) or 0.0 for k, p in pids.items()}
        if pg is not None and pg.proc is not None:
            out["postgres"] = tree_cpu_s(pg.proc.pid)
        return out

    ids = [f"load-{deployment.name.replace(' ', '')}-{run}-{i:05d}" for i in range(rollouts)]
    c0, t0 = cpu(), time.perf_counter()
    sessions = await asyncio.gather(
        *(retrying_session(session, target, r, steps, attempts=1) for r in ids)
    )
    wall, c1 = time.perf_counter() - t0, cpu()
    results = [r for s in sessions for r in s]
    done = [r for r in results if r.ok]
    n = max(len(done), 1)
    proxies = sum(c1[k] - c0[k] for k in c0 if k.startswith("proxy"))
    cpu_ms = {"proxies": proxies / n * 1000}
    for k in ("postgres", "haproxy"):
        if k in c0:
            cpu_ms[k] = (c1[k] - c0[k]) / n * 1000
    v = Verification()
    await verify_calls(session, deployment.url, done, v)
    await verify_rollout_chains(session, deployment.url, by_rollout(results), steps, v)
    return Figures(
        deployment.name,
        len(done),
        wall,
        cpu_ms,
        [r.latency_s for r in done],
        len(results) - len(done),
        v.problems,
    )


@dataclass
class FailoverReport:
    completed: int
    cut: int
    killed_after: int | None
    moved_rollouts: int
    problems: list[str]
    calls_checked: int
    rollouts_checked: int

    @property
    def ok(self) -> bool:
        return (
            not self.problems
            and self.killed_after is not None
            and self.moved_rollouts > 0
            and self.calls_checked == self.completed
        )

    def line(self) -> str:
        return (
            f"  failover: SIGKILL of one of 2 replicas after {self.killed_after} completed "
            f"calls; {self.cut} calls cut and sent again; {self.completed} completed calls read "
            f"back ({self.calls_checked} checked), {self.rollouts_checked} rollouts one complete "
            f"chain each, {self.moved_rollouts} rollouts moved from the killed replica to the "
            f"other; problems {len(self.problems)}: {'PASS' if self.ok else 'FAIL'}"
        )


async def failover(
    session: aiohttp.ClientSession,
    deployment: Deployment,
    rollouts: int,
    steps: int,
    kill_after: int,
    deadline_s: float,
    run: str = "f",
) -> FailoverReport:
    """The failover run (module docstring) on a started two-replica ``deployment``."""
    assert deployment.lb is not None and len(deployment.replicas) == 2
    victim = deployment.replicas[0]
    victim_name = "replica1"  # configs/haproxy.cfg names the first server so
    target = Target("lb", deployment.url, capture=True, ask_tokens=True)
    completed: list[CallResult] = []
    killed_after: list[int] = []

    def on_call(r: CallResult) -> None:
        if r.ok:
            completed.append(r)
        if not killed_after and len(completed) >= kill_after:
            victim.kill()
            killed_after.append(len(completed))

    ids = [f"failover-{run}-{i:04d}" for i in range(rollouts)]
    sessions = await asyncio.wait_for(
        asyncio.gather(*(retrying_session(session, target, r, steps, on_call) for r in ids)),
        deadline_s,
    )
    results = [r for s in sessions for r in s]
    v = Verification()
    await verify_calls(session, deployment.url, completed, v)
    await verify_rollout_chains(session, deployment.url, by_rollout(results), steps, v)
    moved = 0
    for calls in by_rollout(results).values():
        served = [c.served_by for c in calls if c.ok]
        if victim_name in served and served[-1] != victim_name:
            moved += 1
    return FailoverReport(
        completed=len(completed),
        cut=sum(1 for r in results if not r.ok),
        killed_after=killed_after[0] if killed_after else None,
        moved_rollouts=moved,
        problems=v.problems,
        calls_checked=v.calls_checked,
        rollouts_checked=v.rollouts_checked,
    )


def pg_deployment(
    work: Path, engine_url: str, store_url: str, n: int, haproxy: str, name: str
) -> Deployment:
    replicas = [
        proxy_service(work, engine_url, store_url, log_level="WARNING", name=f"{name}-r{i}")
        for i in range(n)
    ]
    lb = HAProxy(haproxy, [r.port for r in replicas], work)
    return Deployment(name, replicas, lb)


async def main_async(args: argparse.Namespace) -> int:
    bin_dir, haproxy = postgres_bin_dir(), haproxy_binary()
    if bin_dir is None or haproxy is None:
        print("needs PostgreSQL and HAProxy: scripts/install-postgres scripts/install-haproxy")
        return 2
    raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="capture-replicas-"))
    engine = engine_service(work)
    pg = PostgresServer(bin_dir)
    print(
        f"replicas: {args.rollouts} concurrent sessions x {args.steps} streaming calls per "
        f"configuration; {os.cpu_count()} CPUs shared by engine, proxies, PostgreSQL, HAProxy "
        f"and generator; work dir {work}",
        flush=True,
    )
    engine.start()
    pg.start()
    code = 0
    session = client_session(args.rollouts + 32, read_timeout_s=args.duration_limit_s)
    try:
        await engine.wait_healthy(session, 120)
        deployments = [
            Deployment(
                "sqlite",
                [proxy_service(work, engine.url, work / "sqlite-store", log_level="WARNING")],
            ),
            pg_deployment(work, engine.url, pg.create_database(), 1, haproxy, "pg x1"),
            pg_deployment(work, engine.url, pg.create_database(), 2, haproxy, "pg x2"),
        ]
        figures = []
        for d in deployments:
            await d.start(session)
            try:
                f = await asyncio.wait_for(
                    measure(session, d, pg if d.lb else None, args.rollouts, args.steps, "m"),
                    args.duration_limit_s,
                )
            finally:
                d.stop()
            figures.append(f)
            print(f.line(), flush=True)
            for p in f.problems[:10]:
                print("    " + p)
            if f.problems or f.errors:
                code = 1
        base = figures[0]
        for f in figures[1:]:
            print(
                f"  {f.name} / sqlite: {f.rate / base.rate:.2f}x calls/s, "
                f"{f.cpu_ms['proxies'] / base.cpu_ms['proxies']:.2f}x proxy CPU per call"
            )
        if args.failover:
            d = pg_deployment(work, engine.url, pg.create_database(), 2, haproxy, "failover")
            await d.start(session)
            try:
                report = await failover(
                    session,
                    d,
                    args.failover_rollouts,
                    args.steps,
                    args.kill_after,
                    args.duration_limit_s,
                )
            finally:
                d.stop()
            print(report.line())
            for p in report.problems[:10]:
                print("    " + p)
            if not report.ok:
                code = 1
        print("result: " + ("PASS" if code == 0 else "FAIL"))
    finally:
        await session.close()
        engine.stop()
        pg.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=256, help="concurrent sessions (256)")
    ap.add_argument("--steps", type=int, default=3, help="streaming calls per session (3)")
    ap.add_argument("--failover", action="store_true", help="also run the failover check")
    ap.add_argument("--failover-rollouts", type=int, default=128)
    ap.add_argument("--kill-after", type=int, default=150, help="completed calls (150)")
    ap.add_argument("--duration-limit-s", type=float, default=600.0)
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
