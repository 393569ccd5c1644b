"""The store's put: the SQLite writer thread's CPU per ``put_call`` and database pages per
commit (or, ``--postgres``, the PostgreSQL store's), this tree against another
(``--baseline-src``) in the same run (issue 22: the writer's share of the proxy's CPU per call).

Workload: ``--rollouts`` agent sessions of ``--turns`` calls each, stored in chain order as the
proxy stores them: each call's prompt is its parent's prompt + generation + a tool result
(a 1,200-token first prompt; 40-160 generated tokens; 150-300 tokens of tool result), with
float32 log probs, the session's messages (a 3 KB system prompt, the task, then assistant
tool calls and tool results), an 8-tool list (also in the received body, as the chat front
keeps it), the linker's ``linking`` and a verified ``parent_call_id``, random call ids (as the
proxy's), and the ``RequestEncoding`` the proxy computes ahead (on the main thread, not
measured). ``--experts on`` adds routed experts ``uint8[new rows, 48, 8]`` (the rows after
the parent's). ``--prefill N``: the store holds N calls of other sessions first.

Each tree runs in a subprocess of its own (``PYTHONPATH``: its package is imported from there;
the workload is this file's, so both store the same records), on a new store with the
defaults (``synchronous=full``: one fsync per commit), and puts the records one at a time
through the real threaded store. Figures:
- ``user ms``, ``sys ms``: the writer thread's own CPU per put (``getrusage(RUSAGE_THREAD)``
  taken on the writer thread before and after) over all puts of a run; ``--rounds`` rounds
  of ``--repeats`` runs per tree, the trees in turn; medians over all runs, and ``vs base``
  the median over rounds of this tree's total / the baseline's. PostgreSQL: ``user ms`` is
  the store thread's CPU (user + system, ``schedstat``), ``sys ms`` the server's processes'
  (clock ticks), per put, through one pooled connection;
- ``pages``: WAL frames appended per put (a second pass with automatic checkpoints off, so
  the WAL holds every frame written; its size / (page size + 24)); ``KB`` the same in bytes.
Every record is read back after the pages pass and compared with what was put (tokens, log
probs, experts, messages, tools, metadata): a tree that stores something else fails.

Run: ``.venv/bin/python benchmarks/put_cost.py [--baseline-src DIR] [--experts off,on]
[--interleave] [--postgres]`` (``DIR``: e.g. ``git archive main | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

SYSTEM = "You are a coding agent. Follow the repository's conventions and run the tests. " * 40
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name}: " + "runs the given input and returns its output. " * 6,
            "parameters": {
                "type": "object",
                "properties": {
                    "input": {"type": "string", "description": "what to run"},
                    "timeout_ms": {"type": "integer", "description": "how long at most"},
                },
                "required": ["input"],
            },
        },
    }
    for name in ("bash", "read", "write", "edit", "glob", "grep", "list", "todo")
]
FIRST_PROMPT, VOCAB, LAYERS, TOP_K = 1200, 151_936, 48, 8


def _hex(rng: np.random.Generator) -> str:
    return rng.bytes(32).hex()


def session(rollout: str, turns: int, experts: bool, seed: int) -> list[Any]:
    """The records of one session's calls, in the order the proxy puts them."""
    rng = np.random.default_rng(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Fix the failing test in module {seed}. " * 8},
    ]
    prompt = rng.integers(0, VOCAB, FIRST_PROMPT).astype(np.uint32)
    out: list[Any] = []
    parent: str | None = None
    rows_end = 0
    for t in range(turns):
        call_id = f"call-{_hex(rng)[:32]}"  # as the proxy names calls: random (uuid4)
        gen = rng.integers(0, VOCAB, int(rng.integers(40, 160))).astype(np.uint32)
        args = json.dumps({"input": f"pytest -x tests/test_{t}.py", "timeout_ms": 60000})
        record = _turn(rng, (rollout, seed, t, call_id), messages, prompt, gen, args,
                       parent, rows_end if experts else None)  # fmt: skip
        out.append(record)
        response = record.response_message
        tool_text = f"tests/test_{t}.py::test_case FAILED: assert {t} == {t + 1}\n" * 12
        messages = [
            *messages,
            response,
            {"role": "tool", "tool_call_id": response["tool_calls"][0]["id"], "content": tool_text},
        ]
        tool_ids = rng.integers(0, VOCAB, int(rng.integers(150, 300))).astype(np.uint32)
        prompt = np.concatenate([prompt, gen, tool_ids])
        parent, rows_end = call_id, prompt.shape[0] - tool_ids.shape[0] - 1
    return out


