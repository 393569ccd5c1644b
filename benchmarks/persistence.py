"""Persistence benchmark: the capture store against a JSON-history envelope (issue 5).

Workload (the published figures' shape): a chain of T turns (T = 1, 8, 32); each turn adds
2,048 prompt tokens and generates 512, with float32 log probs and routed experts
``[512, 64, 8]`` over 256 experts (ids < 256) for the generated positions. Engine data is made
up front and not measured. Each system, per turn:

- capture: engine arrays -> the in-memory form it persists. Ours: a ``CallRecord`` with the full
  prompt (as an engine reports it) and experts narrowed to uint8. JSON: a turn dict of nested
  lists (``tolist()``) appended to the history, the way the published envelope was built.
- persist: ours: ``SQLiteStore.put_call`` (codec, prompt parent, one durable commit);
  JSON: the whole history as compact JSON, written and fsynced after every turn (checkpoint).
- restore (after all turns, from disk): ours: open the store, ``get_rollout_calls``,
  ``build_chains``; JSON: ``json.load`` and conversion back to numpy arrays.
- replay: the chain as training arrays (input_ids, loss_mask, log_probs, routed experts aligned
  to the sequence): ours ``core.samples.chain_samples``; JSON the same arrays built by hand.

Times are medians of 3 repeats (wall clock, no tracemalloc); peak allocation is a separate run
per system with tracemalloc over all four phases (Python and numpy allocations; SQLite's own C
allocations are not traced). Every restore is checked bit for bit against the engine data, and
both replays against each other. Run: ``.venv/bin/python benchmarks/persistence.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from capture_proxy.core.chains import build_chains
from capture_proxy.core.codec import compact_routed_experts
from capture_proxy.core.records import CallRecord
from capture_proxy.core.samples import chain_samples
from capture_proxy.store.sqlite import SQLiteStore

NEW_PROMPT, GEN, LAYERS, TOP_K, EXPERTS, VOCAB = 2048, 512, 64, 8, 256, 151_936
MIB = 1024 * 1024


@dataclass
class Turn:
    """What the engine reported for one turn."""

    new_prompt: np.ndarray  # uint32 [2048], the tokens this turn adds
    prompt: np.ndarray  # uint32 [prompt so far], the full prompt the engine saw
    gen: np.ndarray  # uint32 [512]
    log_probs: np.ndarray  # float32 [512]
    experts: np.ndarray  # int32 [512, 64, 8], rows for the generated positions


def make_turns(n: int, seed: int = 0) -> list[Turn]:
    rng = np.random.default_rng(seed)
    turns: list[Turn] = []
    prefix = np.zeros(0, np.uint32)
    for _ in range(n):
        new = rng.integers(0, VOCAB, NEW_PROMPT).astype(np.uint32)
        prompt = np.concatenate([prefix, new])
        gen = rng.integers(0, VOCAB, GEN).astype(np.uint32)
        log_probs = -rng.exponential(1.0, GEN).astype(np.float32)
        experts = rng.integers(0, EXPERTS, (GEN, LAYERS, TOP_K)).astype(np.int32)
        turns.append(Turn(new, prompt, gen, log_probs, experts))
        prefix = np.concatenate([prompt, gen])
    return turns


@dataclass
class Result:
    capture_s: float = 0.0
    persist_s: float = 0.0
    restore_s: float = 0.0
    replay_s: float = 0.0
    stored_bytes: int = 0
    written_bytes: int = 0
    peak_bytes: int = 0
    replay: dict[str, np.ndarray] = field(default_factory=dict)


# -- ours ----------------------------------------------------------------------------------


def _no_hook() -> None:
    return None


async def run_ours(
    turns: list[Turn], work: Path, on_restored: Callable[[], None] = _no_hook
) -> Result:
    res = Result()
    store = SQLiteStore(work / "store")
    await store.open()
    for i, t in enumerate(turns):
        t0 = time.perf_counter()
        rec = CallRecord(
            call_id=f"call-{i:04d}",
            rollout_id="bench",
            created_at=float(i),
            prompt_token_ids=t.prompt,
            generation_token_ids=t.gen,
            generation_log_probs=t.log_probs,
            routed_experts=compact_routed_experts(t.experts),
            routed_experts_start=int(t.prompt.shape[0]),
        )
        t1 = time.perf_counter()
        await store.put_call(rec)
        t2 = time.perf_counter()
        res.capture_s += t1 - t0
        res.persist_s += t2 - t1
        del rec
    await store.close()
    res.stored_bytes = sum(f.stat().st_size for f in (work / "store").iterdir())
    res.written_bytes = res.stored_bytes

    t0 = time.perf_counter()
    reader = SQLiteStore(work / "store")
    await reader.open()
    records = await reader.get_rollout_calls("bench")
    await reader.close()
    chains = build_chains("bench", records)
    t1 = time.perf_counter()
    on_restored()
    (sample,) = chain_samples(chains.chains[0])
    t2 = time.perf_counter()
    res.restore_s, res.replay_s = t1 - t0, t2 - t1
    check_ours(records, turns)
    res.replay = {k: sample.arrays[k] for k in ("input_ids", "loss_mask", "log_probs")}
    res.replay["routed_experts"] = sample.arrays["routed_experts"]
    return res


def check_ours(records: list[CallRecord], turns: list[Turn]) -> None:
    assert len(records) == len(turns)
    for rec, t in zip(records, turns, strict=True):
        assert rec.prompt_token_ids.dtype == np.uint32
        assert rec.prompt_token_ids.tobytes() == t.prompt.tobytes()
        assert rec.generation_token_ids.tobytes() == t.gen.tobytes()
        assert rec.generation_log_probs.dtype == np.float32
        assert rec.generation_log_probs.tobytes() == t.log_probs.tobytes()
        assert rec.routed_experts is not None and rec.routed_experts.dtype == np.uint8
        assert np.array_equal(rec.routed_experts, t.experts)
        assert rec.routed_experts_start == t.prompt.shape[0]


# -- JSON history baseline -----------------------------------------------------------------


def run_json(turns: list[Turn], work: Path, on_restored: Callable[[], None] = _no_hook) -> Result:
    res = Result()
    path = work / "history.json"
    history: list[dict] = []
    for t in turns:
        t0 = time.perf_counter()
        history.append(
            {
                "prompt_token_ids": t.new_prompt.tolist(),
                "output_token_ids": t.gen.tolist(),
                "output_logprobs": t.log_probs.tolist(),
                "routed_experts": t.experts.tolist(),
            }
        )
        t1 = time.perf_counter()
        text = json.dumps({"turns": history}, separators=(",", ":"))
        with open(path, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        res.written_bytes += len(text)
        del text
        t2 = time.perf_counter()
        res.capture_s += t1 - t0
        res.persist_s += t2 - t1
    del history
    res.stored_bytes = path.stat().st_size

    t0 = time.perf_counter()
    with open(path) as f:
        raw = json.load(f)["turns"]
    restored = [
        {
            "new_prompt": np.asarray(r["prompt_token_ids"], np.uint32),
            "gen": np.asarray(r["output_token_ids"], np.uint32),
            "log_probs": np.asarray(r["output_logprobs"], np.float32),
            "experts": np.asarray(r["routed_experts"], np.uint8),
        }
        for r in raw
    ]
    del raw
    t1 = time.perf_counter()
    on_restored()
    parts, mask, lps, spans = [], [], [], []
    pos = 0
    for r in restored:
        n_new, n_gen = r["new_prompt"].shape[0], r["gen"].shape[0]
        parts += [r["new_prompt"], r["gen"]]
        mask += [np.zeros(n_new, np.uint8), np.ones(n_gen, np.uint8)]
        lps += [np.zeros(n_new, np.float32), r["log_probs"]]
        spans.append(pos + n_new)
        pos += n_new + n_gen
    input_ids = np.concatenate(parts)
    experts = np.zeros((pos, LAYERS, TOP_K), np.uint8)
    for start, r in zip(spans, restored, strict=True):
        experts[start : start + r["experts"].shape[0]] = r["experts"]
    t2 = time.perf_counter()
    res.restore_s, res.replay_s = t1 - t0, t2 - t1
    for r, t in zip(restored, turns, strict=True):
        assert r["new_prompt"].tobytes() == t.new_prompt.tobytes()
        assert r["gen"].tobytes() == t.gen.tobytes()
        assert r["log_probs"].tobytes() == t.log_probs.tobytes()
        assert np.array_equal(r["experts"], t.experts)
    res.replay = {
        "input_ids": input_ids,
        "loss_mask": np.concatenate(mask),
        "log_probs": np.concatenate(lps),
        "routed_experts": experts,
    }
    return res


# -- driver --------------------------------------------------------------------------------


def one(
    system: str, turns: list[Turn], *, trace: bool, restored: Callable[[], None] = _no_hook
) -> Result:
    """One run; ``restored`` is called between restore and replay (phase boundary)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{system}-") as tmp:
        gc.collect()
        if trace:
            tracemalloc.start()
        if system == "ours":
            res = asyncio.run(run_ours(turns, Path(tmp), restored))
        else:
            res = run_json(turns, Path(tmp), restored)
        if trace:
            res.peak_bytes = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    return res


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_rss_child(system: str, n: int) -> None:
    """In a fresh process: the peak resident-set growth (bytes, printed) through restore
    (capture, persist, restore) and then of the replay alone (building the training arrays).
    The high-water mark is reset after the engine data is made and at the phase boundary
    (``/proc/self/clear_refs``)."""
    turns = make_turns(n)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    through_restore: list[int] = []

    def restored() -> None:
        through_restore.append((_status_kib("VmHWM") - before) * 1024)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    one(system, turns, trace=False, restored=restored)
    print(through_restore[0], (_status_kib("VmHWM") - before) * 1024)


