"""The side-by-side floor bench's tables (``floor.py``): CPU per call by shape and target, the
ratios to the bare relay, CPU per streamed token, and issue 35's lines. Must not: measure.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.verification import Verification

#: issue 35: per non-streamed call, at most these times the relay's (1 client, 16 clients)
CALL_LIMITS = {"non-stream, 1 client": 2.0, "non-stream, 16 clients, one rollout": 3.0}
MARGINAL_TOKENS = 512 - 32


def report(
    figures: dict[tuple[str, str], list[float]], checks: Verification, args: argparse.Namespace
) -> int:
    def med(shape: str, target: str) -> float:
        return statistics.median(figures[(shape, target)])

    def cell(shape: str, target: str) -> str:
        values = figures[(shape, target)]
        return f"{med(shape, target):.2f} ({min(values):.2f}-{max(values):.2f})"

    shapes = list(dict.fromkeys(s for s, _ in figures if s != "commit"))
    modes = [t for t in args.targets if t not in ("relay", "relay-event", "least")]
    ratios = [t for t in args.targets if t not in ("relay", "relay-event")]
    workers = args.proxy_workers or "default (one per CPU)"
    print(
        f"\nCPU ms per call (process tree), medians of {args.rounds} rounds (range); "
        f"{args.calls} calls per cell (x2 at 16 clients); proxy --workers {workers}"
    )
    head = ["shape", *args.targets, *(f"{m} / relay" for m in ratios)]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for shape in shapes:
        row = [shape, *(cell(shape, t) for t in args.targets)]
        row += [f"{med(shape, m) / med(shape, 'relay'):.2f}x" for m in ratios]
        print("| " + " | ".join(row) + " |")
    failed = bool(checks.problems)
    print("\nCPU per streamed token (us): marginal, (512-token call - 32-token call) / 480")
    per_token: dict[str, float] = {}
    for target in args.targets:
        line = f"  {target:<17}"
        for suffix, clients in (("", "1 client"), ("@16", "16 clients")):
            long, short = (f"{n}-token stream, {clients}" for n in (512, 32))
            if (long, target) not in figures or (short, target) not in figures:
                continue
            per_token[target + suffix] = (
                (med(long, target) - med(short, target)) * 1000 / MARGINAL_TOKENS
            )
            spread = med(long, target) * 1000 / 512
            marginal = per_token[target + suffix]
            line += f" | {clients}: {marginal:6.2f} (per call / 512: {spread:6.2f})"
        print(line)
    print("\nissue 35:")
    floor = "relay-event" if "relay-event" in args.targets else "relay"
    for mode in modes:
        for suffix, label in (("", "1 client"), ("@16", "16 clients")):
            if mode + suffix not in per_token:
                continue
            ours, theirs = per_token[mode + suffix], per_token[floor + suffix]
            ok = ours <= theirs
            failed |= not ok
            print(
                f"  {mode}: marginal per streamed token at {label} {ours:.2f} us vs {floor}'s "
                f"{theirs:.2f} us = {ours / theirs:.2f}x (<= 1): {'PASS' if ok else 'FAIL'}"
            )
        for shape, limit in CALL_LIMITS.items():
            if (shape, mode) not in figures:
                continue  # --streams-only
            ratio = med(shape, mode) / med(shape, "relay")
            ok = ratio <= limit
            failed |= not ok
            print(
                f"  {mode}: {shape}: {med(shape, mode):.2f} ms vs the relay's "
                f"{med(shape, 'relay'):.2f} ms = {ratio:.2f}x (<= {limit:g}x): "
                f"{'PASS' if ok else 'FAIL'}"
            )
    commit = med("commit", "commit")
    print(f"\none {args.commit_kb} KB row committed, WAL, synchronous=FULL: {commit:.3f} ms CPU")
    print(
        f"chains checked (16-client shapes): {checks.rollouts_checked} sessions, problems "
        f"{len(checks.problems)}"
    )
    for text in checks.problems[:10]:
        print("  " + text)
    return 1 if failed else 0
