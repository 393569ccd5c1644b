"""The PostgreSQL store's ``put_call`` and ``health()``: this tree against an older one
(default: the fork point ``c2a2305``, before the writes were pipelined), in the same run, on
one throwaway server.

Workload: ``--rollouts`` agent sessions of ``--turns`` calls each, stored in chain order (as
a harness makes them), ``--concurrency`` sessions at a time over a pool of as many
connections. A turn adds 200 prompt tokens, generates 60, and carries the session's messages
(a 3 KB system prompt, the user's task, then assistant and tool messages) and a 2 KB tools
list, so each call writes a prompt delta, a message delta and content-addressed JSON.

Each version runs in a subprocess of its own (``--tree``: its package is imported from there),
each scenario on a new database:
- ``rt/put``: client-server round trips per ``put_call``, from libpq's protocol trace of the
  one connection of a sequential run (a turn = the client sends, then waits for what comes
  back); ``health`` the same for ``health()``;
- ``ms/put`` and ``puts/s``: wall time, sequential and at ``--concurrency``, on loopback and
  through a relay that delays each direction by half of ``--rtt-ms`` (a network between the
  proxy and its database);
- ``ms/health``: ``health()`` with ``--health-calls`` calls stored (its cost grows with the
  table when it counts rows).

Run: ``.venv/bin/python benchmarks/pg_put_call.py [--baseline c2a2305] [--rtt-ms 1]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.infra import PostgresServer, postgres_bin_dir  # noqa: E402

SYSTEM = "You are a coding agent. Follow the repository's conventions. " * 50
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name}: " + "runs the given input and returns its output. " * 10,
            "parameters": {
                "type": "object",
                "properties": {"input": {"type": "string", "description": "what to run"}},
                "required": ["input"],
            },
        },
    }
    for name in ("bash", "read", "write", "edit")
]


# --- child: one version, one scenario --------------------------------------------------------


def make_records(rollouts: int, turns: int) -> list[list[Any]]:
    """``rollouts`` chains of ``turns`` calls (each call's prompt extends its parent's)."""
    import numpy as np

    from capture_proxy.core.records import CallRecord

    rng = np.random.default_rng(0)
    out = []
    for r in range(rollouts):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {r}: fix the failing test."},
        ]
        prefix = np.zeros(0, np.uint32)
        chain = []
        for t in range(turns):
            prompt = np.concatenate([prefix, rng.integers(0, 150_000, 200).astype(np.uint32)])
            gen = rng.integers(0, 150_000, 60).astype(np.uint32)
            answer = {
                "role": "assistant",
                "content": f"Step {t}: looking at the code.",
                "tool_calls": [
                    {
                        "id": f"call_{r}_{t}",
                        "type": "function",
                        "function": {"name": "bash", "arguments": json.dumps({"input": "ls"})},
                    }
                ],
            }
            chain.append(
                CallRecord(
                    call_id=f"r{r}-c{t:03d}",
                    rollout_id=f"r{r}",
                    created_at=float(t),
                    model="bench",
                    request_messages=list(messages),
                    request_tools=TOOLS,
                    response_message=answer,
                    finish_reason="tool_calls",
                    prompt_token_ids=prompt,
                    generation_token_ids=gen,
                    generation_log_probs=-rng.exponential(1.0, 60).astype(np.float32),
                )
            )
            messages += [answer, {"role": "tool", "tool_call_id": f"call_{r}_{t}", "content": "ok"}]
            prefix = np.concatenate([prompt, gen])
        out.append(chain)
    return out


def count_turns(trace: str) -> int:
    """Client-server turns in a libpq trace: runs of frontend messages answered by the
    backend."""
    turns, last = 0, ""
    for line in trace.splitlines():
        side = line[:1]
        if side == "B" and last == "F":
            turns += 1
        if side in ("F", "B"):
            last = side
    return turns


def traced(store: Any, work: Path) -> contextlib.AbstractContextManager[list[int]]:
    """Trace the one connection of ``store``'s pool; the list gets its turns at the end."""
    from psycopg import pq

    @contextlib.contextmanager
    def run() -> Any:
        path = work / "trace.txt"
        out: list[int] = []
        with path.open("w") as f:
            with store._pool.connection() as conn:
                conn.pgconn.trace(f.fileno())
                conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            try:
                yield out
            finally:
                with store._pool.connection() as conn:
                    conn.pgconn.untrace()
        out.append(count_turns(path.read_text(errors="replace")))

    return run()


async def child(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, args.tree)
    from capture_proxy.store.postgres import PostgresStore

    chains = make_records(args.rollouts, args.turns)
    store = PostgresStore(args.url, pool_size=args.concurrency)
    await store.open()
    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="pg-put-"))
    try:
        await store.put_call(chains[0][0])  # warm-up: statements, caches, the rollouts row
        if args.concurrency == 1:
            with traced(store, work) as turns:
                for rec in chains[0][1:]:
                    await store.put_call(rec)
            out["rt_per_put"] = turns[0] / (len(chains[0]) - 1)
            with traced(store, work) as turns:
                for _ in range(10):
                    await store.health()
            out["rt_per_health"] = turns[0] / 10
            todo = chains[1:]
        else:
            todo = [c[1:] if i == 0 else c for i, c in enumerate(chains)]
        sem = asyncio.Semaphore(args.concurrency)

        async def session(chain: list[Any]) -> None:
            async with sem:
                for rec in chain:
                    await store.put_call(rec)

        n = sum(len(c) for c in todo)
        t0 = time.perf_counter()
        await asyncio.gather(*(session(c) for c in todo))
        elapsed = time.perf_counter() - t0
        out["puts"] = n
        out["ms_per_put"] = elapsed / n * 1000 * args.concurrency
        out["puts_per_s"] = n / elapsed
        if args.health_calls:
            await fill(args.url, args.health_calls)
            t0 = time.perf_counter()
            for _ in range(20):
                health = await store.health()
            out["ms_per_health"] = (time.perf_counter() - t0) / 20 * 1000
            out["health"] = health | {"url": "..."}
    finally:
        await store.close()
        shutil.rmtree(work, ignore_errors=True)
    return out


