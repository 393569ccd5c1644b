"""The retry target (``index.LinkIndex.resolve``): which captured call an identical request
retries, if any.

The latest identical call whose answer the harness is known not to have got, that no retry
replaced and no call continued (``retry_target``); an identical call answered in full only
for a request of its own harness session with the retry header (``_session_retry_of``); a
call that names a session only for a request of that session (``_same_sample``); and the
second look of a retry that found no call to retry when it arrived (``late_retry_of``, for
``late_retry``). Functions over the index's maps (``ByRequest``), which ``index`` keeps up to
date (which calls may still be a target: ``may_be_retried``). Pure: no aiohttp, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from capture_proxy.core.linking.entries import (
    CALL_COMPLETE,
    CALL_FAILED,
    CALL_INCOMPLETE,
    IN_FLIGHT,
    Entry,
    SessionKey,
    age,
)


class ByRequest(Protocol):
    """What the retry target reads of the index (``index.LinkIndex`` is one; see its fields):
    every call by id, each request digest's latest call, and each request digest's calls that
    may still be a retry's target."""

    entries: dict[str, Entry]
    _latest_request: dict[str, Entry]
    _retry_candidates: dict[str, dict[str, Entry]]


def retry_target(
    index: ByRequest,
    req_digest: str,
    ends_incomplete: Callable[[str], bool] | None = None,
    session: SessionKey | None = None,
    retry_requested: bool = False,
) -> str | None:
    """The call an identical request retries: the latest identical call whose answer the
    harness is known not to have got, that no earlier retry replaced and no call
    continued: stored failed or incomplete, or still in flight and
    ``ends_incomplete(call_id)`` (its harness left). An identical call answered in full
    is the target only of a request with the retry header of the same harness
    ``session`` (``_session_retry_of``): in a group of samples of one prompt (GRPO), one
    sample's retry whose first attempt never reached the proxy would otherwise replace
    another sample's answered call and drop it from the chains. A call that names a
    session is retried only by a request of that session (``_same_sample``): a sibling
    sample's identical request that comes before the lost call's own retry (on another
    worker of ``serve --workers``, or sooner on this one) is no retry of it. Identical
    requests otherwise are sibling samples, each its own call.

    Cost: O(1) when the latest identical call is the target (the usual retry); else the
    identical calls that may be one (in flight, failed or incomplete: a group of samples
    sent at once), never the answered ones nor the rollout."""
    latest = index._latest_request.get(req_digest)
    if latest is None:
        return None
    if _lost(latest, ends_incomplete, session):
        return latest.call_id
    if retry_requested and session is not None and latest.session == session:
        own = _session_retry_of(latest)
        if own is not None:
            return own
    lost = [
        entry
        for entry in (index._retry_candidates.get(req_digest) or {}).values()
        if entry is not latest and _lost(entry, ends_incomplete, session)
    ]
    return max(lost, key=age).call_id if lost else None


def late_retry_of(
    index: ByRequest,
    call_id: str,
    req_digest: str,
    session: SessionKey,
    ends_incomplete: Callable[[str], bool] | None = None,
) -> str | None:
    """The call that ``call_id`` (in ``index``, a request of harness ``session`` with the
    retry header that found no call to retry when it arrived) retries, looked for again
    before it is stored (``late_retry.late_retry_step``): the latest identical call of
    that session that came before it and that its harness is known not to have got, that
    no retry replaced and no call continued. With ``serve --workers`` the attempt it
    retries may be in flight on another worker, its harness gone, when the retry comes:
    stored there since."""
    own = index.entries.get(call_id)
    if own is None:
        return None
    lost = [
        entry
        for entry in (index._retry_candidates.get(req_digest) or {}).values()
        if entry.session == session
        and age(entry) < age(own)
        and _lost(entry, ends_incomplete, session)
    ]
    return max(lost, key=age).call_id if lost else None


def _session_retry_of(latest: Entry) -> str | None:
    """The call a request of ``latest``'s session that the harness marks as a retry
    (``x-stainless-retry-count``) retries: ``latest``, the latest identical call, when it
    was answered in full, not continued and not replaced. The session makes the header
    exact: an SDK retries its own session's request, and a process that stored a call and
    died before its answer's end reached the harness (a replica killed after the commit)
    left it complete. Without a session the header names no call: in a group of samples
    of one prompt it cannot tell whose call was lost."""
    if latest.status != CALL_COMPLETE or latest.children > 0:
        return None
    return latest.call_id if latest.superseded_by is None else None


def may_be_retried(entry: Entry) -> bool:
    """Whether ``entry`` can still be a retry's target: not answered in full, and neither a
    retry replaced it nor a call continued it (``LinkIndex._retry_candidates``)."""
    return entry.children == 0 and entry.superseded_by is None and entry.status != CALL_COMPLETE


def _lost(
    entry: Entry,
    ends_incomplete: Callable[[str], bool] | None,
    session: SessionKey | None = None,
) -> bool:
    """Whether ``entry`` is a retry target (``retry_target``) for a request of harness
    ``session``: it may be retried, its harness is known not to have got its answer, and it
    is that request's sample (``_same_sample``)."""
    if not may_be_retried(entry) or not _same_sample(entry, session):
        return False
    if entry.status in (CALL_FAILED, CALL_INCOMPLETE):
        return True
    if entry.status != IN_FLIGHT or ends_incomplete is None:
        return False
    return ends_incomplete(entry.call_id)


def _same_sample(entry: Entry, session: SessionKey | None) -> bool:
    """Whether a request of harness ``session`` may retry ``entry`` (``retry_target``):
    unless both name a session and the sessions differ. In a group of samples of one prompt
    each sample is its own session (OpenCode's ``x-session-id``): a sibling sample's request
    that arrives before the lost call's own retry (on another worker of ``serve --workers``,
    or sooner on this one) is a sample of its own, never that call's retry."""
    return entry.session is None or session is None or entry.session == session
