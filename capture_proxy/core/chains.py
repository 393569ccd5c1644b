"""Chain building: link the captured calls of one rollout by exact token continuity.

Owns the rule that decides parent and child, and the order of calls in a chain. It must not
resolve parents from text (that is the request-time digest resolution) and must never invent a
link: a child's prompt ids must begin with the parent's prompt ids followed by the parent's
generation ids, token for token.

Rule: a call whose parent was resolved by digest at request time and verified by tokens
(``linking`` present) keeps that parent; it is never re-linked by prefix, so a refused link
stays refused. A call captured without a linking verdict (older records) is linked by the
prefix rule: among the rollout's complete calls whose prompt + generation ids are a prefix of
its prompt ids, the longest (deepest) one is its parent. Ties (identical prompt + generation)
go to the earliest ``created_at``, then the smallest call id, so the result does not depend on
arrival order. Only calls with a non-empty generation can be parents, which rules out cycles.

Retries: calls recorded as retries of one request (``retry_of``) form a group; only the member
the harness continued from (one with children; if none has, the latest) stays in the chain, the
others are listed as superseded, never as sibling branches.

Cost: O(N^2) prefix comparisons per rollout (vectorised with numpy); fine for hundreds of calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from capture_proxy.core.records import CallRecord


@dataclass(frozen=True)
class Chain:
    """Calls linked parent to child, root first then depth-first, siblings by
    (``created_at``, ``call_id``). ``chain_id`` is the root's call id. A chain with branches
    (two children of one parent) is a tree; ``parent_of`` gives its edges."""

    chain_id: str
    calls: list[CallRecord]
    parent_of: dict[str, str | None]

    @property
    def num_branches(self) -> int:
        """Number of calls that have more than one child."""
        counts: dict[str, int] = {}
        for parent in self.parent_of.values():
            if parent is not None:
                counts[parent] = counts.get(parent, 0) + 1
        return sum(1 for n in counts.values() if n > 1)


@dataclass(frozen=True)
class RolloutChains:
    """The chains of one rollout plus the calls that cannot be linked (incomplete, failed)."""

    rollout_id: str
    chains: list[Chain]
    unlinked: list[CallRecord] = field(default_factory=list)
    #: call id -> the retry-group member that superseded it
    superseded: dict[str, str] = field(default_factory=dict)

    @property
    def parent_of(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for chain in self.chains:
            out.update(chain.parent_of)
        return out


def _order_key(record: CallRecord) -> tuple[float, str]:
    return (record.created_at, record.call_id)


def _is_prefix(prefix: np.ndarray, of: np.ndarray) -> bool:
    n = prefix.shape[0]
    return n <= of.shape[0] and bool(np.array_equal(of[:n], prefix))


def find_parents(records: Iterable[CallRecord]) -> dict[str, str | None]:
    """Map each linkable call id to its parent call id (None for a root).

    Records that are not ``linkable`` (incomplete or failed) are left out of the result.
    """
    calls = sorted((r for r in records if r.linkable), key=_order_key)
    # Candidates sorted deepest first, then by arrival: the first match is the parent.
    candidates = sorted(
        (r for r in calls if r.num_generation_tokens > 0),
        key=lambda r: (-(r.num_prompt_tokens + r.num_generation_tokens), *_order_key(r)),
    )
    full = {r.call_id: r.full_token_ids() for r in candidates}
    ids = {r.call_id for r in calls}
    parent_of: dict[str, str | None] = {}
    for child in calls:
        parent_of[child.call_id] = None
        if child.linking is not None:
            parent = child.parent_call_id
            parent_of[child.call_id] = parent if parent in ids else None
            continue
        for cand in candidates:
            if cand.call_id == child.call_id:
                continue
            if _is_prefix(full[cand.call_id], child.prompt_token_ids):
                parent_of[child.call_id] = cand.call_id
                break
    return parent_of


def superseded_retries(
    records: Iterable[CallRecord], parent_of: dict[str, str | None]
) -> dict[str, str]:
    """Map each superseded call to the call that stays in the chain in its place. A retry
    replaces the attempt it names (``retry_of``: C retries B, which retries A): the attempt is
    superseded, unless the harness continued from it (it has a child): then its retries that
    nobody continued are superseded by it. Two calls that name the same attempt are both
    kept: each is its own sample (with ``serve --workers`` two identical requests can each be
    taken for the retry of one failed call; only one of them was). Among linkable calls
    (``parent_of``'s keys) only."""
    retries: dict[str, list[CallRecord]] = {}
    for r in records:
        if r.call_id in parent_of and r.retry_of in parent_of and r.retry_of != r.call_id:
            retries.setdefault(r.retry_of, []).append(r)
    has_children = {p for p in parent_of.values() if p is not None}
    out: dict[str, str] = {}
    for attempt, named_by in retries.items():
        named_by.sort(key=_order_key)
        if attempt in has_children:  # the harness continued from it: its unused retries go
            for r in named_by:
                if r.call_id not in has_children:
                    out[r.call_id] = attempt
        else:
            used = [r for r in named_by if r.call_id in has_children] or named_by
            out[attempt] = used[-1].call_id
    return {call_id: _kept(call_id, out) for call_id in out}


def _kept(call_id: str, replaced_by: dict[str, str]) -> str:
    """The call that stays in place of ``call_id`` (following replacements; a cycle, which no
    store writes, stops the walk)."""
    seen = {call_id}
    while call_id in replaced_by and replaced_by[call_id] not in seen:
        call_id = replaced_by[call_id]
        seen.add(call_id)
    return call_id


def build_chains(rollout_id: str, records: Iterable[CallRecord]) -> RolloutChains:
    """Group a rollout's calls into chains, deterministically for any input order."""
    records = list(records)
    parent_of = find_parents(records)
    superseded = superseded_retries(records, parent_of)
    for call_id in superseded:
        del parent_of[call_id]
    by_id = {r.call_id: r for r in records if r.call_id in parent_of}
    children: dict[str, list[CallRecord]] = {}
    roots: list[CallRecord] = []
    for call_id, parent in parent_of.items():
        if parent is None:
            roots.append(by_id[call_id])
        else:
            children.setdefault(parent, []).append(by_id[call_id])
    for kids in children.values():
        kids.sort(key=_order_key)
    roots.sort(key=_order_key)

    chains = []
    for root in roots:
        ordered: list[CallRecord] = []
        edges: dict[str, str | None] = {}
        stack = [root]
        while stack:
            node = stack.pop()
            ordered.append(node)
            edges[node.call_id] = parent_of[node.call_id]
            stack.extend(reversed(children.get(node.call_id, [])))
        chains.append(Chain(chain_id=root.call_id, calls=ordered, parent_of=edges))
    unlinked = sorted((r for r in records if r.call_id not in parent_of), key=_order_key)
    # A call that never got into a chain (cut off, failed) and that the harness retried is
    # superseded by its retry: the latest of those the harness continued from, else the latest.
    has_children = {p for p in parent_of.values() if p is not None}
    retried_by: dict[str, str] = {}
    for r in sorted(records, key=_order_key):
        if r.retry_of is not None:
            held = retried_by.get(r.retry_of)
            if held is None or held not in has_children or r.call_id in has_children:
                retried_by[r.retry_of] = r.call_id
    unlinked_ids = {r.call_id for r in unlinked}
    for r in unlinked:
        if r.call_id not in superseded and r.call_id in retried_by:
            # through later attempts to the one that stays (a cut-off retry of a cut-off call)
            target, seen = retried_by[r.call_id], {r.call_id}
            while target not in seen:
                seen.add(target)
                if target in superseded:
                    target = superseded[target]
                elif target in unlinked_ids and target in retried_by:
                    target = retried_by[target]
                else:
                    break
            superseded[r.call_id] = target
    return RolloutChains(rollout_id, chains, unlinked, superseded)
