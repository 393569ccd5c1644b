"""The rollout listing: one row per rollout, its status and diagnostic kinds, and the filters.

Pure. A row is built from the rollout's bookkeeping and its records (``rollout_row``), or from
the counts a store keeps per rollout, loading no call (``kept_rollout_row``: the same row);
``reward`` is read from
the rollout's metadata (a ``reward`` key) when the store keeps metadata, and is None (shown as
a dash) when it does not or the key is absent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from capture_proxy.core.chains import build_chains
from capture_proxy.core.completeness import RetryLink, unsuperseded_incomplete
from capture_proxy.core.records import CallRecord, CallStatus, DiagnosticKind

#: Values of the listing's ``status`` filter.
STATUSES = ("complete", "incomplete", "failed")


@dataclass(frozen=True)
class RolloutRow:
    """One rollout in the listing. ``status``: ``failed`` when a call failed, else
    ``incomplete`` when the rollout lost token data (a call no complete retry superseded, or a
    rollout-level mark), else ``complete``. ``diagnostic_kinds``:
    sorted kinds found on the rollout or any of its calls. ``age_s``: seconds since the first
    call. ``frozen``: the rollout has a snapshot (its lifecycle, apart from its data's
    status: a frozen rollout is shown ``complete · frozen``)."""

    rollout_id: str
    created_at: float
    age_s: float
    num_calls: int
    num_chains: int
    num_failed: int
    num_incomplete: int
    refused_links: int
    incomplete: bool
    status: str
    diagnostic_kinds: tuple[str, ...]
    reward: float | dict[str, float] | None
    frozen: bool = False

    @property
    def state(self) -> str:
        """``status``, with `` · frozen`` for a frozen rollout."""
        return f"{self.status} · frozen" if self.frozen else self.status

    @property
    def age(self) -> str:
        return format_age(self.age_s)


def reward_of(metadata: Mapping[str, Any] | None) -> float | dict[str, float] | None:
    """The ``reward`` of rollout metadata: one float, named floats (``{"pass": 1.0}``), or
    None (absent, not finite numbers)."""
    if not metadata:
        return None
    value = metadata.get("reward")
    if isinstance(value, dict):
        named = {str(k): _finite(v) for k, v in value.items()}
        return {k: v for k, v in named.items() if v is not None} or None
    return _finite(value)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def format_reward(value: float | dict[str, float] | None) -> str:
    """``0.5``, ``pass=1 style=0.5`` or a dash."""
    if value is None:
        return "–"
    if isinstance(value, dict):
        return " ".join(f"{k}={v:g}" for k, v in value.items())
    return f"{value:g}"


def rollout_row(
    *,
    rollout_id: str,
    created_at: float,
    incomplete: bool,
    rollout_diagnostic_kinds: list[str],
    records: list[CallRecord],
    metadata: Mapping[str, Any] | None,
    now: float,
    frozen: bool = False,
) -> RolloutRow:
    # A cut-off call that a complete retry superseded leaves the rollout complete, as in the store.
    links = (RetryLink(r.call_id, r.status.value, r.retry_of) for r in records)
    return kept_rollout_row(
        rollout_id=rollout_id,
        created_at=created_at,
        incomplete=incomplete or bool(unsuperseded_incomplete(links)),
        rollout_diagnostic_kinds=rollout_diagnostic_kinds,
        num_calls=len(records),
        num_chains=len(build_chains(rollout_id, records).chains),
        num_failed=sum(1 for r in records if r.status is CallStatus.FAILED),
        num_incomplete=sum(1 for r in records if r.status is CallStatus.INCOMPLETE),
        refused_links=sum(
            1
            for r in records
            for d in r.diagnostics
            if d.kind == DiagnosticKind.PARENT_DIGEST_MISMATCH
        ),
        call_diagnostic_kinds=[d.kind for r in records for d in r.diagnostics],
        metadata=metadata,
        now=now,
        frozen=frozen,
    )


def kept_rollout_row(
    *,
    rollout_id: str,
    created_at: float,
    incomplete: bool,
    rollout_diagnostic_kinds: Iterable[str],
    num_calls: int,
    num_chains: int,
    num_failed: int,
    num_incomplete: int,
    refused_links: int,
    call_diagnostic_kinds: Iterable[str],
    metadata: Mapping[str, Any] | None,
    now: float,
    frozen: bool = False,
) -> RolloutRow:
    """The row from counts (a store's, kept per rollout; or ``rollout_row``'s, from the
    records). ``incomplete``: a call no complete retry superseded, or a rollout-level mark."""
    kinds = set(call_diagnostic_kinds) | set(rollout_diagnostic_kinds)
    status = "failed" if num_failed else "incomplete" if incomplete else "complete"
    return RolloutRow(
        rollout_id=rollout_id,
        created_at=created_at,
        age_s=max(0.0, now - created_at),
        num_calls=num_calls,
        num_chains=num_chains,
        num_failed=num_failed,
        num_incomplete=num_incomplete,
        refused_links=refused_links,
        incomplete=incomplete,
        status=status,
        diagnostic_kinds=tuple(sorted(kinds)),
        reward=reward_of(metadata),
        frozen=frozen,
    )


def matches(row: RolloutRow, *, status: str | None, kind: str | None) -> bool:
    """True when ``row`` passes the filters (None: no filter on that field)."""
    return (status is None or row.status == status) and (
        kind is None or kind in row.diagnostic_kinds
    )


def format_age(seconds: float) -> str:
    """``42 s``, ``5 min``, ``3 h``, ``2 d`` (rounded down)."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h"
    return f"{s // 86400} d"
