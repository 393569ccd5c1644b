"""How long ``capture-proxy audit`` takes on one long rollout, against a bare forward pass.

Writes a store with one chain of ``--calls`` calls (about ``--tokens`` tokens in all, a third
of them generated) whose log probs and routed experts are the model's own (transformers'
public forward, float32), then times the command as a user runs it (a fresh process: imports,
model load, samples through the exporters, the forward pass, the comparison) and, as the
baseline, a fresh process that imports torch and transformers, loads the model and runs one
bare ``model(input_ids)`` of the same length in the same dtype.

    .venv/bin/python benchmarks/audit.py .cache/models/qwen3-moe [--calls 20] [--tokens 1000]

Needs the audit extra (scripts/install-audit) and a model directory (scripts/e2e-vllm builds
the tiny ones into .cache/models/).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from capture_proxy.core.records import CallRecord
from capture_proxy.store.sqlite import SQLiteStore


def own_data(model_dir: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    moe = hasattr(model.config, "num_experts")
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_router_logits=moe)
    logp = out.logits[0].float().log_softmax(-1)
    lp = np.full(len(ids), np.nan, np.float32)
    lp[1:] = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    if not moe:
        return lp, None
    k = model.config.num_experts_per_tok
    rows = [torch.topk(r.float(), k, dim=-1).indices.numpy() for r in out.router_logits]
    return lp, np.stack(rows, axis=1)


async def write_store(store_dir: Path, model_dir: Path, calls: int, tokens: int) -> int:
    rng = np.random.default_rng(0)
    per_call = tokens // calls
    gen = per_call // 3
    ids: list[int] = []
    bounds = []
    for _ in range(calls):
        ids += rng.integers(1000, 150000, per_call - gen).tolist()
        bounds.append((len(ids), len(ids) + gen))
        ids += rng.integers(1000, 150000, gen).tolist()
    lp, experts = own_data(model_dir, ids)
    store = SQLiteStore(store_dir)
    await store.open()
    rows_end = 0
    try:
        for n, (start, end) in enumerate(bounds):
            record = CallRecord(
                call_id=f"c{n:02d}",
                rollout_id="bench",
                created_at=float(n),
                prompt_token_ids=np.asarray(ids[:start], np.uint32),
                generation_token_ids=np.asarray(ids[start:end], np.uint32),
                generation_log_probs=lp[start:end].astype(np.float32),
            )
            if experts is not None:
                record.routed_experts = experts[rows_end : end - 1].astype(np.uint8)
                record.routed_experts_start = rows_end
                rows_end = end - 1
            await store.put_call(record)
    finally:
        await store.close()
    return len(ids)


BARE = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
with torch.inference_mode():
    model(torch.randint(1000, 150000, (1, int(sys.argv[3]))))
"""


def bare_forward_s(model_dir: Path, num_tokens: int, dtype: str) -> float:
    """Wall seconds of the least a fresh process can do: import torch and transformers, load
    the model, one forward pass over ``num_tokens`` tokens (full logits)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-c", BARE, str(model_dir), dtype, str(num_tokens)]
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(tmp) / "store"
        num_tokens = asyncio.run(write_store(store_dir, args.model, args.calls, args.tokens))
        cmd = [sys.executable, "-m", "capture_proxy.cli", "audit", str(store_dir)]
        cmd += ["--model", str(args.model), "--dtype", args.dtype, "--json", f"{tmp}/a.json"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        audit_s = time.perf_counter() - t0
    print(done.stdout, end="")
    forward_s = bare_forward_s(args.model, num_tokens, args.dtype)
    print(
        f"benchmark: {args.calls} calls, {num_tokens} tokens, {args.dtype}: "
        f"capture-proxy audit {audit_s:.1f} s wall (exit {done.returncode}); "
        f"baseline (fresh process: imports, model load, one bare forward) {forward_s:.1f} s; "
        f"ratio {audit_s / forward_s:.2f}"
    )
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