def _turn(
    rng: np.random.Generator,
    names: tuple[str, int, int, str],
    messages: list[dict[str, Any]],
    prompt: np.ndarray,
    gen: np.ndarray,
    args: str,
    parent: str | None,
    rows_end: int | None,
) -> Any:
    """One call's record: a bash tool call answering ``messages`` (``names``: rollout, seed,
    turn, call id), with routed experts after row ``rows_end`` unless it is None."""
    from capture_proxy.core.records import CallRecord

    rollout, seed, t, call_id = names

    log_probs = (-rng.exponential(1.0, gen.shape[0])).astype(np.float32)
    response = {
        "role": "assistant",
        "content": f"Running the tests of step {t} to see what fails.",
        "tool_calls": [
            {
                "id": f"call_{_hex(rng)[:24]}",
                "type": "function",
                "function": {"name": "bash", "arguments": args},
            }
        ],
    }
    model = "Qwen/Qwen3-30B-A3B"
    received = {"model": model, "tools": TOOLS, "stream": False, "temperature": 1.0,
                "max_tokens": 4096, "logprobs": True}  # fmt: skip
    total = prompt.shape[0] + gen.shape[0]
    routed = None
    if rows_end is not None:
        routed = rng.integers(0, 128, (total - 1 - rows_end, LAYERS, TOP_K)).astype(np.uint8)
    return CallRecord(
        call_id=call_id,
        rollout_id=rollout,
        created_at=1_780_000_000.0 + seed * 1000 + t,
        model=model,
        latency_ms=float(rng.uniform(200, 900)),
        request_received=received,
        sampling={
            "sent": {"temperature": 1.0, "max_tokens": 4096, "logprobs": 1},
            "engine_defaults": ["top_p", "top_k", "min_p"],
        },
        request_messages=list(messages),
        request_tools=TOOLS,
        response_message=response,
        finish_reason="tool_calls",
        usage={
            "prompt_tokens": int(prompt.shape[0]),
            "completion_tokens": int(gen.shape[0]),
            "total_tokens": int(total),
        },
        http_status=200,
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=log_probs,
        routed_experts=routed,
        routed_experts_start=rows_end or 0,
        parent_call_id=parent,
        linking={
            "verdict": "root" if parent is None else "resolved",
            "parent_digest": None if parent is None else _hex(rng),
            "child_digest": _hex(rng),
            "request_digest": _hex(rng),
            "digest_parent_call_id": parent,
            "reason": None,
            "harness_note": None,
        },
    )


def workload(rollouts: int, turns: int, experts: bool, first: int = 0) -> list[Any]:
    """The records of sessions ``first`` .. ``first + rollouts - 1``, in put order."""
    calls: list[Any] = []
    for r in range(first, first + rollouts):
        calls += session(f"bench-r{r:05d}", turns, experts, seed=r * 2 + int(experts))
    return calls


def main_thread_work(record: Any) -> tuple[Any, ...]:
    """What the proxy's main thread does with the record's data before the put (and so what
    is in the caches when the writer reads it), as ``put_call``'s arguments after the record:
    the ``RequestEncoding`` computed ahead, and the linker's digests of the prompt
    (verification: ``RecordDigests`` with the block states made when the call has a parent,
    handed to the put when the tree's ``put_call`` takes them; else the prompt's digest, the
    caches' state). Not measured."""
    from capture_proxy.core.request_encoding import RequestEncoding

    request = RequestEncoding.of(record.request_messages, record.request_tools)
    if not _takes_digests():
        hashlib.sha256(record.prompt_token_ids).digest()
        return (request,)
    from capture_proxy.core.linking.record_digests import RecordDigests

    digests = RecordDigests(record)
    if record.parent_call_id is not None:  # verification checked the parent's tokens
        digests.extends(record.num_prompt_tokens, b"")
    return request, digests


@functools.cache
def _takes_digests() -> bool:
    """Whether this tree's ``put_call`` takes the proxy's ``RecordDigests``."""
    import inspect

    from capture_proxy.store.threaded import ThreadedStore

    return "digests" in inspect.signature(ThreadedStore.put_call).parameters


def _thread_usage() -> tuple[float, float]:
    u = resource.getrusage(resource.RUSAGE_THREAD)
    return u.ru_utime, u.ru_stime


def _same(a: Any, b: Any) -> bool:
    arrays = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    for name in arrays:
        if not np.array_equal(getattr(a, name), getattr(b, name)):
            return False
    ea, eb = a.routed_experts, b.routed_experts
    if (ea is None) != (eb is None) or (ea is not None and not np.array_equal(ea, eb)):
        return False
    skip = {*arrays, "routed_experts", "diagnostics", "status"}
    fields = [f for f in a.__dataclass_fields__ if f not in skip]
    return all(getattr(a, f) == getattr(b, f) for f in fields) and a.status == b.status


