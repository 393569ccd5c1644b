"""What the audit shows: the terminal summary, the JSON file and the plot.

Owns the presentation of an ``run.AuditResult``; computes no figure itself. The plot needs
matplotlib (the ``audit`` extra), imported only when a plot is asked for, with its file-only
backend (Agg: no display).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from capture_proxy.audit.run import AuditResult


def _g(value: Any, spec: str = ".4g") -> str:
    return "–" if value is None else format(value, spec)


def summary_lines(result: AuditResult) -> list[str]:
    """The summary as lines of text (no colour, so it reads the same in a CI log)."""
    doc = result.document
    lp, routing, model = doc["log_probs"], doc["routing"], doc["model"]
    th = doc["thresholds"]
    lines = [
        f"audit of {doc['source']} ({doc['form']}) with {model['dir']} "
        f"[{model['device']}, {model['dtype']}]",
        f"  {doc['num_rollouts']} rollouts, {doc['num_samples']} samples, "
        f"{doc['num_sample_tokens']} tokens, {lp['num_tokens']} generated "
        f"({lp['num_compared']} compared, {lp['num_non_finite']} non-finite)",
        f"  log prob |delta| (nats): mean {_g(lp['mean_abs_delta'])}, "
        f"p99 {_g(lp['p99_abs_delta'])}, max {_g(lp['max_abs_delta'])}; "
        f"over {th['token_delta']:g}: {_g(lp['fraction_over'], '.3%')}",
        f"  KL(rollout||model) per token: k3 {_g(lp['k3_mean'])}, k1 {_g(lp['k1_mean'])}, "
        f"k2 {_g(lp['k2_mean'])}; ratio [{_g(lp['ratio_min'])}, {_g(lp['ratio_max'])}], "
        f"TIS clip at {th['tis_cap']:g}: {_g(lp['tis_clip_fraction'], '.3%')}, "
        f"MIS mask: {_g(lp['mis_mask_fraction'], '.3%')}",
        "  alignment (mean |delta| at shift -1 / 0 / +1): "
        + " / ".join(_g(doc["alignment"][k]) for k in ("-1", "0", "1")),
    ]
    if routing["status"] == "compared":
        per_layer = ", ".join(f"{x:.3f}" for x in routing["per_layer"])
        lines.append(
            f"  routing: {routing['num_rows']} rows, agreement {_g(routing['agreement'])}, "
            f"same set {_g(routing['exact_fraction'], '.2%')}; per layer [{per_layer}]; "
            f"rows one off: -1 {_g(routing['shifted'].get('-1'))}, "
            f"+1 {_g(routing['shifted'].get('1'))}"
        )
    else:
        lines.append(
            f"  routing: {routing['status']}{': ' if routing['detail'] else ''}{routing['detail']}"
        )
    if doc["worst"]:
        lines.append("  worst positions:")
        for w in doc["worst"]:
            token = "" if w["token"] is None else f" {w['token']!r}"
            lines.append(
                f"    {w['rollout_id']} {w['call_id'] or w['leaf_call_id']} @{w['position']} "
                f"id {w['token_id']}{token}: captured {w['captured']:.4f}, "
                f"model {w['recomputed']:.4f}, delta {w['delta']:+.4f}"
            )
    t = doc["timing"]
    lines.append(
        f"  forward {t['forward_s']:.2f} s ({_g(t['tokens_per_s'], '.0f')} tokens/s), "
        f"audit {t['audit_s']:.2f} s"
    )
    if result.failures:
        lines.append("FAILED: " + "; ".join(f.message for f in result.failures))
    else:
        lines.append("PASSED")
    return lines


def write_json(result: AuditResult, path: Path) -> None:
    """The JSON document (``run.AuditResult.document``), UTF-8, indented. NaN and infinities
    (a non-finite ratio) are written as null, so any JSON parser reads it."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not np.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    path.write_text(json.dumps(clean(result.document), indent=2, ensure_ascii=False) + "\n")


def write_plot(result: AuditResult, path: Path) -> None:
    """A PNG: the per-position log prob delta of every sample, generated tokens laid end to
    end (sample boundaries dashed, the token threshold shaded), and under it, when routing was
    compared, the expert agreement per position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routed = [r for r in result.samples if r.routing is not None and r.routing.overlap.size]
    rows = 2 if routed else 1
    fig, axes = plt.subplots(rows, 1, figsize=(12, 3.2 * rows), squeeze=False)
    ax = axes[0][0]
    x0 = 0
    th = result.document["thresholds"]["token_delta"]
    for r in result.samples:
        d = r.tokens.delta
        ax.plot(np.arange(x0, x0 + d.shape[0]), d, lw=0.8)
        x0 += d.shape[0]
        ax.axvline(x0, color="grey", ls="--", lw=0.5)
    ax.axhspan(-th, th, color="green", alpha=0.08)
    ax.set_xlabel("generated token (samples end to end)")
    ax.set_ylabel("log p_model - log p_captured (nats)")
    ax.set_title(f"log prob delta: {result.document['source']}", fontsize=9)
    if routed:
        ax2 = axes[1][0]
        x0 = 0
        for r in routed:
            assert r.routing is not None
            per_pos = r.routing.overlap.mean(axis=1)
            ax2.plot(np.arange(x0, x0 + per_pos.shape[0]), per_pos, lw=0.8)
            x0 += per_pos.shape[0]
        ax2.set_ylim(-0.05, 1.05)
        ax2.set_xlabel("routed-expert row (samples end to end)")
        ax2.set_ylabel("expert agreement")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