def peak_rss(system: str, n: int) -> tuple[int, int]:
    """(peak growth through restore, peak growth including replay) in bytes."""
    out = subprocess.run(
        [sys.executable, __file__, "--peak-rss-child", system, str(n)],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    restore_peak, replay_peak = (int(x) for x in out.stdout.split()[-2:])
    return restore_peak, max(restore_peak, replay_peak)


def median(results: list[Result], name: str) -> float:
    return statistics.median(getattr(r, name) for r in results)


def row(label: str, a: float | None, b: float | None, unit: str) -> None:
    scale = {"MiB": MIB, "s": 1.0}[unit]
    if a is None or b is None:
        print(f"{label:24}{'-':>15}{'-':>16}{'(not measured)':>15}")
        return
    ratio = f"{b / a:>13.1f}x" if a else f"{'inf':>14}"
    print(f"{label:24}{a / scale:>11.3f} {unit:<3}{b / scale:>12.3f} {unit:<3}{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--trace-max-turns",
        type=int,
        default=8,
        help="tracemalloc runs only up to this many turns: tracing slows JSON encoding ~15x",
    )
    ap.add_argument(
        "--peak-rss-child", nargs=2, metavar=("SYSTEM", "TURNS"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.peak_rss_child:
        peak_rss_child(args.peak_rss_child[0], int(args.peak_rss_child[1]))
        return
    print(
        f"workload: +{NEW_PROMPT} prompt tokens and {GEN} generated per turn, routed experts "
        f"[{GEN}, {LAYERS}, {TOP_K}] over {EXPERTS} experts; medians of {args.repeats} repeats"
    )
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    t_start = time.perf_counter()
    systems = ("ours", "json")
    for n in args.turns:
        turns = make_turns(n)
        runs = {s: [one(s, turns, trace=False) for _ in range(args.repeats)] for s in systems}
        traced = {
            s: None if n > args.trace_max_turns else one(s, turns, trace=True) for s in systems
        }
        rss = {s: peak_rss(s, n) for s in systems}
        ours, js = runs["ours"][0], runs["json"][0]
        for k, arr in ours.replay.items():  # both restores give the same training arrays
            assert arr.dtype == js.replay[k].dtype and arr.tobytes() == js.replay[k].tobytes(), k
        print(f"\n== {n} turn{'s' if n > 1 else ''} ==  (restore checked bit for bit: ok)")
        print(f"{'':24}{'ours':>15}{'json history':>16}{'json / ours':>14}")

        def med(name: str, runs: dict[str, list[Result]] = runs) -> tuple[float, float]:
            return median(runs["ours"], name), median(runs["json"], name)

        row("stored bytes", *med("stored_bytes"), "MiB")
        row("  per turn", *(x / n for x in med("stored_bytes")), "MiB")
        row("bytes written", *med("written_bytes"), "MiB")
        row("capture (all turns)", *med("capture_s"), "s")
        row("persist (all turns)", *med("persist_s"), "s")
        cp = [statistics.median(r.capture_s + r.persist_s for r in runs[s]) for s in systems]
        row("capture + persist", cp[0], cp[1], "s")
        row("restore (chain read)", *med("restore_s"), "s")
        row("replay (train arrays)", *med("replay_s"), "s")
        peaks = [None if traced[s] is None else traced[s].peak_bytes for s in systems]
        row("peak alloc (tracemalloc)", peaks[0], peaks[1], "MiB")
        row("peak RSS: through restore", rss["ours"][0], rss["json"][0], "MiB")
        row("peak RSS: incl. replay", rss["ours"][1], rss["json"][1], "MiB")
    print(f"\ntotal benchmark time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
