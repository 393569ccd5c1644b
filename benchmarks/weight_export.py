"""What weight versions cost the training reads: the npz archive and the Arrow export of one
long rollout, in time and bytes, against a source tree without them (``--baseline-src``).

One synthetic rollout, built in memory: a chain of ``--turns`` calls (each adds
``--interstitial`` prompt tokens and generates ``--generated`` tokens), each call's generation
in two weight-version spans (an update in the middle of every call), plus ``--branches``
side branches off the middle call, so the rollout has several samples. Each tree, in a process
of its own (``src`` first on ``sys.path``), builds the chains and writes the npz archive and the
export's record batch, each as its REST read does, ``--repeat`` times; the median milliseconds
and the bytes are printed per
tree (the medians of ``--rounds`` rounds, the trees in turn in each), then this tree's ratios
to the baseline. This tree also times the same reads with a ``min_weight_version`` filter that
keeps every sample (the filter's own cost: every call's spans checked once).

Run: ``.venv/bin/python benchmarks/weight_export.py --baseline-src DIR`` (DIR: e.g.
``git archive <base> | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

# Runs in the measured process: ``src`` first on sys.path, then this code.
CHILD = r"""
import io, json, statistics, sys, time
import numpy as np
from capture_proxy.core.chains import build_chains
from capture_proxy.core.export import ExportEncoder
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.records import CallRecord
from capture_proxy.core import samples as samples_module

args = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
records, prompt = [], np.zeros(0, np.uint32)

def call(call_id, prompt, n, created_at, step):
    gen = rng.integers(0, 150_000, n).astype(np.uint32)
    half = n // 2
    return CallRecord(
        call_id=call_id, rollout_id="bench", created_at=created_at,
        prompt_token_ids=prompt, generation_token_ids=gen,
        generation_log_probs=-rng.random(n).astype(np.float32),
        weight_versions=[{"version": str(step), "start": 0, "end": half},
                         {"version": str(step + 1), "start": half, "end": n}],
        weight_version_source="engine_spans",
    )

for t in range(args["turns"]):
    new = rng.integers(0, 150_000, args["interstitial"]).astype(np.uint32)
    prompt = np.concatenate([prompt, new])
    rec = call(f"c{t:04}", prompt, args["generated"], float(t), t)
    records.append(rec)
    if t == args["turns"] // 2:
        for b in range(args["branches"]):
            side = np.concatenate([rec.full_token_ids(), np.array([b + 1], np.uint32)])
            records.append(call(f"b{b:04}", side, args["generated"], t + 0.5, t))
    prompt = rec.full_token_ids()

manifest = {"rollout_id": "bench", "cursor": 1, "snapshot": {"snapshot_id": "s"}, "version": 1,
            "episode_of": "bench", "attempt": 0, "main_chain_id": "c0000", "lineage": {}}
filtered = args["filtered"]

def samples_of(chains):
    if filtered:
        from capture_proxy.core.weight_filter import WeightFilter, select
        return select(chains, WeightFilter(min_version=0)).samples()
    return [s for c in chains.chains for s in samples_module.chain_samples(c)]

def npz():  # as GET .../chains?format=npz
    chains = build_chains("bench", records)
    buf = io.BytesIO()
    if filtered:
        samples_module.write_archive(chains, buf, {}, samples=samples_of(chains))
    else:
        samples_module.write_archive(chains, buf, {})
    return len(buf.getvalue())

def arrow():  # as one rollout of GET /captures/export
    chains = build_chains("bench", records)
    return len(ExportEncoder().rollout(manifest, samples_of(chains), RolloutMetadata()))

out = {"tokens": int(records[-1].num_prompt_tokens + records[-1].num_generation_tokens),
       "samples": len(samples_of(build_chains("bench", records)))}
for name, fn in (("npz", npz), ("arrow", arrow)):
    fn()  # warm-up
    times = []
    for _ in range(args["repeat"]):
        t0 = time.perf_counter()
        out[name + "_bytes"] = fn()
        times.append((time.perf_counter() - t0) * 1000)
    out[name + "_ms"] = statistics.median(times)
print(json.dumps(out))
"""


def measure(src: Path, args: argparse.Namespace, filtered: bool) -> dict:
    params = {
        "turns": args.turns,
        "interstitial": args.interstitial,
        "generated": args.generated,
        "branches": args.branches,
        "repeat": args.repeat,
        "filtered": filtered,
    }
    code = f"import sys; sys.path.insert(0, {str(src)!r})\n" + CHILD
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(params)],
        check=True,
        capture_output=True,
        text=True,
        cwd=src,
    )
    result: dict = json.loads(out.stdout)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-src", metavar="DIR", required=True)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--interstitial", type=int, default=300)
    ap.add_argument("--generated", type=int, default=400)
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="base and this tree in turn, N times")
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"base": [], "this": [], "this+filter": []}
    for _ in range(args.rounds):
        rows["base"].append(measure(Path(args.baseline_src), args, False))
        rows["this"].append(measure(HERE, args, False))
        rows["this+filter"].append(measure(HERE, args, True))
    first = rows["this"][0]
    print(f"rollout: {first['samples']} samples, leaf sequence {first['tokens']:,} tokens")
    print(f"{'tree':12} {'npz ms':>8} {'npz bytes':>12} {'arrow ms':>9} {'arrow bytes':>12}")
    medians = {}
    for name, runs in rows.items():
        med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
        medians[name] = med
        print(
            f"{name:12} {med['npz_ms']:8.2f} {med['npz_bytes']:12,} {med['arrow_ms']:9.2f} "
            f"{med['arrow_bytes']:12,}"
        )
    base = medians["base"]
    for name in ("this", "this+filter"):
        m = medians[name]
        print(
            f"{name} / base: npz time {m['npz_ms'] / base['npz_ms']:.3f}x, bytes "
            f"{m['npz_bytes'] / base['npz_bytes']:.3f}x; arrow time "
            f"{m['arrow_ms'] / base['arrow_ms']:.3f}x, bytes "
            f"{m['arrow_bytes'] / base['arrow_bytes']:.3f}x"
        )

if __name__ == "__main__":
    main()
