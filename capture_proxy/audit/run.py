"""One audit: samples in, the model over them, the comparison and the verdict out.

Owns the flow of ``capture-proxy audit`` (``capture_proxy.cli`` parses the arguments): read the
samples (``sources``), score them batch by batch (``model``), compare (``compare``), and build
the result that ``report`` prints, writes as JSON and plots. Exit status: 0 passed, 1 a
threshold was passed (or nothing could be compared), 2 bad input (no store, no model, an unknown
rollout).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from capture_proxy.audit import compare
from capture_proxy.audit.sources import AuditSample, Form, api_samples, store_samples

AUDIT_FORMAT = "capture-proxy.audit"
AUDIT_VERSION = 1


class AuditInputError(Exception):
    """The input cannot be audited (exit status 2): the message says why."""


@dataclass(frozen=True)
class AuditOptions:
    """``source``: an embedded store directory or a proxy's base URL (``http://``/``https://``);
    ``token``: the read API's ``captures_token`` (URL only; default: the
    ``CAPTURE_PROXY_CAPTURES_TOKEN`` environment variable); ``rollout_ids``: None for every
    rollout; ``worst``: how many worst positions to name."""

    source: str
    token: str | None = None
    rollout_ids: list[str] | None = None
    form: Form = "npz"
    thresholds: compare.Thresholds = field(default_factory=compare.Thresholds)
    worst: int = 10


@dataclass
class SampleResult:
    """A sample and its scores (``routing`` None when its rows were not compared)."""

    sample: AuditSample
    tokens: compare.TokenScores
    routing: compare.RoutingScores | None
    alignment: dict[int, tuple[float, int]]


@dataclass
class AuditResult:
    """``document``: the JSON document (``report`` prints it); ``samples``: per-sample scores
    (for the plot); ``failures``: empty when the audit passed."""

    document: dict[str, Any]
    samples: list[SampleResult]
    failures: list[compare.Failure]

    @property
    def passed(self) -> bool:
        return not self.failures


def load_samples(options: AuditOptions) -> list[AuditSample]:
    """The samples of ``options.source``. Raises AuditInputError for a missing store or an
    unknown rollout id."""
    if options.source.startswith(("http://", "https://")):
        import urllib.error

        try:
            samples, missing = api_samples(
                options.source, options.token, options.rollout_ids, options.form
            )
        except urllib.error.HTTPError as exc:
            body = exc.read()[:300].decode(errors="replace")
            raise AuditInputError(f"{exc.url}: HTTP {exc.code}: {body}") from exc
        except urllib.error.URLError as exc:
            raise AuditInputError(f"{options.source}: {exc.reason}") from exc
        if missing:
            raise AuditInputError(f"frozen rollouts not exported: {', '.join(missing)}")
        return samples
    store_dir = Path(options.source)
    from capture_proxy.store.sqlite import DB_FILE_NAME

    if not (store_dir / DB_FILE_NAME).is_file():
        raise AuditInputError(f"no store at {store_dir} (no {DB_FILE_NAME})")
    samples, missing = asyncio.run(store_samples(store_dir, options.rollout_ids, options.form))
    if missing:
        raise AuditInputError(f"rollouts not in {store_dir}: {', '.join(missing)}")
    return samples


def _routing_status(
    samples: list[AuditSample], num_layers: int, top_k: int | None
) -> tuple[str, str]:
    with_rows = [
        s for s in samples if s.routed_experts_mask is not None and s.routed_experts_mask.any()
    ]
    if not num_layers:
        if with_rows:
            return "dense_model", (
                f"{len(with_rows)} samples carry routed experts but the model has no router: "
                "a dense model for an MoE capture"
            )
        return "not_moe", ""
    if not with_rows:
        return "not_captured", (
            f"the model routes {num_layers} layers (top {top_k}) but no sample carries routed "
            "experts (vLLM's CPU build and OpenAI-format streams return none)"
        )
    for s in with_rows:
        assert s.routed_experts is not None
        got = tuple(int(n) for n in s.routed_experts.shape[1:])
        if got != (num_layers, top_k):
            return "shape_mismatch", (
                f"sample {s.leaf_call_id}: rows of [num_layers, top_k] = {list(got)}, the model "
                f"routes [{num_layers}, {top_k}]"
            )
    return "compared", ""


def score_samples(
    samples: list[AuditSample], model: Any, status: str
) -> tuple[list[SampleResult], float]:
    """Every sample through ``model`` (``model.AuditModel``), batch by batch. Returns the
    results in ``samples`` order and the seconds spent in forward passes."""
    results: list[SampleResult | None] = [None] * len(samples)
    forward_s = 0.0
    for batch in model.batches(samples):
        t0 = time.perf_counter()
        scored = model.score([samples[i] for i in batch])
        forward_s += time.perf_counter() - t0
        for i, sc in zip(batch, scored, strict=True):
            s = samples[i]
            routing = None
            if status == "compared" and s.routed_experts is not None and sc.experts is not None:
                assert s.routed_experts_mask is not None
                routing = compare.routing_scores(
                    s.routed_experts, s.routed_experts_mask, sc.experts
                )
            results[i] = SampleResult(
                s,
                compare.token_scores(s.loss_mask, s.log_probs, sc.log_probs),
                routing,
                compare.alignment(s.loss_mask, s.log_probs, sc.log_probs),
            )
    return [r for r in results if r is not None], forward_s


def _worst(results: list[SampleResult], n: int, tokenizer: Any | None) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        d = r.tokens.delta
        key = np.where(np.isfinite(d), np.abs(d), np.inf)
        for j in np.argsort(-key, kind="stable")[:n]:
            rows.append((float(key[j]), r, int(j)))
    rows.sort(key=lambda x: -x[0])
    out = []
    for _, r, j in rows[:n]:
        pos = int(r.tokens.positions[j])
        token_id = int(r.sample.input_ids[pos])
        out.append(
            {
                "rollout_id": r.sample.rollout_id,
                "leaf_call_id": r.sample.leaf_call_id,
                "call_id": r.sample.call_at(pos),
                "position": pos,
                "token_id": token_id,
                "token": None if tokenizer is None else tokenizer.decode([token_id]),
                "captured": float(r.tokens.captured[j]),
                "recomputed": float(r.tokens.recomputed[j]),
                "delta": float(r.tokens.delta[j]),
            }
        )
    return out


def _calls_json(r: SampleResult, th: compare.Thresholds) -> list[dict[str, Any]]:
    """Per path call (from the sample's generation spans; none in the tree form): its
    generated tokens' figures, so a call decoded under constraints stands out."""
    spans = r.sample.generation_spans
    if spans is None:
        return []
    out = []
    for call_id, (start, end) in zip(r.sample.call_ids, spans.tolist(), strict=True):
        at = (r.tokens.positions >= start) & (r.tokens.positions < end)
        part = compare.TokenScores(
            r.tokens.positions[at], r.tokens.captured[at], r.tokens.recomputed[at]
        )
        stats = compare.logprob_stats([part], th)
        keys = ("num_tokens", "mean_abs_delta", "max_abs_delta", "k3_mean")
        out.append({"call_id": call_id, **{k: stats[k] for k in keys}})
    return out


def _sample_json(r: SampleResult, th: compare.Thresholds) -> dict[str, Any]:
    stats = compare.logprob_stats([r.tokens], th)
    return {
        "rollout_id": r.sample.rollout_id,
        "chain_id": r.sample.chain_id,
        "leaf_call_id": r.sample.leaf_call_id,
        "num_calls": len(r.sample.call_ids),
        "num_tokens": r.sample.num_tokens,
        "num_generated": stats["num_tokens"],
        **{k: stats[k] for k in ("mean_abs_delta", "max_abs_delta", "fraction_over", "k3_mean")},
        "expert_agreement": (
            float(r.routing.overlap.mean())
            if r.routing is not None and r.routing.overlap.size
            else None
        ),
        "calls": _calls_json(r, th),
    }


def _routing_summary(
    results: list[SampleResult], status: str, detail: str
) -> compare.RoutingSummary:
    if status != "compared":
        return compare.RoutingSummary(status, detail)
    shifted: dict[str, float | None] = {}
    for k in (-1, 1):
        parts = [r.routing.shifted[k] for r in results if r.routing is not None]
        total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
        shifted[str(k)] = total / count if count else None
    return compare.summarize_routing([r.routing for r in results if r.routing is not None], shifted)


def run_audit(
    samples: list[AuditSample], model: Any, tokenizer: Any | None, options: AuditOptions
) -> AuditResult:
    """Score and compare ``samples`` with ``model`` (``model.AuditModel``)."""
    t0 = time.perf_counter()
    th = options.thresholds
    status, detail = _routing_status(samples, model.num_moe_layers, model.top_k)
    results, forward_s = score_samples(samples, model, status)
    stats = compare.logprob_stats([r.tokens for r in results], th)
    routing = _routing_summary(results, status, detail)
    failures = compare.verdict(stats, routing, th)
    num_tokens = sum(s.num_tokens for s in samples)
    document = {
        "format": AUDIT_FORMAT,
        "version": AUDIT_VERSION,
        "source": options.source,
        "form": options.form,
        "model": {
            "dir": str(model.options.model_dir),
            "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "num_moe_layers": model.num_moe_layers,
            "top_k": model.top_k,
            "temperature": model.options.temperature,
        },
        "thresholds": {k: getattr(th, k) for k in th.__dataclass_fields__},
        "num_rollouts": len({s.rollout_id for s in samples}),
        "num_samples": len(samples),
        "num_sample_tokens": num_tokens,
        "log_probs": stats,
        "alignment": compare.merge_alignment([r.alignment for r in results]),
        "routing": routing.to_json(),
        "worst": _worst(results, options.worst, tokenizer),
        "samples": [_sample_json(r, th) for r in results],
        "failures": [f.to_json() for f in failures],
        "passed": not failures,
        "timing": {
            "forward_s": forward_s,
            "audit_s": time.perf_counter() - t0,
            "tokens_per_s": num_tokens / forward_s if forward_s > 0 else None,
        },
    }
    return AuditResult(document, results, failures)
