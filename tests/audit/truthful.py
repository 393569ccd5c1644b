"""A store whose captured data is the tiny model's own: the log probs and router top-k come
from transformers' public forward (full logits, ``output_router_logits=True``), not from the
audit's code path, so an audit of it must pass and each corruption must be caught."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from capture_proxy.core.records import CallRecord
from capture_proxy.store.sqlite import SQLiteStore
from tests.factories import record

#: A chain of three calls (prompt tokens new to each call, generated tokens) and a lone call.
CHAIN = [(12, 6), (3, 5), (4, 7)]
LONE = [(9, 4)]


def reference(model_dir: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
    """(log prob of ``ids[t]`` given ``ids[:t]`` float32 ``[seq]`` (NaN at 0), router top-k
    int64 ``[seq, layers, k]`` or None) from the model's standard forward, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    moe = hasattr(model.config, "num_experts")
    with torch.inference_mode():
        out = (
            model(torch.tensor([ids]), output_router_logits=True)
            if moe
            else model(torch.tensor([ids]))
        )
    logp = out.logits[0].float().log_softmax(-1)
    lp = np.full(len(ids), np.nan, np.float32)
    lp[1:] = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    if not moe:
        return lp, None
    k = model.config.num_experts_per_tok
    rows = [torch.topk(r.float(), k, dim=-1).indices.numpy() for r in out.router_logits]
    return lp, np.stack(rows, axis=1).astype(np.int64)


def _calls(
    rollout_id: str, shape: list[tuple[int, int]], seed: int, model_dir: Path, corrupt: str | None
) -> list[CallRecord]:
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    bounds = []
    for new_prompt, new_gen in shape:
        ids += rng.integers(1000, 150000, new_prompt).tolist()
        start = len(ids)
        ids += rng.integers(1000, 150000, new_gen).tolist()
        bounds.append((start, len(ids)))
    lp, experts = reference(model_dir, ids)
    out = []
    rows_end = 0
    for n, (start, end) in enumerate(bounds):
        gen_lp = lp[start:end].copy()
        if corrupt == "shift_log_probs":  # each log prob is the next token's
            gen_lp = (
                lp[start + 1 : end + 1].copy()
                if end < len(ids)
                else np.append(lp[start + 1 : end], lp[end - 1])
            )
        r = record(
            f"{rollout_id}-c{n}",
            ids[:start],
            ids[start:end],
            rollout_id=rollout_id,
            created_at=float(n),
        )
        r.generation_log_probs = gen_lp.astype(np.float32)
        if experts is not None:
            rows = experts[rows_end : end - 1]
            if corrupt == "shift_rows":  # row i holds position i + 1's routing
                rows = experts[rows_end + 1 : end]
            r.routed_experts = rows.astype(np.uint8)
            r.routed_experts_start = rows_end
            rows_end = end - 1
        out.append(r)
    if corrupt == "wrong_id":  # the last call's third generated id is not the one scored
        last = out[-1]
        gen = last.generation_token_ids.copy()
        gen[2] = 151000
        last.generation_token_ids = gen
    return out


def write_store(store_dir: Path, model_dir: Path, corrupt: str | None = None) -> None:
    """Rollouts ``chain`` (three linked calls) and ``lone`` (one call) with the model's own
    data; ``corrupt``: None, ``shift_log_probs``, ``shift_rows`` or ``wrong_id``."""

    async def put() -> None:
        store = SQLiteStore(store_dir)
        await store.open()
        try:
            for r in _calls("chain", CHAIN, 1, model_dir, corrupt) + _calls(
                "lone", LONE, 2, model_dir, corrupt
            ):
                await store.put_call(r)
        finally:
            await store.close()

    asyncio.run(put())