async def fill(url: str, n: int) -> None:
    """``n`` more rows in ``calls`` (copies of one, so that ``health`` has a table to count)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO calls SELECT 'fill-' || g, 'fill', created_at, status, schema_version, "
            "meta, prompt_token_ids, generation_token_ids, generation_log_probs, routed_experts "
            "FROM calls, generate_series(1, %s) g WHERE call_id = 'r0-c000'",
            (n,),
        )
        conn.execute("ANALYZE calls")


# --- relay: a network between the store and its server --------------------------------------


class Relay:
    """A loopback TCP relay to ``target_port`` that delays each direction by ``one_way_s``:
    every chunk keeps its order and leaves ``one_way_s`` after it arrived. Threads with
    ``time.sleep`` (an event loop's timers round a sleep up to whole milliseconds)."""

    def __init__(self, target_port: int, one_way_s: float) -> None:
        self.target_port, self.one_way_s = target_port, one_way_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe(client, server)
            self._pipe(server, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()

        def read() -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(1 << 16):
                    chunks.put((time.perf_counter() + self.one_way_s, data))
            chunks.put((0.0, b""))

        def write() -> None:
            with contextlib.suppress(OSError):
                while True:
                    due, data = chunks.get()
                    if not data:
                        break
                    if (wait := due - time.perf_counter()) > 0:
                        time.sleep(wait)
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self.listener.close()


# --- parent ----------------------------------------------------------------------------------


async def run_child(argv: list[str]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--child", *argv, stdout=subprocess.PIPE
    )
    stdout, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"child {argv} exited with {proc.returncode}")
    result: dict[str, Any] = json.loads(stdout.decode().strip().splitlines()[-1])
    return result


def baseline_tree(rev: str, into: Path) -> Path:
    """The package as it was at ``rev`` (``git archive``: the repository is only read)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "capture_proxy"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


async def parent(args: argparse.Namespace) -> None:
    bin_dir = postgres_bin_dir()
    assert bin_dir is not None, "PostgreSQL not installed (scripts/install-postgres)"
    server = PostgresServer(bin_dir)
    server.start()
    tmp = Path(tempfile.mkdtemp(prefix="pg-put-base-"))
    trees = {
        f"{args.baseline} (before)": str(baseline_tree(args.baseline, tmp)),
        "this tree": str(ROOT),
    }
    delayed = Relay(server.port, args.rtt_ms / 2000)
    relay_port = delayed.port
    common = ["--rollouts", str(args.rollouts), "--turns", str(args.turns)]
    try:
        print(
            f"PostgreSQL put_call: {args.rollouts} sessions x {args.turns} calls, "
            f"{os.cpu_count()} CPUs; relay RTT {args.rtt_ms} ms"
        )
        header = f"  {'version':22s} {'network':14s} {'conc':>4s} {'rt/put':>7s} {'ms/put':>7s} "
        print(header + f"{'puts/s':>7s} {'rt/health':>9s} {'ms/health':>9s}")
        for name, tree in trees.items():
            for network, port in (("loopback", server.port), (f"{args.rtt_ms} ms RTT", relay_port)):
                for conc in sorted({1, args.concurrency}):
                    url = server.create_database().replace(f":{server.port}/", f":{port}/")
                    rows = args.health_calls if conc == 1 else 0
                    health = ["--health-calls", str(rows)]
                    res = await run_child(
                        ["--tree", tree, "--url", url, "--concurrency", str(conc), *common, *health]
                    )
                    rt = f"{res['rt_per_put']:.1f}" if "rt_per_put" in res else "-"
                    rth = f"{res['rt_per_health']:.1f}" if "rt_per_health" in res else "-"
                    mh = f"{res['ms_per_health']:.2f}" if "ms_per_health" in res else "-"
                    print(
                        f"  {name:22s} {network:14s} {conc:4d} {rt:>7s} {res['ms_per_put']:7.2f} "
                        f"{res['puts_per_s']:7.0f} {rth:>9s} {mh:>9s}"
                    )
                    if "health" in res and network == "loopback" and args.verbose:
                        print(f"    health() with {args.health_calls} more rows: {res['health']}")
    finally:
        delayed.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="c2a2305", help="the older revision to compare with")
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rtt-ms", type=float, default=1.0)
    ap.add_argument("--health-calls", type=int, default=200_000, help="rows for ms/health")
    ap.add_argument("--verbose", action="store_true", help="print what health() answered")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args))))
    else:
        asyncio.run(parent(args))


if __name__ == "__main__":
    main()
