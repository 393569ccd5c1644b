"""The audit's comparison math: captured log probs and routed experts against the model's.

Owns, per generated token, the log prob delta and the KL estimators and importance ratios
trainers report, per routed-expert row the agreement of the expert sets, the thresholds and the
verdict. Pure numpy: no torch, no I/O (``model`` computes the model side, ``report`` prints).

Conventions (one generated token ``t`` of a sample, sampled by the engine's policy ``q``, the
*rollout* policy, and scored by the trainer's ``p``, the model recomputed here):

- ``delta = log p(x_t) - log q(x_t)`` (recomputed minus captured; nats). The importance ratio
  a trainer's correction uses is ``ratio = exp(delta)`` (p over q).
- KL(q || p) estimators over samples from q (Schulman, "Approximating KL Divergence", 2020):
  ``k1 = -delta`` (unbiased, noisy, can be negative), ``k2 = delta**2 / 2``,
  ``k3 = ratio - 1 - delta`` (unbiased, non-negative: verl's ``low_var_kl``; the one the
  thresholds use).
- TIS (truncated importance sampling, Yao et al. 2025) clips ``ratio`` at ``tis_cap``: the
  fraction of tokens it clips is ``tis_clip_fraction``; masked importance sampling (MIS)
  drops tokens whose ratio is outside ``[1/tis_cap, tis_cap]``: ``mis_mask_fraction``.

Positions: a sample's token ``t`` (``loss_mask[t] == 1``, ``t >= 1``) is scored by the
forward pass at ``t - 1``. A routed-expert row ``i`` is the routing of position ``i``'s own
forward pass (``core.routed_experts``), compared with the router at the same position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Shifts tried by ``alignment``: the captured log probs against the model's one position
#: earlier, in place and one later. Data in the right place fits best at 0.
SHIFTS = (-1, 0, 1)
#: The figures of ``logprob_stats`` past the counts (None when nothing was compared).
FIGURES = (
    "mean_abs_delta",
    "max_abs_delta",
    "p99_abs_delta",
    "mean_delta",
    "fraction_over",
    "k1_mean",
    "k2_mean",
    "k3_mean",
    "ratio_min",
    "ratio_max",
    "tis_clip_fraction",
    "mis_mask_fraction",
)


@dataclass(frozen=True)
class Thresholds:
    """Limits past which the audit fails (exit status 1). Log probs in nats.

    ``token_delta``: a token whose ``|delta|`` exceeds it counts in ``fraction_over``;
    ``max_mean_abs_delta``: limit on the mean ``|delta|``; ``max_fraction_over``: limit on
    the fraction of tokens over ``token_delta``; ``max_k3``: limit on the mean k3 KL;
    ``min_expert_agreement``: lower limit on the mean expert-set overlap of compared rows;
    ``tis_cap``: the TIS/MIS cap (reported only); ``require_routing``: fail when the model
    routes experts but the samples carry none (vLLM's CPU build and OpenAI-format streams
    return none, so it is off by default)."""

    token_delta: float = 0.5
    max_mean_abs_delta: float = 0.05
    max_fraction_over: float = 0.01
    max_k3: float = 0.02
    min_expert_agreement: float = 0.9
    tis_cap: float = 2.0
    require_routing: bool = False


@dataclass(frozen=True)
class TokenScores:
    """One sample's generated tokens: ``positions`` int64 ``[n]`` (into the sample),
    ``captured`` and ``recomputed`` float64 ``[n]`` (log probs, nats)."""

    positions: np.ndarray
    captured: np.ndarray
    recomputed: np.ndarray

    @property
    def delta(self) -> np.ndarray:
        return self.recomputed - self.captured


def token_scores(
    loss_mask: np.ndarray, captured: np.ndarray, recomputed: np.ndarray
) -> TokenScores:
    """The generated positions of a sample with both log probs. ``loss_mask`` uint8 ``[seq]``;
    ``captured`` float ``[seq]`` (the sample's ``log_probs``); ``recomputed`` float ``[seq]``,
    the model's log prob of ``input_ids[t]`` given ``input_ids[:t]`` (NaN at 0). Position 0
    is never a generated token (a generation follows a prompt) and is left out."""
    positions = np.flatnonzero(loss_mask)
    positions = positions[positions >= 1]
    return TokenScores(
        positions.astype(np.int64),
        captured[positions].astype(np.float64),
        recomputed[positions].astype(np.float64),
    )


def logprob_stats(scores: list[TokenScores], thresholds: Thresholds) -> dict[str, Any]:
    """The log prob figures over every token of ``scores`` whose two values are finite:
    ``num_tokens`` (all), ``num_compared``, ``num_non_finite`` (either side NaN/inf: not
    compared), ``mean_abs_delta``, ``max_abs_delta``, ``p99_abs_delta``, ``mean_delta``,
    ``fraction_over`` (``|delta| > token_delta``), ``k1_mean``, ``k2_mean``, ``k3_mean``,
    ``ratio_min``, ``ratio_max``, ``tis_clip_fraction``, ``mis_mask_fraction``. Means are
    None when nothing was compared."""
    captured = np.concatenate([s.captured for s in scores]) if scores else np.zeros(0)
    recomputed = np.concatenate([s.recomputed for s in scores]) if scores else np.zeros(0)
    finite = np.isfinite(captured) & np.isfinite(recomputed)
    delta = recomputed[finite] - captured[finite]
    out: dict[str, Any] = {
        "num_tokens": int(captured.shape[0]),
        "num_compared": int(delta.shape[0]),
        "num_non_finite": int((~finite).sum()),
    }
    if delta.shape[0] == 0:
        return {**out, **dict.fromkeys(FIGURES)}
    absd = np.abs(delta)
    # exp of a large positive delta overflows to inf, which is the honest answer for k3/ratio.
    with np.errstate(over="ignore"):
        ratio = np.exp(delta)
    cap = thresholds.tis_cap
    return {
        **out,
        "mean_abs_delta": float(absd.mean()),
        "max_abs_delta": float(absd.max()),
        "p99_abs_delta": float(np.quantile(absd, 0.99)),
        "mean_delta": float(delta.mean()),
        "fraction_over": float((absd > thresholds.token_delta).mean()),
        "k1_mean": float((-delta).mean()),
        "k2_mean": float((0.5 * delta**2).mean()),
        "k3_mean": float((ratio - 1.0 - delta).mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "tis_clip_fraction": float((ratio > cap).mean()),
        "mis_mask_fraction": float(((ratio > cap) | (ratio < 1.0 / cap)).mean()),
    }


def alignment(
    loss_mask: np.ndarray, captured: np.ndarray, recomputed: np.ndarray
) -> dict[int, tuple[float, int]]:
    """For each shift ``s`` in ``SHIFTS``: (sum of ``|recomputed[t + s] - captured[t]|``,
    count) over generated ``t`` where ``t + s`` is a generated position too and both values
    are finite. Ids shifted against their log probs fit best at a shift other than 0."""
    gen = np.flatnonzero(loss_mask)
    gen = gen[gen >= 1]
    is_gen = np.zeros(loss_mask.shape[0], bool)
    is_gen[gen] = True
    out: dict[int, tuple[float, int]] = {}
    for s in SHIFTS:
        t = gen[(gen + s >= 1) & (gen + s < loss_mask.shape[0])]
        t = t[is_gen[t + s]]
        d = recomputed[t + s].astype(np.float64) - captured[t].astype(np.float64)
        d = d[np.isfinite(d)]
        out[s] = (float(np.abs(d).sum()), int(d.shape[0]))
    return out


def merge_alignment(parts: list[dict[int, tuple[float, int]]]) -> dict[str, float | None]:
    """Mean ``|delta|`` per shift over many samples' ``alignment``: ``{"-1": .., "0": ..,
    "1": ..}`` (None where nothing was comparable)."""
    out: dict[str, float | None] = {}
    for s in SHIFTS:
        total = sum(p[s][0] for p in parts)
        count = sum(p[s][1] for p in parts)
        out[str(s)] = total / count if count else None
    return out


def expert_overlap(captured: np.ndarray, model: np.ndarray) -> np.ndarray:
    """Per row and layer, the fraction of the captured top-k expert set that the model's
    top-k set holds: float64 ``[rows, num_layers]`` in [0, 1] (1: the same set; order within
    a row does not matter). ``captured`` and ``model``: integer ``[rows, num_layers, top_k]``
    of the same shape (a row's ids are distinct, as top-k ids are). Raises ValueError for
    differing shapes."""
    if captured.shape != model.shape:
        raise ValueError(f"expert arrays differ in shape: {captured.shape} vs {model.shape}")
    k = captured.shape[-1]
    hits = (captured[..., :, None] == model[..., None, :]).any(axis=-1).sum(axis=-1)
    return hits.astype(np.float64) / max(k, 1)


@dataclass
class RoutingScores:
    """One sample's routed-expert comparison: ``positions`` int64 ``[rows]`` (rows present in
    the sample) and ``overlap`` float64 ``[rows, num_layers]`` (``expert_overlap``)."""

    positions: np.ndarray
    overlap: np.ndarray
    #: ``shifted_agreement`` per shift (-1, 1): rows compared one position off.
    shifted: dict[int, tuple[float, int]] = field(default_factory=dict)


def routing_scores(
    captured: np.ndarray, captured_mask: np.ndarray, model: np.ndarray
) -> RoutingScores:
    """Compare a sample's captured rows (``routed_experts`` ``[seq, L, k]`` where
    ``routed_experts_mask`` is 1) with the model's ``[seq, L, k]``."""
    positions = np.flatnonzero(captured_mask).astype(np.int64)
    return RoutingScores(
        positions,
        expert_overlap(captured[positions], model[positions]),
        {k: shifted_agreement(captured, captured_mask, model, k) for k in (-1, 1)},
    )