async def prefill(calls: list[Any], store_dir: Path) -> None:
    """A store holding ``calls`` (other rollouts), for runs on a store that is not new."""
    from capture_proxy.store.sqlite import SQLiteStore

    store = SQLiteStore(store_dir, synchronous="normal")
    await store.open()
    try:
        for record in calls:
            await store.put_call(record)
    finally:
        await store.close()


async def measure(
    calls: list[Any], store_dir: Path, pages: bool, template: Path | None = None
) -> dict[str, float]:
    """Put every call on a new store (a copy of ``template`` when given); the writer thread's
    CPU per put, or (``pages``) the WAL bytes per put with automatic checkpoints off."""
    from capture_proxy.store.sqlite import SQLiteStore

    if template is not None:
        shutil.copytree(template, store_dir)
        (store_dir / "writer.lock").unlink(missing_ok=True)
    store = SQLiteStore(store_dir)
    await store.open()
    writer = store._writer
    assert writer is not None
    try:
        if pages:
            await store._write_hop(lambda db: db.execute("PRAGMA wal_autocheckpoint=0"))
            await store._write_hop(lambda db: db.execute("PRAGMA wal_checkpoint(TRUNCATE)"))
        wal = store.db_path.with_name(store.db_path.name + "-wal")
        wal0 = wal.stat().st_size if wal.exists() else 0
        u0, s0 = await writer.run(_thread_usage)
        for record in calls:
            await store.put_call(record, *main_thread_work(record))
        u1, s1 = await writer.run(_thread_usage)
        page_size = await store._write_hop(lambda db: db.execute("PRAGMA page_size").fetchone()[0])
        wal1 = wal.stat().st_size
        n = len(calls)
        result = {
            "user_ms": (u1 - u0) * 1000 / n,
            "sys_ms": (s1 - s0) * 1000 / n,
            "wal_kb": (wal1 - wal0) / 1024 / n,
            "pages": (wal1 - wal0) / (page_size + 24) / n,
        }
        if pages:
            for rollout in sorted({r.rollout_id for r in calls}):
                got = {c.call_id: c for c in await store.get_rollout_calls(rollout)}
                for record in calls:
                    if record.rollout_id == rollout and not _same(got[record.call_id], record):
                        raise SystemExit(f"call {record.call_id} reads back different")
        return result
    finally:
        await store.close()


