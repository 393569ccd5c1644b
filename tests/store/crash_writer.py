"""A writer for the crash test: puts a deterministic chain into a store, printing each call id
after ``put_call`` returned (that is the acknowledgement), until it is killed.

With WRITERS > 1, that many chains are written at once (rollouts ``ROLLOUT_ID.<k>``), so the
store's group commit takes several puts per commit.

Usage: ``python -m tests.store.crash_writer STORE_DIR ROLLOUT_ID [full|normal] [WRITERS]``
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np

from capture_proxy.core.records import CallRecord
from capture_proxy.store.sqlite import SQLiteStore

NEW_PROMPT, GEN, LAYERS, TOP_K = 300, 60, 8, 4


def make_record(rollout_id: str, turn: int, prompt: np.ndarray) -> CallRecord:
    """Turn ``turn`` of the chain with prompt ``prompt``; its content depends only on
    (rollout_id, turn, prompt), so a reader can rebuild what was acknowledged."""
    rng = np.random.default_rng([turn, len(rollout_id)])
    gen = rng.integers(0, 151_000, GEN).astype(np.uint32)
    return CallRecord(
        call_id=f"{rollout_id}-{turn:05d}",
        rollout_id=rollout_id,
        created_at=float(turn),
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=-rng.random(GEN, dtype=np.float32),
        routed_experts=rng.integers(0, 256, (GEN, LAYERS, TOP_K)).astype(np.uint8),
        routed_experts_start=int(prompt.shape[0]),
    )


def chain(rollout_id: str, turns: int) -> list[CallRecord]:
    out: list[CallRecord] = []
    prompt = np.arange(NEW_PROMPT, dtype=np.uint32)
    for turn in range(turns):
        rec = make_record(rollout_id, turn, prompt)
        out.append(rec)
        prompt = np.concatenate([rec.full_token_ids(), np.full(NEW_PROMPT, turn, np.uint32)])
    return out


async def write_chain(store: SQLiteStore, rollout_id: str) -> None:
    turn = 0
    prompt = np.arange(NEW_PROMPT, dtype=np.uint32)
    while True:
        rec = make_record(rollout_id, turn, prompt)
        await store.put_call(rec)
        sys.stdout.write(rec.call_id + "\n")
        sys.stdout.flush()
        prompt = np.concatenate([rec.full_token_ids(), np.full(NEW_PROMPT, turn, np.uint32)])
        turn += 1


async def main(store_dir: Path, rollout_id: str, synchronous: str, writers: int) -> None:
    store = SQLiteStore(store_dir, synchronous=synchronous)  # type: ignore[arg-type]
    await store.open()
    if writers == 1:
        await write_chain(store, rollout_id)
    await asyncio.gather(*(write_chain(store, f"{rollout_id}.{k}") for k in range(writers)))


if __name__ == "__main__":
    args = sys.argv[1:]
    synchronous = args[2] if len(args) > 2 else "full"
    asyncio.run(main(Path(args[0]), args[1], synchronous, int(args[3]) if len(args) > 3 else 1))