@dataclass
class RoutingSummary:
    """``status``: ``compared``; ``not_captured`` (the model routes, the samples hold no
    rows); ``dense_model`` (the samples hold rows, the model has no router: a wrong pairing);
    ``shape_mismatch`` (rows of another ``[num_layers, top_k]`` than the model's);
    ``not_moe`` (neither side routes). Figures only for ``compared``."""

    status: str
    detail: str = ""
    num_rows: int = 0
    agreement: float | None = None
    exact_fraction: float | None = None
    per_layer: list[float] = field(default_factory=list)
    shifted: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "detail": self.detail,
            "num_rows": self.num_rows,
            "agreement": self.agreement,
            "exact_fraction": self.exact_fraction,
            "per_layer": self.per_layer,
            "shifted": self.shifted,
        }


def summarize_routing(
    scores: list[RoutingScores], shifted: dict[str, float | None]
) -> RoutingSummary:
    """The ``compared`` summary over samples' routing scores: mean overlap (``agreement``),
    the fraction of (row, layer) pairs with the same set (``exact_fraction``), the mean per
    layer, and ``shifted`` (the agreement of rows one position off, from the caller)."""
    rows = [s.overlap for s in scores if s.overlap.shape[0]]
    if not rows:
        return RoutingSummary("compared", "no routed-expert rows to compare", shifted=shifted)
    overlap = np.concatenate(rows)
    return RoutingSummary(
        status="compared",
        num_rows=int(overlap.shape[0]),
        agreement=float(overlap.mean()),
        exact_fraction=float((overlap == 1.0).mean()),
        per_layer=[float(x) for x in overlap.mean(axis=0)],
        shifted=shifted,
    )