def _task_cpu_ns(tid: int) -> int:
    """CPU time of one of this process's threads (``schedstat``: nanoseconds, exact)."""
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (PostgreSQL's backends; clock ticks)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if entry.name == str(pid) or stat[1] == str(pid):
                total += int(stat[11]) + int(stat[12])
    return total / os.sysconf("SC_CLK_TCK")


async def measure_pg(calls: list[Any], url: str, server_pid: int) -> dict[str, float]:
    """Put every call on a new PostgreSQL database through one pooled connection (the
    proxy's case at one client): the store thread's CPU per put (``user_ms``: all of it, user
    and system) and the server's (``sys_ms``: its processes, in clock ticks)."""
    from capture_proxy.store.postgres import PostgresStore

    store = PostgresStore(url, pool_size=1)
    await store.open()
    try:
        assert store._worker is not None
        tid = store._worker._threads[0].native_id
        assert tid is not None
        c0, s0 = _task_cpu_ns(tid), _tree_cpu_s(server_pid)
        for record in calls:
            await store.put_call(record, *main_thread_work(record))
        c1, s1 = _task_cpu_ns(tid), _tree_cpu_s(server_pid)
    finally:
        await store.close()
    n = len(calls)
    return {"user_ms": (c1 - c0) / 1e6 / n, "sys_ms": (s1 - s0) * 1000 / n}


def child(args: argparse.Namespace) -> int:
    """One tree (the one imported): for each experts setting, ``--repeats`` CPU runs and a
    pages run; prints JSON."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="put-cost-") as tmp:
        for setting in args.experts.split(","):
            experts = setting == "on"
            template = None
            if args.prefill and not args.pg_urls:  # SQLite only
                template = Path(tmp) / f"{setting}-template"
                others = workload(args.prefill // args.turns, args.turns, experts, first=10_000)
                asyncio.run(prefill(others, template))
                del others
            calls = workload(args.rollouts, args.turns, experts)
            if args.interleave:  # every session's call k, then every session's call k + 1
                calls = [calls[r * args.turns + t] for t in range(args.turns)
                         for r in range(args.rollouts)]  # fmt: skip
            if args.pg_urls:
                urls = args.pg_urls.split(",")
                runs = [
                    asyncio.run(measure_pg(calls, urls.pop(), args.pg_pid))
                    for _ in range(args.repeats)
                ]
                out[setting] = {"runs": runs, "pages": math.nan, "wal_kb": math.nan}
                args.pg_urls = ",".join(urls)
                continue
            runs = [
                asyncio.run(measure(calls, Path(tmp) / f"{setting}-{i}", False, template))
                for i in range(args.repeats)
            ]
            page_dir = Path(tmp) / f"{setting}-pages"
            page_run = asyncio.run(measure(calls, page_dir, True, template))
            out[setting] = {"runs": runs, "pages": page_run["pages"], "wal_kb": page_run["wal_kb"]}
    print(json.dumps(out))
    return 0


def run_tree(
    name: str, src: str | None, args: argparse.Namespace, pg: Any = None
) -> dict[str, Any]:
    """One child run of a tree (``pg``: a ``PostgresServer``, for the PostgreSQL store)."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = str(Path(src).resolve())
    argv = [sys.executable, __file__, "--child", "--experts", args.experts]
    argv += ["--rollouts", str(args.rollouts), "--turns", str(args.turns)]
    argv += ["--repeats", str(args.repeats), "--prefill", str(args.prefill)]
    argv += ["--interleave"] if args.interleave else []
    if pg is not None:
        assert pg.proc is not None
        count = args.repeats * len(args.experts.split(","))
        argv += ["--pg-pid", str(pg.proc.pid)]
        argv += ["--pg-urls", ",".join(pg.create_database() for _ in range(count))]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _total(result: dict[str, Any]) -> float:
    return statistics.median(r["user_ms"] + r["sys_ms"] for r in result["runs"])


def report(rounds: list[dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    """Medians over every run of every round; with a baseline, the ratio this / @base of the
    total, round by round (the trees alternate, so a drift of the machine's speed cancels)."""
    where = "PostgreSQL, one pooled connection" if args.postgres else "SQLite, synchronous=full"
    print(
        f"{args.rollouts} sessions x {args.turns} calls on a store of {args.prefill} calls, "
        f"{where}, per put; {len(rounds)} rounds x {args.repeats} runs"
    )
    head = ("tree", "experts", "user ms", "sys ms", "total", "pages", "KB", "vs base")
    if args.postgres:
        print("user ms: the store thread's CPU (user + sys); sys ms: the server's (ticks)")
    print(f"{head[0]:8} {head[1]:8} " + " ".join(f"{h:>8}" for h in head[2:]))
    for name in rounds[0]:
        for setting in rounds[0][name]:
            runs = [r for rnd in rounds for r in rnd[name][setting]["runs"]]
            last = rounds[-1][name][setting]
            ratio = ""
            if name != "@base" and "@base" in rounds[0]:
                pairs = [
                    _total(rnd[name][setting]) / _total(rnd["@base"][setting]) for rnd in rounds
                ]
                ratio = f"{statistics.median(pairs):8.2f}"
            print(
                f"{name:8} {setting:8} {statistics.median(r['user_ms'] for r in runs):8.3f} "
                f"{statistics.median(r['sys_ms'] for r in runs):8.3f} "
                f"{statistics.median(r['user_ms'] + r['sys_ms'] for r in runs):8.3f} "
                f"{last['pages']:8.2f} {last['wal_kb']:8.1f} {ratio}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rollouts", type=int, default=20, help="sessions, one rollout each")
    p.add_argument("--turns", type=int, default=16, help="calls per session")
    p.add_argument("--experts", default="off,on", help="routed experts: off, on or off,on")
    p.add_argument("--repeats", type=int, default=3, help="CPU runs per tree and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the trees in turn")
    p.add_argument(
        "--prefill", type=int, default=0, help="SQLite: calls of other rollouts in the store first"
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="the sessions' puts in turn (call k of every session, then call k + 1), as "
        "sessions running at once put them",
    )
    p.add_argument("--baseline-src", metavar="DIR", help="also run this source tree as @base")
    p.add_argument(
        "--postgres",
        action="store_true",
        help="the PostgreSQL store instead (a throwaway server): ms/put of its thread and server",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pg-urls", help=argparse.SUPPRESS)
    p.add_argument("--pg-pid", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    trees = [("this", None)] + ([("@base", args.baseline_src)] if args.baseline_src else [])
    pg = None
    if args.postgres:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from benchmarks.infra import PostgresServer, postgres_bin_dir

        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise SystemExit("PostgreSQL is not installed (scripts/install-postgres)")
        pg = PostgresServer(bin_dir)
        pg.start()
    try:
        rounds = [
            {name: run_tree(name, src, args, pg) for name, src in trees} for _ in range(args.rounds)
        ]
    finally:
        if pg is not None:
            pg.stop()
    report(rounds, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
