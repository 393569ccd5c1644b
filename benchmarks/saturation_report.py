"""The saturation bench's tables: each phase's figures, the proxy beside the direct engine and
the bare relay of the same rate (ratios), and the pass lines of issue 35.

Must not: measure anything.
"""

from __future__ import annotations

import argparse
from typing import Any

#: issue 35: event-loop lag p99 and added inter-token p99 under this at the load one core
#: carries
LIMIT_MS = 50.0


def _f(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None or value != value else fmt.format(value)


def _median_rows(rows: list[dict[str, Any]]) -> dict[tuple[float, str], dict[str, Any]]:
    """One row per (rate, target): the round with the median tokens per second."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["rate"], r["target"]), []).append(r)
    out = {}
    for key, group in groups.items():
        group.sort(key=lambda r: r["tokens_per_s"])
        out[key] = group[len(group) // 2]
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> int:
    if not rows:
        return 1
    by = _median_rows(rows)
    mode = "streamed" if args.stream else "non-streamed"
    print(
        f"\nsaturation: {args.sessions} sessions, {mode}, answers {args.tokens} tokens, "
        f"TTFT {args.ttft_ms} ms, think {args.think_s} s, {args.calls} calls a session; "
        f"window {rows[0]['window_s']:.0f} s; rounds {args.rounds} (median shown)"
    )
    head = (
        "| rate | target | tokens/s | calls/s | target cores | us/token | tokens/s/core | "
        "calls/s/core | TTFT p50/p99 ms | gap p50/p99 ms | lag p50/p99 ms | KiB/stream | "
        "engine, clients cores | errors | lost | false, missed links |"
    )
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    failed = False
    notes: list[str] = []
    for (rate, name), r in sorted(by.items(), key=lambda kv: (kv[0][0], kv[1]["target"])):
        cores = r["cores"].get("target")
        tps, cps = r["tokens_per_s"], r["calls_per_s"]
        us = cores * 1e6 / tps if cores and tps else None
        errors = sum(r["errors"].values())
        lost = r.get("lost")
        links = f"{r['false_links']}, {r['missed_links']}" if "false_links" in r else "-"
        writer = r["cores"].get("writer")
        if writer is not None and cps:
            notes.append(
                f"  {name} at {rate:g}: the supervisor (the store's one writer) "
                f"{writer:.2f} cores, {writer * 1000 / cps:.2f} ms CPU per call"
            )
        failed |= bool(errors or lost or r.get("false_links") or r.get("missed_links"))
        failed |= bool(r.get("problems"))
        print(
            f"| {rate:g} | {name} | {tps:.0f} | {cps:.1f} | {_f(cores, '{:.2f}')} | {_f(us)} | "
            f"{_f(tps / cores if cores else None, '{:.0f}')} | "
            f"{_f(cps / cores if cores else None, '{:.1f}')} | "
            f"{r['ttft_ms'][0]:.0f}/{r['ttft_ms'][1]:.0f} | "
            f"{r['gap_ms'][0]:.1f}/{r['gap_ms'][1]:.1f} | "
            f"{_f(r['lag_p50_ms'])}/{_f(r['lag_p99_ms'])} | {_f(r['mem_per_stream_kib'])} | "
            f"{r['cores']['engine']:.2f}, {r['cores']['clients']:.2f} | "
            f"{errors or 0}{' ' + str(r['errors']) if errors else ''} | {_f(lost, '{}')} | "
            f"{links} |"
        )
    for line in notes:
        print(line)
    _ratios(by)
    if args.timeline:
        for (rate, name), r in sorted(by.items()):
            print(f"  timeline {name} at {rate:g} (s, tokens/s, open streams, target cores):")
            print("   " + " ".join(f"{t:.0f}:{n}/{o}/{c}" for t, n, o, c in r["timeline"]))
    return 1 if failed else 0


def _ratios(by: dict[tuple[float, str], dict[str, Any]]) -> None:
    """Each proxy beside the direct engine and the relay of its rate."""
    for (rate, name), r in sorted(by.items()):
        if not name.startswith("proxy"):
            continue
        direct, relay = by.get((rate, "direct")), by.get((rate, "relay"))
        if direct is not None:
            added_ttft = [r["ttft_ms"][i] - direct["ttft_ms"][i] for i in (0, 1)]
            added_gap = [r["gap_ms"][i] - direct["gap_ms"][i] for i in (0, 1)]
            lag = r["lag_p99_ms"]
            # (the lag's p99 is a bucket's upper bound: at most that)
            ok = lag is not None and lag <= LIMIT_MS and added_gap[1] < LIMIT_MS
            print(
                f"  {name} at {rate:g} tok/s/stream: added TTFT p50 {added_ttft[0]:+.1f} ms, "
                f"p99 {added_ttft[1]:+.1f} ms; added gap p50 {added_gap[0]:+.1f} ms, "
                f"p99 {added_gap[1]:+.1f} ms; lag p99 {_f(lag)} ms "
                f"(issue 35: both under {LIMIT_MS:g} ms: {'PASS' if ok else 'FAIL'}); "
                f"tokens/s {r['tokens_per_s'] / max(1e-9, direct['tokens_per_s']):.2f}x direct"
            )
        if relay is not None and relay["cores"].get("target") and r["cores"].get("target"):
            per_token = [x["cores"]["target"] / max(1e-9, x["tokens_per_s"]) for x in (r, relay)]
            print(
                f"  {name} at {rate:g}: CPU per token {per_token[0] * 1e6:.1f} us vs the relay's "
                f"{per_token[1] * 1e6:.1f} us = {per_token[0] / per_token[1]:.2f}x"
            )