def shifted_agreement(
    captured: np.ndarray, captured_mask: np.ndarray, model: np.ndarray, shift: int
) -> tuple[float, int]:
    """(sum of overlap, rows) of captured row ``i`` against the model's row ``i + shift``, over
    rows present at ``i`` with ``i + shift`` inside the sample: rows stored one position off
    agree better at a shift other than 0."""
    positions = np.flatnonzero(captured_mask)
    positions = positions[(positions + shift >= 0) & (positions + shift < model.shape[0])]
    if not positions.shape[0]:
        return 0.0, 0
    overlap = expert_overlap(captured[positions], model[positions + shift])
    return float(overlap.mean(axis=1).sum()), int(positions.shape[0])


@dataclass(frozen=True)
class Failure:
    """A check past its threshold: ``check`` (the figure's name), ``value``, ``limit``."""

    check: str
    value: Any
    limit: Any
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "value": self.value,
            "limit": self.limit,
            "message": self.message,
        }


def verdict(stats: dict[str, Any], routing: RoutingSummary, th: Thresholds) -> list[Failure]:
    """The failures of an audit (empty: it passed)."""
    out: list[Failure] = []
    if not stats["num_compared"]:
        out.append(Failure("num_compared", 0, ">= 1", "no generated token could be compared"))
        return out
    for check, limit, word in (
        ("mean_abs_delta", th.max_mean_abs_delta, "mean |delta|"),
        ("fraction_over", th.max_fraction_over, f"fraction with |delta| > {th.token_delta:g}"),
        ("k3_mean", th.max_k3, "mean k3 KL"),
    ):
        value = stats[check]
        if not value <= limit:  # NaN fails too
            out.append(Failure(check, value, limit, f"{word} {value:.4g} > {limit:g}"))
    wrong = ("dense_model", "shape_mismatch") + (("not_captured",) if th.require_routing else ())
    if routing.status in wrong:
        out.append(Failure("routing", routing.status, "compared", routing.detail))
    agreement = routing.agreement
    if routing.status == "compared" and agreement is not None:
        limit = th.min_expert_agreement
        if not agreement >= limit:
            out.append(
                Failure(
                    "expert_agreement",
                    agreement,
                    limit,
                    f"expert agreement {agreement:.4f} < {limit:g}",
                )
            )
    return out
