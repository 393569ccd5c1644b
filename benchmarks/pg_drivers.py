"""Which PostgreSQL driver for the store: psycopg 3 (sync, libpq, on worker threads with
psycopg_pool, the shape of ``store/postgres.py``) against asyncpg (on the event loop, its own
pool), on the store's write transaction: advisory lock on the rollout, tombstone check, the
candidate select, an insert of ~6 KB of bytea, the rollout upsert, commit; and on a read of a
rollout's rows.

Prints transactions/s and this process's CPU per transaction (both drivers run in this
process, so CPU is what the proxy would spend). Run: ``.venv/bin/python
benchmarks/pg_drivers.py [--transactions 3000] [--concurrency 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.infra import PostgresServer, postgres_bin_dir  # noqa: E402

DDL = """
CREATE TABLE calls (call_id text PRIMARY KEY, rollout_id text NOT NULL, created_at float8,
  meta text, prompt bytea, gen bytea, lp bytea, n int, sha bytea);
CREATE INDEX ON calls (rollout_id, created_at);
CREATE TABLE tombstones (rollout_id text PRIMARY KEY);
CREATE TABLE rollouts (rollout_id text PRIMARY KEY, created_at float8, incomplete bool);
"""
META = '{"model":"m","usage":{"prompt_tokens":1000},"linking":{"verdict":"resolved"}}' * 8
PROMPT, GEN, LP = os.urandom(4000), os.urandom(1000), os.urandom(1000)


def cpu() -> float:
    t = os.times()
    return t.user + t.system


def psycopg_run(url: str, n: int, conc: int, rollouts: int) -> tuple[float, float, float]:
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(url, min_size=conc, max_size=conc, kwargs={"autocommit": True})
    pool.wait(30)

    def write(i: int) -> None:
        rid = f"r{i % rollouts}"
        with pool.connection() as c, c.transaction():
            c.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (rid,))
            c.execute("SELECT 1 FROM tombstones WHERE rollout_id = %s", (rid,)).fetchone()
            c.execute(
                "SELECT call_id, created_at, n, sha FROM calls WHERE rollout_id = %s", (rid,)
            ).fetchall()
            c.execute(
                "INSERT INTO calls VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING",
                (uuid.uuid4().hex, rid, time.time(), META, PROMPT, GEN, LP, 1, b"x" * 32),
            )
            c.execute(
                "INSERT INTO rollouts VALUES (%s,%s,false) ON CONFLICT (rollout_id) DO UPDATE "
                "SET incomplete = rollouts.incomplete OR excluded.incomplete",
                (rid, time.time()),
            )

    def read(i: int) -> None:
        with pool.connection() as c:
            c.execute(
                "SELECT * FROM calls WHERE rollout_id = %s", (f"r{i % rollouts}",), binary=True
            ).fetchall()

    async def drive(fn) -> None:  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        ex = ThreadPoolExecutor(conc)
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            async with sem:
                await loop.run_in_executor(ex, fn, i)

        await asyncio.gather(*(one(i) for i in range(n)))
        ex.shutdown()

    t0, c0 = time.perf_counter(), cpu()
    asyncio.run(drive(write))
    t1, c1 = time.perf_counter(), cpu()
    asyncio.run(drive(read))
    c2 = cpu()
    pool.close()
    return n / (t1 - t0), (c1 - c0) / n * 1000, (c2 - c1) / n * 1000


def asyncpg_run(url: str, n: int, conc: int, rollouts: int) -> tuple[float, float, float]:
    import asyncpg

    async def main() -> tuple[float, float, float]:
        pool = await asyncpg.create_pool(url, min_size=conc, max_size=conc)

        async def write(i: int) -> None:
            rid = f"r{i % rollouts}"
            async with pool.acquire() as c, c.transaction():
                await c.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", rid)
                await c.fetchrow("SELECT 1 FROM tombstones WHERE rollout_id = $1", rid)
                await c.fetch(
                    "SELECT call_id, created_at, n, sha FROM calls WHERE rollout_id = $1", rid
                )
                await c.execute(
                    "INSERT INTO calls VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9) ON CONFLICT DO NOTHING",
                    uuid.uuid4().hex, rid, time.time(), META, PROMPT, GEN, LP, 1, b"x" * 32,
                )
                await c.execute(
                    "INSERT INTO rollouts VALUES ($1,$2,false) ON CONFLICT (rollout_id) DO "
                    "UPDATE SET incomplete = rollouts.incomplete OR excluded.incomplete",
                    rid, time.time(),
                )

        async def read(i: int) -> None:
            async with pool.acquire() as c:
                await c.fetch("SELECT * FROM calls WHERE rollout_id = $1", f"r{i % rollouts}")

        sem = asyncio.Semaphore(conc)

        async def limited(fn, i: int) -> None:  # type: ignore[no-untyped-def]
            async with sem:
                await fn(i)

        t0, c0 = time.perf_counter(), cpu()
        await asyncio.gather(*(limited(write, i) for i in range(n)))
        t1, c1 = time.perf_counter(), cpu()
        await asyncio.gather(*(limited(read, i) for i in range(n)))
        c2 = cpu()
        await pool.close()
        return n / (t1 - t0), (c1 - c0) / n * 1000, (c2 - c1) / n * 1000

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transactions", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rollouts", type=int, default=500)
    args = ap.parse_args()
    bin_dir = postgres_bin_dir()
    assert bin_dir is not None, "PostgreSQL not installed (scripts/install-postgres)"
    server = PostgresServer(bin_dir)
    server.start()
    try:
        import psycopg

        print(f"{args.transactions} write transactions, then as many rollout reads, "
              f"{args.concurrency} at a time, {os.cpu_count()} CPUs")
        for name, run in (("psycopg 3 + pool, threads", psycopg_run), ("asyncpg", asyncpg_run)):
            url = server.create_database()
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(DDL)
            rate, w_cpu, r_cpu = run(url, args.transactions, args.concurrency, args.rollouts)
            print(f"  {name:28s} writes {rate:7.0f}/s  CPU {w_cpu:.3f} ms/write, "
                  f"{r_cpu:.3f} ms/read")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
