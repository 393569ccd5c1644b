"""Tokens the tree export saves against one sample per root-to-leaf path, on recorded sessions.

Replays each recording (default: ``tests/fixtures/opencode/logs/*.jsonl``, the OpenCode
sessions) through a proxy in front of the scripted engine (``capture-proxy replay``), for both
chat templates (reasoning kept or dropped by the template), then builds the rollout's samples
(``core.samples``) and its token tree (``core.token_tree``) from the store and prints, per session:
calls, chains, samples, tokens in one sample per path, tokens in the tree, and the saving.

    .venv/bin/python benchmarks/tree_export.py [RECORDING.jsonl ...]
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import sys
import tempfile
from pathlib import Path

from capture_proxy.cli.replay import run_replay
from capture_proxy.core.chains import build_chains
from capture_proxy.core.samples import chain_samples
from capture_proxy.core.token_tree import build_token_tree
from capture_proxy.store.sqlite import SQLiteStore

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "opencode" / "logs"


async def measure(recording: Path, template: str) -> tuple[int, int, int, int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(tmp) / "store"
        with contextlib.redirect_stdout(io.StringIO()):
            code = await run_replay(
                recording, rollout_id="bench", template=template, store_dir=store_dir
            )
        if code != 0:
            raise SystemExit(f"replay of {recording} failed ({code})")
        store = SQLiteStore(store_dir)
        await store.open()
        try:
            records = await store.get_rollout_calls("bench")
        finally:
            await store.close()
    chains = build_chains("bench", records)
    samples = [s for c in chains.chains for s in chain_samples(c)]
    tree = build_token_tree("bench", samples)
    return len(records), len(chains.chains), len(samples), tree.num_path_tokens, tree.num_tokens


async def main(paths: list[Path]) -> None:
    print(f"{'session':32} {'template':15} calls chains samples  path_tokens  tree_tokens  saved")
    totals = [0, 0]
    for path in paths:
        for template in ("keep_reasoning", "drop_reasoning"):
            calls, chains, samples, flat, tree = await measure(path, template)
            totals[0] += flat
            totals[1] += tree
            print(
                f"{path.stem:32} {template:15} {calls:5} {chains:6} {samples:7} {flat:12,} "
                f"{tree:12,} {1 - tree / flat:6.1%}"
            )
    flat, tree = totals
    print(f"{'all':48} {'':22} {flat:12,} {tree:12,} {1 - tree / flat:6.1%}")


if __name__ == "__main__":
    args = [Path(a) for a in sys.argv[1:]] or sorted(DEFAULT.glob("*.jsonl"))
    asyncio.run(main(args))
