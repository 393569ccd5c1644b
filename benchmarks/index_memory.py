"""The memory a process's link indexes hold (``proxy.linker.Linker``: one index per rollout,
kept least recently used first out), as the rollouts it has served grow: bounded by rollouts
alone (``link_index_max_rollouts``), it grows with every call of the rollouts it keeps; bounded
by calls too (``link_index_max_calls``), it stays flat.

``--rollouts`` agent sessions of ``--turns`` calls (``put_cost.session``: the linker's linking
facts, a verified parent, a 1,200-id first prompt growing per turn) are remembered by one
``Linker`` per bound, one rollout after another (each rollout's index loaded from an empty
store first, as on its first call). Printed every ``--every`` calls: the indexes held, the
calls they hold, and the bytes ``tracemalloc`` counts as allocated since the linker was made
and still held (its indexes, and its recent calls' bookkeeping: the records themselves are
the workload's and not counted); per call held.

Run: ``.venv/bin/python benchmarks/index_memory.py [--rollouts 400] [--turns 16]
[--max-calls 1600]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.put_cost import workload  # noqa: E402
from capture_proxy.proxy.cache_bounds import CacheBounds  # noqa: E402
from capture_proxy.proxy.linker import Linker  # noqa: E402
from capture_proxy.store.sqlite import SQLiteStore  # noqa: E402


async def measure(
    records: list[Any], max_calls: int, every: int
) -> list[tuple[int, int, int, int]]:
    """(calls remembered, indexes held, calls held, bytes held) every ``every`` calls."""
    with tempfile.TemporaryDirectory() as work:
        store = SQLiteStore(Path(work) / "store")
        await store.open()
        try:
            tracemalloc.start()
            linker = Linker(store, bounds=CacheBounds.of(index_calls=max_calls))
            base = tracemalloc.get_traced_memory()[0]
            rows = []
            for n, record in enumerate(records, 1):
                await linker.remember(record)
                if n % every == 0:
                    held = sum(len(index.entries) for index in linker.indexes.values())
                    used = tracemalloc.get_traced_memory()[0] - base
                    rows.append((n, len(linker.indexes), held, used))
            tracemalloc.stop()
            return rows
        finally:
            await store.close()


async def run(args: argparse.Namespace) -> int:
    records = workload(args.rollouts, args.turns, experts=False)
    print(f"{args.rollouts} rollouts x {args.turns} calls, remembered one rollout after another")
    bounds = (("rollouts only", 1 << 62), (f"calls <= {args.max_calls}", args.max_calls))
    for label, bound in bounds:
        print(f"\nbound: {label}")
        print("| calls remembered | indexes held | calls held | MB held | bytes per call held |")
        print("| --- | --- | --- | --- | --- |")
        for n, indexes, held, used in await measure(records, bound, args.every):
            print(f"| {n:,} | {indexes:,} | {held:,} | {used / 2**20:.1f} | {used / held:,.0f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=400)
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--max-calls", type=int, default=1600, help="the call bound of the second run")
    p.add_argument("--every", type=int, default=1600, help="print every this many calls")
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
