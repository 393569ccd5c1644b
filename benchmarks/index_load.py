"""A rollout's link index made from the store, two ways (``proxy.linker.Linker._load_index``):
from its records read whole (``get_rollout_calls`` + ``add_record``: one process, or a row
that cannot tell its facts) and from its rows' index facts (``stored_since`` from the first
row + ``refresh_index``: a ``serve --workers`` worker's first call of a rollout, no record
decoded). Wall time in process, best of ``--repeat``, for rollouts of growing size: one agent
session whose every call resends the history before it (a 1 KB system prompt, a 300-byte user
message and the answer per turn; 2,000-id first prompt, each call's prompt its parent's prompt
+ answer + 3 ids).

Run: ``.venv/bin/python benchmarks/index_load.py [--calls 100,400,1600] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capture_proxy.core.linking.index import LinkIndex, add_record, refresh_index  # noqa: E402
from capture_proxy.core.records import CallRecord  # noqa: E402
from capture_proxy.store.sqlite import SQLiteStore  # noqa: E402


async def fill(store: SQLiteStore, calls: int) -> None:
    """One session of ``calls`` calls in rollout ``r1``."""
    messages = [{"role": "system", "content": "You are a coding agent. " * 40}]
    prompt = list(range(1, 2001))
    for i in range(calls):
        messages = [*messages, {"role": "user", "content": f"step {i} " * 30}]
        generation = [5000 + i, 6000 + i]
        answer = {"role": "assistant", "content": f"answer {i}"}
        await store.put_call(
            CallRecord(
                call_id=f"c{i:05d}",
                rollout_id="r1",
                created_at=float(i),
                model="m",
                request_messages=list(messages),
                response_message=answer,
                prompt_token_ids=np.asarray(prompt, np.uint32),
                generation_token_ids=np.asarray(generation, np.uint32),
                generation_log_probs=np.full(2, -0.5, np.float32),
                linking={"verdict": "root", "child_digest": f"d{i}", "request_digest": f"q{i}"},
            )
        )
        messages = [*messages, answer]
        prompt = [*prompt, *generation, 7, 8, 9]


async def load_both(store: SQLiteStore) -> tuple[float, float, LinkIndex, LinkIndex]:
    """Seconds to make the index from the records read whole, and from the rows' facts."""
    t0 = time.perf_counter()
    whole = LinkIndex()
    for record in await store.get_rollout_calls("r1"):
        add_record(whole, record)
    t1 = time.perf_counter()
    facts, _ = await store._read(SQLiteStore._stored_since, "r1", 0)
    assert facts is not None
    from_rows = LinkIndex()
    refresh_index(from_rows, facts)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, whole, from_rows


async def run(calls: int, repeat: int) -> tuple[float, float, int]:
    """Best times of the two ways for a rollout of ``calls`` calls, and the keys filed."""
    store = SQLiteStore(Path(tempfile.mkdtemp(prefix="index-load-")) / "store")
    await store.open()
    try:
        await fill(store, calls)
        best_whole = best_rows = float("inf")
        for _ in range(repeat):
            whole_s, rows_s, whole, from_rows = await load_both(store)
            assert whole.entries.keys() == from_rows.entries.keys()
            best_whole, best_rows = min(best_whole, whole_s), min(best_rows, rows_s)
        keys = sum(e.history is not None for e in from_rows.entries.values())
        return best_whole, best_rows, keys
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", default="100,400,1600", help="rollout sizes (100,400,1600)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    print("| calls | records read whole | rows' index facts | ratio | history keys |")
    print("| --- | --- | --- | --- | --- |")
    for calls in (int(c) for c in args.calls.split(",")):
        whole_s, rows_s, keys = asyncio.run(run(calls, args.repeat))
        print(f"| {calls} | {whole_s * 1000:.1f} ms | {rows_s * 1000:.1f} ms | "
              f"{rows_s / whole_s:.3f}x | {keys} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
