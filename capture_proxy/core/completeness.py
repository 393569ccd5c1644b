"""Rollout completeness: which incomplete calls still make their rollout incomplete.

Pure (no I/O), shared by the stores (which keep the count per rollout) and the viewer. A call
left incomplete (a cut-off stream, token data missing) makes its rollout incomplete unless the
harness retried it and a retry completed: the linker records a retry as ``retry_of`` the call
it repeats (``core.linking``), and the harness continued from the retry's answer, not from the
cut-off one. So a complete call supersedes every call it retries, directly or through earlier
retries (C retries B retries A, C complete: B and A are superseded). A failed or incomplete
retry supersedes nothing, and nothing supersedes a call that is not a retry's target. Rollout-
level conditions (``mark_rollout_incomplete``: a call that could not be stored) are not calls
and are never superseded; the stores keep them apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from capture_proxy.core.records import CallStatus


@dataclass(frozen=True)
class RetryLink:
    """What completeness needs of a call: its id, its ``CallStatus`` value and the call it
    retries (``CallRecord.retry_of``), if any."""

    call_id: str
    status: str
    retry_of: str | None = None


def superseded_by_retries(calls: Iterable[RetryLink]) -> frozenset[str]:
    """Ids of the calls that a complete retry supersedes (the retried calls' ids, whatever
    their status). A call named by ``retry_of`` but absent from ``calls`` counts too."""
    by_id = {c.call_id: c for c in calls}
    out: set[str] = set()
    for call in by_id.values():
        if call.status != CallStatus.COMPLETE:
            continue
        seen = {call.call_id}  # a cycle (the linker never writes one) ends the walk
        target = call.retry_of
        while target is not None and target not in seen:
            out.add(target)
            seen.add(target)
            retried = by_id.get(target)
            target = retried.retry_of if retried is not None else None
    return frozenset(out)


def unsuperseded_incomplete(calls: Iterable[RetryLink]) -> list[str]:
    """Ids (sorted, once each) of the incomplete calls no complete retry supersedes: the calls
    that make their rollout incomplete. Give every call that is incomplete or a retry (the
    others change nothing); the result does not depend on their order."""
    by_id = {c.call_id: c for c in calls}
    superseded = superseded_by_retries(by_id.values())
    return sorted(
        i for i, c in by_id.items() if c.status == CallStatus.INCOMPLETE and i not in superseded
    )
