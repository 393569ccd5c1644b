"""Metadata benchmark: put_call time and store bytes for an OpenCode-like agent session.

Workload: one chain of T turns (default 50) with OpenCode-like request JSON: ~20 KB of tool
schemas, an ~8 KB system prompt and a history that grows by an assistant tool call and a
~1.5 KB tool result per turn; each turn adds 400 prompt tokens and generates 100 (float32 log
probs, no routed experts). Reports the median and total ``put_call`` wall time, the time of
the last 10 puts, the database's logical size (page_count * page_size, WAL included) and its
growth per turn early and late in the chain. Uses only the public store API, so the same
script measures an older checkout: ``PYTHONPATH=<checkout> .venv/bin/python
benchmarks/metadata.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from capture_proxy.core.records import CallRecord
from capture_proxy.store.sqlite import SQLiteStore

NEW_PROMPT, GEN = 400, 100


def tools() -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool {i}. " + "Use it carefully. " * 55,
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "A path."}},
                    "required": ["path"],
                },
            },
        }
        for i in range(20)
    ]


def session(turns: int, seed: int = 0) -> list[CallRecord]:
    rng = np.random.default_rng(seed)
    history: list[dict] = [
        {"role": "system", "content": "You are OpenCode, an agent. " * 290},
        {"role": "user", "content": "Fix the failing test in the repository."},
    ]
    prompt = rng.integers(0, 151_000, NEW_PROMPT).astype(np.uint32)
    out = []
    for t in range(turns):
        gen = rng.integers(0, 151_000, GEN).astype(np.uint32)
        answer = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{t}",
                    "type": "function",
                    "function": {"name": "tool_1", "arguments": json.dumps({"path": f"f{t}"})},
                }
            ],
        }
        out.append(
            CallRecord(
                call_id=f"c{t:04d}",
                rollout_id="s",
                created_at=float(t),
                model="m",
                request_messages=json.loads(json.dumps(history)),
                request_tools=tools(),
                response_message=answer,
                prompt_token_ids=prompt,
                generation_token_ids=gen,
                generation_log_probs=-rng.random(GEN, dtype=np.float32),
            )
        )
        result = {"role": "tool", "tool_call_id": f"call_{t}", "content": f"line {t}\n" * 180}
        history = [*history, answer, result]
        extra = rng.integers(0, 151_000, NEW_PROMPT).astype(np.uint32)
        prompt = np.concatenate([prompt, gen, extra])
    return out


def db_bytes(path: Path) -> int:
    with sqlite3.connect(path) as db:
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        return int(pages * db.execute("PRAGMA page_size").fetchone()[0])


async def run(turns: int) -> None:
    records = session(turns)
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp))
        await store.open()
        times, sizes = [], []
        for rec in records:
            t0 = time.perf_counter()
            await store.put_call(rec)
            times.append(time.perf_counter() - t0)
            sizes.append(db_bytes(store.db_path))
        t0 = time.perf_counter()
        back = await store.get_rollout_calls("s")
        read_s = time.perf_counter() - t0
        await store.close()
    assert [r.request_messages for r in back] == [r.request_messages for r in records]
    assert all(r.request_tools == records[0].request_tools for r in back)
    w = min(10, turns // 5)
    print(f"turns: {turns}")
    print(f"put_call median: {statistics.median(times) * 1e3:.2f} ms")
    print(f"put_call last {w}: {statistics.mean(times[-w:]) * 1e3:.2f} ms mean")
    print(f"put_call total: {sum(times) * 1e3:.1f} ms")
    print(f"store bytes: {sizes[-1]:,}")
    print(f"growth per turn, turns {w}-{2 * w}: {(sizes[2 * w] - sizes[w]) / w:,.0f} B")
    print(f"growth per turn, last {w}: {(sizes[-1] - sizes[-1 - w]) / w:,.0f} B")
    print(f"get_rollout_calls: {read_s * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=50)
    asyncio.run(run(ap.parse_args().turns))


if __name__ == "__main__":
    main()
