"""The order of a resolution's parent candidates (``index.LinkIndex.resolve``): which of the
calls whose child digest is a request's parent digest the request continues first.

Verifiable first, a call a retry superseded last, then one without a child yet (stored, in
flight, or claimed by a call in flight elsewhere), one of the request's harness session, the
earliest (``_preference``, ``preferring``); the calls whose request sent the very history the
child continues before the others (``_same_history_first``), and a retry's own parent before
all (``retried_parent_first``). The best of that order are among a digest's calls without a
child, few however many calls share the digest: the rest is ordered only when asked
(``resolution.Candidates``). Functions over the index's maps (``Filed``), which ``index``
keeps up to date. Pure: no aiohttp, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from capture_proxy.core.linking.entries import Entry, SessionKey
from capture_proxy.core.linking.resolution import Candidate, Candidates


class Filed(Protocol):
    """What the order reads of the index (``index.LinkIndex`` is one; see its fields): every
    call by id, each child digest's calls without a child yet, the calls by the history their
    request sent, and the calls filed without a history by child digest."""

    entries: dict[str, Entry]
    _childless: dict[str, dict[str, Entry]]
    _by_history: dict[bytes, dict[str, Entry]]
    _unknown_history: dict[str, dict[str, Entry]]


def _preference(entry: Entry) -> tuple[bool, bool, bool, float, str]:
    # Verifiable first; a call a retry superseded last (the harness lost its answer);
    # then one with no child yet, stored or in flight (parallel sub-agents that answered
    # alike: each continues its own, also when both continue at once), then the earliest.
    return (
        entry.num_tokens is None,
        entry.superseded_by is not None,
        entry.children > 0,
        entry.created_at,
        entry.call_id,
    )


def preferring(session: SessionKey | None) -> Callable[[Entry], tuple[Any, ...]]:
    """``_preference`` with, for a request that names a harness session, the calls of that
    session before the others where ``_preference`` would go on to the earliest: twin
    sessions (one task, a deterministic engine) whose calls are token-identical each
    continue their own. Only a tie-breaker: it never takes a call with a child over one
    without (that would branch one chain and leave the twin's behind)."""
    if session is None:
        return _preference

    def preference(entry: Entry) -> tuple[Any, ...]:
        unverifiable, superseded, has_child, created_at, call_id = _preference(entry)
        other = entry.session != session
        return (unverifiable, superseded, has_child, other, created_at, call_id)

    return preference


def ordered_matches(
    index: Filed,
    parent_digest: str,
    found: dict[str, Entry],
    model: str | None,
    claimed: Callable[[str], bool] | None = None,
    session: SessionKey | None = None,
    history: bytes | None = None,
) -> Candidates:
    """The candidates of ``model`` among ``found`` (the calls whose child digest is
    ``parent_digest``) in ``preferring(session)`` order, those of the same ``history``
    first (``_same_history_first``). The best of that order
    (verifiable, not superseded, childless) are among the digest's childless calls, few
    however many calls share the digest: when one is there, the others are ordered only
    if asked (``Candidates``). A childless call ``claimed`` elsewhere counts as having a child:
    then all are ordered at once (rare: identical siblings continued at once)."""
    head = [
        e
        for e in (index._childless.get(parent_digest) or {}).values()
        if e.model == model and e.num_tokens is not None and e.superseded_by is None
    ]
    claimed_ids = {e.call_id for e in head if claimed(e.call_id)} if claimed else None
    if claimed_ids:
        matches, preference = _claimed_matches(head, claimed_ids, found, model, session)
    else:
        preference = preferring(session)
        matches = _unclaimed_matches(head, found, model, preference)
    if history is None:
        return matches
    return _same_history_first(index, matches, history, parent_digest, found, model, preference)


def _unclaimed_matches(
    head: list[Entry],
    found: dict[str, Entry],
    model: str | None,
    preference: Callable[[Entry], tuple[Any, ...]],
) -> Candidates:
    """``ordered_matches`` when none of the childless calls (``head``) is claimed elsewhere."""
    if not head or len(head) == len(found):
        mine = (e for e in found.values() if e.model == model)
        return Candidates(candidates(mine, preference), None)
    taken = {e.call_id for e in head}
    others = list(found.values())  # the candidates as they are now; ordered when asked
    return Candidates(
        candidates(head, preference),
        lambda: candidates(
            (e for e in others if e.model == model and e.call_id not in taken), preference
        ),
    )


def _same_history_first(
    index: Filed,
    matches: Candidates,
    history: bytes,
    parent_digest: str,
    found: dict[str, Entry],
    model: str | None,
    preference: Callable[[Entry], tuple[Any, ...]],
) -> Candidates:
    """``matches`` with the verifiable, not superseded candidates whose request sent the
    very ``history`` the child sent before the turn it continues first (in ``preference``
    order among themselves), the others after them as they were. A candidate whose history
    is not known (filed without one: read whole from the store when the index was made,
    after an eviction, or by a worker whose first call of the rollout came late) may have
    sent it: it is ordered with them, not after them (a twin's call that has a key would
    else come before the session's own childless call: a branch under the twin's).

    Calls that answered alike share a child digest (the digest chains the model's turns
    only): parallel sub-agents, or sessions of one rollout that differ in their task
    message. Every candidate is verified anyway (tokens, or the exact-token splice's
    message check), but a candidate whose history differs from the child's fails it, and
    the first candidate also counts the call as its child while it is in flight (and
    claims it, with ``serve --workers``): a wrong first candidate sends its own session's
    next call past it to the digest's other calls, and each then tried costs a lookup
    (exact-token mode reads the record). The child's own parent sent that history; its
    twins (the same history) keep ``preference``'s order. O(calls with that history, and
    the digest's calls filed without one)."""
    same = [
        e
        for e in (index._by_history.get(history) or {}).values()
        if found.get(e.call_id) is e
        and e.model == model
        and e.num_tokens is not None
        and e.superseded_by is None
    ]
    if not same:
        return matches
    unknown = (index._unknown_history.get(parent_digest) or {}).values()
    same += (
        e
        for e in unknown
        if e.model == model and e.num_tokens is not None and e.superseded_by is None
    )
    first = candidates(same, preference)
    if matches.head_is(first):
        return matches
    taken = {c.call_id for c in first}
    return Candidates(first, lambda: tuple(c for c in matches.whole() if c.call_id not in taken))


def retried_parent_first(
    index: Filed, matches: Candidates, retry_of: str, found: dict[str, Entry], model: str | None
) -> Candidates:
    """A retry continues what the call it replaces continued: that call's parent first,
    when it is a candidate (verifiable, not superseded). The retried call still counts as
    its child (in flight, or stored incomplete), so by ``_preference`` a twin session's
    token-identical call without a child would come first, and the retry would swap the
    twins' chains. O(1); the rest of the order is made when asked, as before."""
    retried = index.entries.get(retry_of)
    parent = found.get(retried.counted_parent or "") if retried is not None else None
    if (
        parent is None
        or parent.model != model
        or parent.num_tokens is None
        or parent.superseded_by is not None
        or matches[0].call_id == parent.call_id
    ):
        return matches
    first = Candidate(parent.call_id, parent.rows_end, parent.num_tokens, parent.tokens_sha256)
    return Candidates(
        (first,), lambda: tuple(c for c in matches.whole() if c.call_id != parent.call_id)
    )


def _claimed_matches(
    head: list[Entry],
    claimed_ids: set[str],
    found: dict[str, Entry],
    model: str | None,
    session: SessionKey | None = None,
) -> tuple[Candidates, Callable[[Entry], tuple[Any, ...]]]:
    """``ordered_matches`` when some of the childless calls (``head``) are claimed by calls in
    flight elsewhere (``claimed_ids``): those count as having a child. The unclaimed ones
    come first, made at once; the rest (the claimed ones among the calls with a child,
    by age) only when asked, so a resolution still costs what is few. Also the order
    (claims counted)."""
    preference = preferring(session)

    def claims_preference(entry: Entry) -> tuple[Any, ...]:
        verifiable, superseded, has_child, *rest = preference(entry)
        taken = has_child or entry.call_id in claimed_ids
        return (verifiable, superseded, taken, *rest)

    free = [e for e in head if e.call_id not in claimed_ids]
    if not free:
        mine = (e for e in found.values() if e.model == model)
        return Candidates(candidates(mine, claims_preference), None), claims_preference
    made = {e.call_id for e in free}
    others = list(found.values())
    return (
        Candidates(
            candidates(free, preference),
            lambda: candidates(
                (e for e in others if e.model == model and e.call_id not in made),
                claims_preference,
            ),
        ),
        claims_preference,
    )


def candidates(
    entries: Iterable[Entry],
    preference: Callable[[Entry], tuple[Any, ...]] | None = None,
) -> tuple[Candidate, ...]:
    """``entries`` in ``preference`` order (default ``_preference``), as candidates."""
    ordered = sorted(entries, key=preference or _preference)
    return tuple(Candidate(e.call_id, e.rows_end, e.num_tokens, e.tokens_sha256) for e in ordered)
