"""Rollout-level linking statistics for the REST summary. Pure.

Owns the numbers a trainer checks before using a rollout: how many chains and roots, how many
links were resolved, refused (by mismatch class) or unresolved (by reason), retries, harness
notes rewritten, and how much of the generated text sits on the main chain (the chain with the
most generated tokens): a rollout whose main chain holds 0.4 of its generated tokens is mostly
made of fragments, which is worth knowing before training on it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from capture_proxy.core.chains import Chain, RolloutChains
from capture_proxy.core.records import CallRecord, CallStatus, DiagnosticKind


def main_chain(chains: RolloutChains) -> Chain | None:
    """The chain with the most generated tokens (the first such in chain order), or None."""
    generated = [sum(r.num_generation_tokens for r in c.calls) for c in chains.chains]
    if not generated:
        return None
    return chains.chains[generated.index(max(generated))]


def link_stats(records: list[CallRecord], chains: RolloutChains) -> dict[str, Any]:
    verdicts: Counter[str] = Counter()
    refused_by_class: Counter[str] = Counter()
    unresolved_by_reason: Counter[str] = Counter()
    for r in records:
        linking = r.linking or {}
        verdict = linking.get("verdict")
        if verdict is None:
            continue
        verdicts[verdict] += 1
        if verdict == "unresolved":
            unresolved_by_reason[str(linking.get("reason"))] += 1
        for d in r.diagnostics:
            if d.kind == DiagnosticKind.PARENT_DIGEST_MISMATCH:
                refused_by_class[str(d.details.get("class", d.details.get("reason")))] += 1
    generated = {c.chain_id: sum(r.num_generation_tokens for r in c.calls) for c in chains.chains}
    total = sum(r.num_generation_tokens for r in records if r.status is CallStatus.COMPLETE)
    main = main_chain(chains)
    return {
        "num_chains": len(chains.chains),
        "num_roots": len(chains.chains),
        "links_resolved": verdicts.get("resolved", 0),
        "links_refused": dict(sorted(refused_by_class.items())),
        "links_unresolved": dict(sorted(unresolved_by_reason.items())),
        "verdicts": dict(sorted(verdicts.items())),
        "retries": sum(1 for r in records if r.retry_of is not None),
        "superseded_retries": len(chains.superseded),
        "harness_notes_rewritten": sum(
            1
            for r in records
            for d in r.diagnostics
            if d.kind == DiagnosticKind.HARNESS_NOTE_REWRITTEN
        ),
        "main_chain_id": main.chain_id if main else None,
        "main_chain_generated_token_fraction": (
            round(generated[main.chain_id] / total, 6) if main is not None and total else None
        ),
    }
