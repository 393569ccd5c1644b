"""``capture-proxy audit``'s arguments and entry point.

Owns the subcommand's argument parser (imported by ``capture_proxy.cli``, so it imports only
the standard library at module level) and ``main``, which imports the audit's torch side only
when the command runs. Exit status: 0 passed, 1 failed a threshold, 2 bad input or a missing
``audit`` extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

#: Modules of the ``audit`` extra: without them the command says what to install.
AUDIT_MODULES = frozenset({"torch", "transformers", "matplotlib"})


def add_parser(sub: Any) -> None:
    """Add ``audit`` to ``sub`` (an ``argparse`` subparsers action)."""
    p = sub.add_parser(
        "audit",
        help="recompute the captured log probs and routed experts with the model (teacher "
        "forcing) and compare them; needs the audit extra",
        description="Rebuild each chain's training sample with the exporters' code, run the "
        "model over it and compare per generated token. Exit 0: passed; 1: a threshold "
        "passed; 2: bad input.",
    )
    p.add_argument("source", help="store directory, or a proxy's base URL (the read API)")
    p.add_argument("--model", required=True, type=Path, help="local Hugging Face model directory")
    p.add_argument(
        "--token", help="read API token (default: the CAPTURE_PROXY_CAPTURES_TOKEN variable)"
    )
    p.add_argument(
        "--rollout", action="append", dest="rollouts", help="rollout id (repeat; default: all)"
    )
    p.add_argument(
        "--form",
        choices=["npz", "arrow", "tree"],
        default="npz",
        help="the trainer's form the samples go through (default npz; arrow: frozen rollouts)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (CUDA when present; the default), cpu, cuda:N"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="the model's dtype (default auto: its config's)",
    )
    p.add_argument(
        "--max-batch-tokens", type=int, default=16384, help="padded tokens per pass (default 16384)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="logit divisor (engines' processed logprobs; default 1.0)",
    )
    p.add_argument("--json", type=Path, dest="json_path", help="write the full result as JSON")
    p.add_argument("--plot", type=Path, dest="plot_path", help="draw the per-position delta (PNG)")
    p.add_argument("--worst", type=int, default=10, help="worst positions named (default 10)")
    _add_thresholds(p)
    p.set_defaults(func=main)


def _add_thresholds(p: argparse.ArgumentParser) -> None:
    """The threshold flags of ``audit`` (``compare.Thresholds``, their defaults)."""
    from capture_proxy.audit.compare import Thresholds

    d = Thresholds()
    g = p.add_argument_group("thresholds (log probs in nats)")
    g.add_argument(
        "--token-delta",
        type=float,
        default=d.token_delta,
        help=f"a token whose |delta| exceeds it counts as over (default {d.token_delta:g})",
    )
    g.add_argument(
        "--max-mean-abs-delta",
        type=float,
        default=d.max_mean_abs_delta,
        help=f"limit on the mean |delta| (default {d.max_mean_abs_delta:g})",
    )
    g.add_argument(
        "--max-fraction-over",
        type=float,
        default=d.max_fraction_over,
        help=f"limit on the fraction of tokens over --token-delta (default "
        f"{d.max_fraction_over:g})",
    )
    g.add_argument(
        "--max-k3",
        type=float,
        default=d.max_k3,
        help=f"limit on the mean k3 KL estimate (default {d.max_k3:g})",
    )
    g.add_argument(
        "--min-expert-agreement",
        type=float,
        default=d.min_expert_agreement,
        help=f"lower limit on the mean expert-set overlap of compared rows (default "
        f"{d.min_expert_agreement:g})",
    )
    g.add_argument(
        "--tis-cap",
        type=float,
        default=d.tis_cap,
        help=f"TIS/MIS cap (reported; default {d.tis_cap:g})",
    )
    g.add_argument(
        "--require-routing",
        action="store_true",
        help="fail when the model routes experts but the capture holds none",
    )


def _run(args: argparse.Namespace) -> int:
    from capture_proxy.audit.compare import Thresholds
    from capture_proxy.audit.model import AuditModel, ModelOptions, load_tokenizer
    from capture_proxy.audit.report import summary_lines, write_json, write_plot
    from capture_proxy.audit.run import AuditInputError, AuditOptions, load_samples, run_audit

    options = AuditOptions(
        source=args.source,
        token=args.token,
        rollout_ids=args.rollouts,
        form=args.form,
        thresholds=Thresholds(
            token_delta=args.token_delta,
            max_mean_abs_delta=args.max_mean_abs_delta,
            max_fraction_over=args.max_fraction_over,
            max_k3=args.max_k3,
            min_expert_agreement=args.min_expert_agreement,
            tis_cap=args.tis_cap,
            require_routing=args.require_routing,
        ),
        worst=args.worst,
    )
    if not (args.model / "config.json").is_file():
        print(f"capture-proxy audit: --model {args.model}: no config.json", file=sys.stderr)
        return 2
    try:
        samples = load_samples(options)
    except AuditInputError as exc:
        print(f"capture-proxy audit: {exc}", file=sys.stderr)
        return 2
    model = AuditModel(
        ModelOptions(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_batch_tokens=args.max_batch_tokens,
            temperature=args.temperature,
        )
    )
    result = run_audit(samples, model, load_tokenizer(args.model), options)
    print("\n".join(summary_lines(result)))
    if args.json_path is not None:
        write_json(result, args.json_path)
    if args.plot_path is not None:
        write_plot(result, args.plot_path)
    return 0 if result.passed else 1


def main(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ModuleNotFoundError as exc:
        if exc.name not in AUDIT_MODULES:
            raise
        print(
            f"capture-proxy audit: needs {exc.name}, which this installation lacks: "
            "pip install 'capture-proxy[audit]'",
            file=sys.stderr,
        )
        return 2
