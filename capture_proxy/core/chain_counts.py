"""A rollout's number of chains kept by the store, call by call, instead of built on read.

Owns the rule by which one stored call changes ``len(build_chains(rollout, calls).chains)``
(``core.chains``), so that a listing of rollouts reads a kept figure per rollout and loads no
call. Pure: no I/O; a store reads what the rule asks (the call's linked parent, the call's
retry family) inside its put's transaction and keeps the figure in the rollout's row.

What makes a chain: a linkable (complete) call whose parent is not one of the rollout's
linkable calls is a root; every root is a chain, but for the members of a retry group that a
kept member supersedes (``chains.superseded_retries``). Counted over the calls a training read
holds (the late ones left out: a call stored after the freeze changes nothing).

The figure is kept exactly, or not at all (None: unknown, and the reader builds the chains as
before), because some calls could change what earlier calls are:
- a linkable call without a linking verdict (an older record, or one put by hand) is linked by
  the prefix rule, and a later call may become its parent, or it the parent of an earlier one;
- a call whose linked parent is not stored in the rollout becomes a child once that parent
  arrives;
- a retry family (the calls joined by ``retry_of``, ``core.completeness``) with two linkable
  members or more may have one superseded, depending on which gets children later; a retry
  whose retried call is not stored may join such a family when it arrives.
None of these happen in the proxy's common traffic (every call has a verdict, a parent is
stored before its child, a retry of a complete call needs the harness's retry header), so the
figure is kept for nearly every rollout and a put costs one parent row and, for a retry or an
incomplete call, its retry family (an index range), never the rollout's other calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from capture_proxy.core.chains import build_chains
from capture_proxy.core.completeness import RetryLink, unsuperseded_incomplete
from capture_proxy.core.records import CallRecord, CallStatus

COMPLETE = CallStatus.COMPLETE.value


def _family_known(record: RetryLink, family: Sequence[RetryLink]) -> bool:
    """False when the retry family (``family``: the stored members, ``record`` the new one)
    could make the count depend on later calls: a member retries a call not stored, or two
    members are linkable."""
    members = {m.call_id: m for m in (*family, record)}
    if any(m.retry_of is not None and m.retry_of not in members for m in members.values()):
        return False
    return sum(1 for m in members.values() if m.status == COMPLETE) < 2


def chains_delta(
    record: CallRecord, parent_status: str | None, family: Sequence[RetryLink] | None
) -> int | None:
    """How storing ``record`` (new, not late) changes its rollout's number of chains: 0 or 1,
    or None when the figure can no longer be kept (module docstring).

    ``parent_status``: the ``CallStatus`` value of the record's linked parent
    (``parent_call_id``) when it is stored in the rollout, else None. ``family``: the stored
    members of the record's retry family (``retry_family`` of the store), read when the record
    is a retry or incomplete (``lifecycle.may_recount``), else None."""
    delta = 0
    if record.linkable:
        if record.linking is None:
            return None
        if record.parent_call_id is not None:
            if parent_status is None:
                return None
            delta = int(parent_status != COMPLETE)
        else:
            delta = 1
    if record.retry_of is not None or family:
        link = RetryLink(record.call_id, record.status.value, record.retry_of)
        if not _family_known(link, family or ()):
            return None
    return delta


def incomplete_delta(record: CallRecord, family: Sequence[RetryLink]) -> int:
    """How storing ``record`` (new, not late, incomplete or a retry) changes its rollout's
    count of incomplete calls that no complete retry supersedes (``core.completeness``):
    only the members of its retry family can change (``family``: the stored ones)."""
    new = RetryLink(record.call_id, record.status.value, record.retry_of)
    return len(unsuperseded_incomplete([*family, new])) - len(unsuperseded_incomplete(family))


def kept_chains(rollout_id: str, records: Iterable[CallRecord]) -> int | None:
    """The figure a store keeps for a rollout whose calls are ``records`` (the late ones left
    out): ``len(build_chains(...).chains)``, or None when a later call could change what
    these calls are (module docstring). For a store that counts its rollouts again (a
    migration), and for tests."""
    records = list(records)
    by_id = {r.call_id: r for r in records}
    for r in records:
        if r.linkable and (
            r.linking is None or (r.parent_call_id is not None and r.parent_call_id not in by_id)
        ):
            return None
    families: dict[str, list[RetryLink]] = {}
    for r in records:
        if r.retry_of is not None and r.retry_of not in by_id:
            return None
        top = _top(r, by_id)
        if top is None:
            return None
        families.setdefault(top, []).append(RetryLink(r.call_id, r.status.value, r.retry_of))
    if any(sum(1 for m in f if m.status == COMPLETE) > 1 for f in families.values()):
        return None
    return len(build_chains(rollout_id, records).chains)


def _top(record: CallRecord, by_id: dict[str, CallRecord]) -> str | None:
    """The first attempt of ``record``'s retries (all stored); None for a cycle, which no
    store writes."""
    seen = {record.call_id}
    while record.retry_of is not None:
        if record.retry_of in seen:
            return None
        seen.add(record.retry_of)
        record = by_id[record.retry_of]
    return record.call_id
