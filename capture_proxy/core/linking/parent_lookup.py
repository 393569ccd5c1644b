"""The request-time parent lookup step: digest a request's history and ask the index.

Owns the order of request-time resolution: digest the linking items, resolve against the
rollout's index, on a miss (with replicas sharing a store) refresh the index from the stored
calls under the history's parent digest and resolve again, then register the call in flight
so a later identical request is known. Pure: a generator of ``commands`` (it asks
``ReadParentCandidates``); the caller hands in the rollout's loaded ``LinkIndex``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from capture_proxy.core.known_messages import MessageFacts, turn_payloads
from capture_proxy.core.known_tools import ToolsFacts
from capture_proxy.core.linking.claims import ChildClaims
from capture_proxy.core.linking.commands import CatchUp, ReadParentCandidates, Step, ask
from capture_proxy.core.linking.digests import (
    history_digest,
    last_linking_item,
    request_digest,
)
from capture_proxy.core.linking.index import LinkIndex, refresh_index
from capture_proxy.core.linking.late_retry import AttemptsInFlight, attempt_key
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.linking.verdicts import Verdict

#: Choices of a contested parent (``claims``) before the last one stands, unclaimed: each one
#: past the first follows a catch-up, so another is needed only when other workers stored
#: the rollout's calls again in the microseconds between two reads.
CLAIM_TRIES = 8


def resolve_step(
    index: LinkIndex,
    rollout_id: str,
    linking_messages: Sequence[Mapping[str, Any]],
    body: Mapping[str, Any],
    *,
    call_id: str,
    created_at: float,
    linking_facts: Sequence[MessageFacts] | None = None,
    tools_facts: ToolsFacts | None = None,
    refuse_note_parents: bool = False,
    refresh_on_miss: bool = False,
    claims: ChildClaims | None = None,
    index_current: Callable[[], bool] | None = None,
    session: tuple[str, str] | None = None,
    retry_requested: bool = False,
    ends_incomplete: Callable[[str], bool] | None = None,
    attempts: AttemptsInFlight | None = None,
    known_request_digest: str | None = None,
    history_keys: tuple[bytes | None, bytes | None] = (None, None),
) -> Step[Resolution]:
    """Request-time verdict for a call (before it is forwarded); see ``Linker.resolve``.

    With ``refresh_on_miss``, an unresolved history with model-authored turns asks
    ``ReadParentCandidates(rollout_id, parent_digest)`` once (the stored calls it could
    continue, another replica's included: not the whole rollout), adds those the index lacks and
    resolves again. Afterwards ``call_id`` is in ``index`` in flight, under the request's digest
    (``known_request_digest`` when made already), counted as a child of the preferred candidate
    (``LinkIndex.add``). ``tools_facts``: the ``known_tools`` facts of ``body["tools"]`` (their
    text is not written again). ``claims``: the other processes' calls in flight (``serve
    --workers``); a continuation's candidate is chosen with theirs counted as children and
    claimed for ``call_id``, under the claims' lock (also when this index knows one candidate
    only: an identical sibling's first call may still be in flight here and stored by the time
    another worker looks, which then sees two and must see this one taken). A claim is released
    when its call is stored, so the choice also needs the stored children: ``index_current()``
    says whether ``index`` still holds every call stored (asked after the claims are read); when
    not, the step asks ``CatchUp(rollout_id)`` and chooses again. ``session``,
    ``retry_requested`` and ``ends_incomplete`` are ``LinkIndex.resolve``'s; a request with the
    retry header and a session that found no call to retry is marked for a second look
    (``Resolution.retry_session``, ``late_retry``). ``attempts``: every process's calls in
    flight by ``late_retry.attempt_key``, where a call that names its session is counted.
    ``history_keys``: ``capture.PreparedRequest.history_keys`` (own: filed; continued: asked)."""
    tools_text = tools_facts.sorted_text if tools_facts is not None else None
    req_digest = known_request_digest or request_digest(body, tools_text)
    last_turn = last_linking_item(linking_messages)
    model = body.get("model")
    payloads = turn_payloads(linking_facts) if linking_facts is not None else None
    parent_digest = history_digest(linking_messages, payloads, linking_facts)

    def resolve(index: LinkIndex, held: ChildClaims | None = None) -> Resolution:
        return index.resolve(
            parent_digest,
            req_digest,
            model=model,
            last_turn=last_turn,
            refuse_note_parents=refuse_note_parents,
            claimed=held.claimed if held is not None else None,
            session=session,
            retry_requested=retry_requested,
            ends_incomplete=ends_incomplete,
            history=history_keys[1],
        )

    if claims is not None and parent_digest is not None:
        index, resolution = yield from _claim(
            index, rollout_id, call_id, claims, index_current, resolve
        )
    else:
        resolution = resolve(index)
    if refresh_on_miss and resolution.verdict is Verdict.UNRESOLVED and parent_digest is not None:
        found = yield from ask(ReadParentCandidates(rollout_id, parent_digest))
        refresh_index(index, found)
        resolution = resolve(index)
    if retry_requested and session is not None and resolution.retry_of is None:
        resolution = dataclasses.replace(resolution, retry_session=session)
    _file_in_flight(index, resolution, call_id, created_at, model, session, history_keys[0])
    if attempts is not None and session is not None:
        attempts.claim(call_id, attempt_key(rollout_id, req_digest, session))
    return resolution


def _file_in_flight(
    index: LinkIndex,
    resolution: Resolution,
    call_id: str,
    created_at: float,
    model: str | None,
    session: tuple[str, str] | None,
    history: bytes | None = None,
) -> None:
    """``call_id`` in ``index``, in flight: a child of its candidate (a sibling prefers
    another), and the call it retries replaced (an identical sibling sent meanwhile is no
    second retry of it); filed under ``history`` (its own history key), which it keeps when
    it is stored."""
    index.add(
        call_id,
        created_at,
        child_digest=None,
        request_digest=resolution.request_digest,
        model=model,
        parent_call_id=resolution.parent_call_id,
        retry_of=resolution.retry_of,
        session=session,
        history=history,
    )


def _claim(
    index: LinkIndex,
    rollout_id: str,
    call_id: str,
    claims: ChildClaims,
    index_current: Callable[[], bool] | None,
    resolve: Callable[[LinkIndex, ChildClaims | None], Resolution],
) -> Step[tuple[LinkIndex, Resolution]]:
    """The candidate chosen again with the claims held still, and claimed for ``call_id``; a
    claim read as gone may be a call stored since the index was brought up: then the index is
    caught up (``CatchUp``) and the choice made again. Returns the index (caught up or not)
    and the resolution. (Another worker's call in flight may have taken the preferred
    candidate, and the one taken here must be seen as taken there: also where this index
    knows one candidate only, as an identical sibling's first call still in flight when this
    index looked is a second one to a worker that looks later.)"""
    for _ in range(CLAIM_TRIES):
        with claims.locked():
            resolution = resolve(index, claims)
            current = index_current is None or index_current()
            if current and resolution.parent_call_id is not None:
                claims.claim(call_id, resolution.parent_call_id)
            if current:
                return index, resolution
        index = yield from ask(CatchUp(rollout_id))
    return index, resolution
