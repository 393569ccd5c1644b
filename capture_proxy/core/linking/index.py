"""The per-rollout link index: captured calls by child, request and answer digest.

Owns ``LinkIndex`` (lookups that cost the same at call 5 and at call 5,000, the candidates'
preference order, the retry target, why a history matched no call, the deepest token-exact
ancestor) and how a stored record enters it (``add_record``, ``refresh_index``). Pure: no
aiohttp, no I/O; the adapter that owns the cache reads the records and hands them in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from capture_proxy.core.linking.digests import (
    tool_call_ids,
    turn_digest,
    turn_digests,
)
from capture_proxy.core.linking.entries import IN_FLIGHT, Entry, SessionKey
from capture_proxy.core.linking.mismatch import MismatchClass
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.resolution import Candidate, Candidates, Resolution
from capture_proxy.core.linking.stored import (
    FROM_RECORD,
    SessionOrFromRecord,
    StoredCall,
    of_record,
)
from capture_proxy.core.linking.verdicts import (
    HISTORY_EDITED,
    NO_MATCH,
    NOTE_PARENT,
    TOOL_CALL_IDS,
    TURN_REWRITTEN,
    Reason,
    Verdict,
    model_scope,
)
from capture_proxy.core.prefixes import PrefixIndex, StoredPrefix
from capture_proxy.core.records import CallRecord, CallStatus

#: Record statuses the index keeps (``CallStatus`` values).
CALL_COMPLETE = CallStatus.COMPLETE.value
CALL_FAILED = CallStatus.FAILED.value
CALL_INCOMPLETE = CallStatus.INCOMPLETE.value

K = TypeVar("K")


@dataclass
class LinkIndex:
    """Per-rollout digests of captured calls, looked up by child digest, by request digest and
    by answer digest (dicts: a lookup costs the same at call 5 and at call 5,000). Not
    thread-safe; one per rollout."""

    entries: dict[str, Entry] = field(default_factory=dict)
    _by_child: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)
    _by_request: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)
    _by_turn: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)
    _by_turn_without_ids: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)
    _by_tool_call_ids: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)
    #: per child digest, its calls without a child yet (where a resolution's first candidates
    #: are: ``_preference``), so resolving does not look at every call that shares the digest
    _childless: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)
    #: per request digest, its latest call by (``created_at``, call id): the retry target
    #: unless it was continued (``_retry_of``)
    _latest_request: dict[str, Entry] = field(default_factory=dict, repr=False)
    #: per request digest, its calls that may still be a retry's target: in flight, failed or
    #: incomplete, without a child, not replaced (``_retry_of``; a complete call never is, so
    #: a request repeated by thousands of answered samples costs nothing here)
    _retry_candidates: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)
    #: the complete calls by their token prefixes (``prefix_ancestor``)
    _prefixes: PrefixIndex = field(default_factory=PrefixIndex, repr=False)
    #: calls by their ``history`` (``_same_history_first``)
    _by_history: dict[bytes, dict[str, Entry]] = field(default_factory=dict, repr=False)
    #: calls filed without a ``history`` by their child digest (``_same_history_first``: read
    #: whole from the store, ``add_record``; none when every call was filed with one)
    _unknown_history: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)

    def add(
        self,
        call_id: str,
        created_at: float,
        *,
        child_digest: str | None,
        request_digest: str | None,
        harness_note: bool = False,
        rows_end: int | None = None,
        num_tokens: int | None = None,
        tokens_sha256: bytes | None = None,
        block_sha256: bytes | None = None,
        model: str | None = None,
        status: str = IN_FLIGHT,
        response: Mapping[str, Any] | None = None,
        parent_call_id: str | None = None,
        retry_of: str | None = None,
        answer_digests: tuple[str, str] | None = None,
        session: SessionKey | None = None,
        history: bytes | None = None,
    ) -> None:
        """Add a call, or replace what is known of it (a call is added when its request
        arrives and again, with its child digest and status, once it is stored).
        ``response``: its answer (indexed alone, to name a history that dropped turns);
        ``parent_call_id`` / ``retry_of``: its verified parent and the call it retried; for a
        call in flight, ``parent_call_id`` is the candidate it was resolved to: it counts as
        that call's child until it is stored with its verified parent (or none).
        ``num_tokens`` / ``tokens_sha256`` / ``block_sha256``: the token key of a complete
        call (``prefixes.token_digests``; ``block_sha256`` may be left out below
        ``PREFIX_BLOCK`` tokens). ``answer_digests``: ``turn_digests(response)``, when known
        already. ``session``: the harness session its request named (a tie-breaker among
        candidates, ``_preferring``). ``history``: its request's ``history_keys`` own key (None
        when not known: the one it was filed with before is kept)."""
        old = self.entries.get(call_id)
        if old is not None:
            # the same call filed again under the same request digest, no earlier: still the
            # latest of that digest if it was (no look at the digest's other calls)
            still_latest = old.request_digest == request_digest and old.created_at <= created_at
            self._unindex(old, find_latest=not still_latest)
        if response is None:
            turn = turn_without_ids = None
        else:
            turn, turn_without_ids = answer_digests or turn_digests(response)
        entry = Entry(
            call_id,
            created_at,
            child_digest,
            request_digest,
            harness_note,
            rows_end,
            num_tokens,
            tokens_sha256,
            model,
            status,
            turn,
            turn_without_ids,
            tool_call_ids(response),
            session=session,
            history=history if history is not None or old is None else old.history,
        )
        if old is not None:
            entry.children, entry.superseded_by = old.children, old.superseded_by
        self.entries[call_id] = entry
        if num_tokens is not None and tokens_sha256 is not None:
            prefix = StoredPrefix(call_id, created_at, num_tokens, tokens_sha256)
            self._prefixes.add(model, prefix, block_sha256)
        else:
            self._prefixes.remove(call_id)
        self._file_keys(entry)
        if old is None or old.status == IN_FLIGHT:
            if old is not None and old.counted_parent in self.entries:
                self._count_child(self.entries[old.counted_parent], -1)
            if parent_call_id is not None and parent_call_id in self.entries:
                self._count_child(self.entries[parent_call_id], +1)
                entry.counted_parent = parent_call_id
            if retry_of is not None:
                self._supersede(retry_of, call_id)
        else:
            entry.counted_parent = old.counted_parent

    def _file_keys(self, entry: Entry) -> None:
        """File ``entry`` (just made) under its digests and history, and in order."""
        for index, digest in self._keys(entry):
            if digest is not None:
                index.setdefault(digest, {})[entry.call_id] = entry
        if entry.history is not None:
            self._by_history.setdefault(entry.history, {})[entry.call_id] = entry
        elif entry.child_digest is not None:
            self._unknown_history.setdefault(entry.child_digest, {})[entry.call_id] = entry
        self._file_order(entry)

    def _supersede(self, call_id: str, retry: str) -> None:
        """``retry`` replaces ``call_id``: no retry's target again."""
        replaced = self.entries.get(call_id)
        if replaced is not None:
            replaced.superseded_by = retry
            self._file_childless(replaced)

    def end_unstored(self, call_id: str) -> None:
        """``call_id`` ended in flight with no record stored (the store refused it, or its
        handler failed): its harness got no answer, so it is filed as a failed call (an
        identical request is its retry, ``_retry_of``) and no longer counts as a child of the
        candidate it was resolved to."""
        entry = self.entries.get(call_id)
        if entry is None or entry.status != IN_FLIGHT:
            return
        entry.status = CALL_FAILED
        parent = self.entries.get(entry.counted_parent) if entry.counted_parent else None
        if parent is not None:
            self._count_child(parent, -1)
        entry.counted_parent = None

    def _keys(self, entry: Entry) -> tuple[tuple[dict[str, dict[str, Entry]], str | None], ...]:
        return (
            (self._by_child, entry.child_digest),
            (self._by_request, entry.request_digest),
            (self._by_turn, entry.turn_digest),
            (self._by_turn_without_ids, entry.turn_digest_without_ids),
            (self._by_tool_call_ids, "\x1f".join(entry.tool_call_ids) or None),
        )

    def _unindex(self, entry: Entry, *, find_latest: bool = True) -> None:
        for index, digest in self._keys(entry):
            _drop(index, digest, entry.call_id)
        if entry.history is not None:
            _drop(self._by_history, entry.history, entry.call_id)
        else:
            _drop(self._unknown_history, entry.child_digest, entry.call_id)
        _drop(self._childless, entry.child_digest, entry.call_id)
        _drop(self._retry_candidates, entry.request_digest, entry.call_id)
        digest = entry.request_digest
        if digest is not None and self._latest_request.get(digest) is entry:
            del self._latest_request[digest]
            rest = self._by_request.get(digest)
            if rest and find_latest:  # O(calls of the digest), only when the latest leaves
                self._latest_request[digest] = max(rest.values(), key=_age)

    def _file_order(self, entry: Entry) -> None:
        """File ``entry`` (just indexed) among the childless and as its request's latest."""
        self._file_childless(entry)
        digest = entry.request_digest
        if digest is not None:
            latest = self._latest_request.get(digest)
            if latest is None or _age(entry) >= _age(latest):
                self._latest_request[digest] = entry

    def _count_child(self, parent: Entry, delta: int) -> None:
        """``parent`` gained (+1) or lost (-1) a child: (un)filed among the childless."""
        parent.children += delta
        self._file_childless(parent)

    def _file_childless(self, entry: Entry) -> None:
        """``entry`` among its child digest's childless calls when it has no child, else not;
        and among its request digest's retry candidates when it may be one."""
        digest = entry.child_digest
        if digest is not None:
            if entry.children == 0:
                self._childless.setdefault(digest, {})[entry.call_id] = entry
            else:
                _drop(self._childless, digest, entry.call_id)
        digest = entry.request_digest
        if digest is not None:
            if _may_be_retried(entry):
                self._retry_candidates.setdefault(digest, {})[entry.call_id] = entry
            else:
                _drop(self._retry_candidates, digest, entry.call_id)

    @staticmethod
    def _ordered(entries: dict[str, Entry] | None) -> list[Entry]:
        return sorted((entries or {}).values(), key=_age)

    def _retry_of(
        self,
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
        latest = self._latest_request.get(req_digest)
        if latest is None:
            return None
        if _lost(latest, ends_incomplete, session):
            return latest.call_id
        if retry_requested and session is not None and latest.session == session:
            own = self._session_retry_of(latest)
            if own is not None:
                return own
        lost = [
            entry
            for entry in (self._retry_candidates.get(req_digest) or {}).values()
            if entry is not latest and _lost(entry, ends_incomplete, session)
        ]
        return max(lost, key=_age).call_id if lost else None

    def late_retry_of(
        self,
        call_id: str,
        req_digest: str,
        session: SessionKey,
        ends_incomplete: Callable[[str], bool] | None = None,
    ) -> str | None:
        """The call that ``call_id`` (in this index, a request of harness ``session`` with the
        retry header that found no call to retry when it arrived) retries, looked for again
        before it is stored (``late_retry.late_retry_step``): the latest identical call of
        that session that came before it and that its harness is known not to have got, that
        no retry replaced and no call continued. With ``serve --workers`` the attempt it
        retries may be in flight on another worker, its harness gone, when the retry comes:
        stored there since."""
        own = self.entries.get(call_id)
        if own is None:
            return None
        lost = [
            entry
            for entry in (self._retry_candidates.get(req_digest) or {}).values()
            if entry.session == session
            and _age(entry) < _age(own)
            and _lost(entry, ends_incomplete, session)
        ]
        return max(lost, key=_age).call_id if lost else None

    @staticmethod
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

    @staticmethod
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

    @staticmethod
    def _preferring(session: SessionKey | None) -> Callable[[Entry], tuple[Any, ...]]:
        """``_preference`` with, for a request that names a harness session, the calls of that
        session before the others where ``_preference`` would go on to the earliest: twin
        sessions (one task, a deterministic engine) whose calls are token-identical each
        continue their own. Only a tie-breaker: it never takes a call with a child over one
        without (that would branch one chain and leave the twin's behind)."""
        if session is None:
            return LinkIndex._preference

        def preference(entry: Entry) -> tuple[Any, ...]:
            unverifiable, superseded, has_child, created_at, call_id = LinkIndex._preference(entry)
            other = entry.session != session
            return (unverifiable, superseded, has_child, other, created_at, call_id)

        return preference

    def resolve(
        self,
        parent_digest: str | None,
        req_digest: str,
        *,
        model: str | None = None,
        last_turn: Mapping[str, Any] | None = None,
        refuse_note_parents: bool = False,
        claimed: Callable[[str], bool] | None = None,
        session: SessionKey | None = None,
        retry_requested: bool = False,
        ends_incomplete: Callable[[str], bool] | None = None,
        history: bytes | None = None,
    ) -> Resolution:
        """Find the parent candidates by digest, and the call an identical request retries.

        Candidates are the calls of the same ``model`` (a parent from another model would put
        its tokens and log probs in this model's chain) whose child digest is
        ``parent_digest``, preferred in this order: verifiable, not superseded by a retry,
        without a child yet (stored or in flight), of the request's harness ``session`` (when
        it names one: ``_preferring``), earliest (see ``_preference``). With
        ``refuse_note_parents`` (``parent_resolution = source_history``), a parent whose
        prompt carried a rewritten harness note is not taken: the call starts a new chain.
        ``last_turn``: the history's last assistant message, to tell a dropped or edited turn
        from a foreign one when no call matches. ``claimed(call_id)``: True when a call in
        flight in another process was resolved to that candidate (``claims.ChildClaims``):
        such a candidate counts as having a child, as this process's own calls in flight do.
        ``ends_incomplete(call_id)``: True when a call in flight is known to end failed or
        incomplete (its record is made so, or its harness left before it was made): as a
        retry target it counts as a stored failed or incomplete call does. With
        ``retry_requested`` (the retry header), see ``_session_retry_of``. ``history``: the
        request's continued history key: see ``_same_history_first``."""
        retry_of = self._retry_of(req_digest, ends_incomplete, session, retry_requested)
        if parent_digest is None:
            return Resolution(Verdict.ROOT, None, req_digest, retry_of=retry_of)
        found = self._by_child.get(parent_digest) or {}
        matches = self._matches(parent_digest, found, model, claimed, session, history)
        if retry_of is not None and matches:
            matches = self._retried_parent_first(matches, retry_of, found, model)
        rewritten = None
        if not found and last_turn is not None and not self._is_captured_turn(last_turn, model):
            # The harness rewrote the model's last turn (Claude Code rebuilds tool inputs,
            # adding defaults): its tool-call ids still name the call that produced it.
            # Tokens decide whether the link is taken.
            ids = "\x1f".join(tool_call_ids(last_turn))
            by_ids = (self._by_tool_call_ids.get(ids) or {}).values() if ids else ()
            mine = (e for e in by_ids if e.model == model)
            matches = Candidates(_candidates(mine, self._preferring(session)), None)
            rewritten = TURN_REWRITTEN if matches else None
        if not matches:
            reason, mismatch = self._why_unmatched(list(found.values()), model, last_turn)
            return Resolution(
                Verdict.UNRESOLVED,
                parent_digest,
                req_digest,
                retry_of=retry_of,
                reason=reason,
                mismatch=mismatch,
            )
        first = matches[0]
        if refuse_note_parents and self.entries[first.call_id].harness_note:
            return Resolution(
                Verdict.UNRESOLVED,
                parent_digest,
                req_digest,
                retry_of=retry_of,
                reason=NOTE_PARENT,
            )
        return Resolution(
            Verdict.RESOLVED,
            parent_digest,
            req_digest,
            first.call_id,
            retry_of=retry_of,
            reason=rewritten,
            parent_rows_end=first.rows_end,
            parent_num_tokens=first.num_tokens,
            parent_tokens_sha256=first.tokens_sha256,
            candidates=matches,
        )

    def shares_digest(self, parent_digest: str | None) -> bool:
        """True when more than one call has ``parent_digest`` as its child digest (parallel
        sub-agents that answered alike): which of them a continuation takes is a choice."""
        return parent_digest is not None and len(self._by_child.get(parent_digest) or ()) > 1

    def _matches(
        self,
        parent_digest: str,
        found: dict[str, Entry],
        model: str | None,
        claimed: Callable[[str], bool] | None = None,
        session: SessionKey | None = None,
        history: bytes | None = None,
    ) -> Candidates:
        """The candidates of ``model`` among ``found`` (the calls whose child digest is
        ``parent_digest``) in ``_preferring(session)`` order, those of the same ``history``
        first (``_same_history_first``). The best of that order
        (verifiable, not superseded, childless) are among the digest's childless calls, few
        however many calls share the digest: when one is there, the others are ordered only
        if asked (``Candidates``). A childless call ``claimed`` elsewhere counts as having a child:
        then all are ordered at once (rare: identical siblings continued at once)."""
        head = [
            e
            for e in (self._childless.get(parent_digest) or {}).values()
            if e.model == model and e.num_tokens is not None and e.superseded_by is None
        ]
        claimed_ids = {e.call_id for e in head if claimed(e.call_id)} if claimed else None
        if claimed_ids:
            matches, preference = self._claimed_matches(head, claimed_ids, found, model, session)
        else:
            preference = self._preferring(session)
            matches = self._unclaimed_matches(head, found, model, preference)
        if history is None:
            return matches
        return self._same_history_first(matches, history, parent_digest, found, model, preference)

    @staticmethod
    def _unclaimed_matches(
        head: list[Entry],
        found: dict[str, Entry],
        model: str | None,
        preference: Callable[[Entry], tuple[Any, ...]],
    ) -> Candidates:
        """``_matches`` when none of the childless calls (``head``) is claimed elsewhere."""
        if not head or len(head) == len(found):
            mine = (e for e in found.values() if e.model == model)
            return Candidates(_candidates(mine, preference), None)
        taken = {e.call_id for e in head}
        others = list(found.values())  # the candidates as they are now; ordered when asked
        return Candidates(
            _candidates(head, preference),
            lambda: _candidates(
                (e for e in others if e.model == model and e.call_id not in taken), preference
            ),
        )

    def _same_history_first(
        self,
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
            for e in (self._by_history.get(history) or {}).values()
            if found.get(e.call_id) is e
            and e.model == model
            and e.num_tokens is not None
            and e.superseded_by is None
        ]
        if not same:
            return matches
        unknown = (self._unknown_history.get(parent_digest) or {}).values()
        same += (
            e
            for e in unknown
            if e.model == model and e.num_tokens is not None and e.superseded_by is None
        )
        first = _candidates(same, preference)
        if matches.head_is(first):
            return matches
        taken = {c.call_id for c in first}
        return Candidates(
            first, lambda: tuple(c for c in matches.whole() if c.call_id not in taken)
        )

    def _retried_parent_first(
        self, matches: Candidates, retry_of: str, found: dict[str, Entry], model: str | None
    ) -> Candidates:
        """A retry continues what the call it replaces continued: that call's parent first,
        when it is a candidate (verifiable, not superseded). The retried call still counts as
        its child (in flight, or stored incomplete), so by ``_preference`` a twin session's
        token-identical call without a child would come first, and the retry would swap the
        twins' chains. O(1); the rest of the order is made when asked, as before."""
        retried = self.entries.get(retry_of)
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
        self,
        head: list[Entry],
        claimed_ids: set[str],
        found: dict[str, Entry],
        model: str | None,
        session: SessionKey | None = None,
    ) -> tuple[Candidates, Callable[[Entry], tuple[Any, ...]]]:
        """``_matches`` when some of the childless calls (``head``) are claimed by calls in
        flight elsewhere (``claimed_ids``): those count as having a child. The unclaimed ones
        come first, made at once; the rest (the claimed ones among the calls with a child,
        by age) only when asked, so a resolution still costs what is few. Also the order
        (claims counted)."""
        preference = self._preferring(session)

        def claims_preference(entry: Entry) -> tuple[Any, ...]:
            verifiable, superseded, has_child, *rest = preference(entry)
            taken = has_child or entry.call_id in claimed_ids
            return (verifiable, superseded, taken, *rest)

        free = [e for e in head if e.call_id not in claimed_ids]
        if not free:
            mine = (e for e in found.values() if e.model == model)
            return Candidates(_candidates(mine, claims_preference), None), claims_preference
        made = {e.call_id for e in free}
        others = list(found.values())
        return (
            Candidates(
                _candidates(free, preference),
                lambda: _candidates(
                    (e for e in others if e.model == model and e.call_id not in made),
                    claims_preference,
                ),
            ),
            claims_preference,
        )

    def _is_captured_turn(self, turn: Mapping[str, Any], model: str | None) -> bool:
        """True when ``turn`` is, exactly or but for its tool-call ids, a captured output."""
        for index, digest in (
            (self._by_turn, turn_digest(turn)),
            (self._by_turn_without_ids, turn_digest(turn, with_ids=False)),
        ):
            if any(e.model == model for e in (index.get(digest) or {}).values()):
                return True
        return False

    def _why_unmatched(
        self, found: list[Entry], model: str | None, last_turn: Mapping[str, Any] | None
    ) -> tuple[Reason, dict[str, Any] | None]:
        if found:
            models = sorted({str(e.model) for e in found})
            return model_scope(models, model), None
        if last_turn is None:
            return NO_MATCH, None
        same = self._ordered(self._by_turn.get(turn_digest(last_turn)))
        same = [e for e in same if e.model == model]
        if same:
            return (
                HISTORY_EDITED,
                {
                    "class": MismatchClass.HISTORY_EDITED.value,
                    "parent_call_id": same[-1].call_id,
                    "explanation": "the last model-authored turn is this call's output, but "
                    "the turns before it differ from its history (a turn was dropped or "
                    "edited)",
                },
            )
        alike = self._ordered(self._by_turn_without_ids.get(turn_digest(last_turn, with_ids=False)))
        alike = [e for e in alike if e.model == model]
        if alike:
            return (
                TOOL_CALL_IDS,
                {
                    "class": MismatchClass.HISTORY_EDITED.value,
                    "parent_call_id": alike[-1].call_id,
                    "explanation": "the last model-authored turn equals this call's output "
                    "but for its tool-call ids (the harness rewrote them)",
                },
            )
        return NO_MATCH, None

    def prefix_ancestor(self, prompt: np.ndarray, *, model: str | None, exclude: str) -> str | None:
        """The deepest complete call of ``model`` whose prompt + generation ids begin
        ``prompt`` (the store's prompt-parent rule, ``prefixes``), or None. O(prompt length +
        the lengths of the calls that share the prompt's blocks), from the digests kept per
        entry (``prefixes.PrefixIndex``): no arrays are read, and the rollout's other calls are
        not looked at."""
        parent = self._prefixes.deepest(prompt, model=model, exclude=exclude)
        return parent.call_id if parent is not None else None


def _age(entry: Entry) -> tuple[float, str]:
    return entry.created_at, entry.call_id


def _may_be_retried(entry: Entry) -> bool:
    """Whether ``entry`` can still be a retry's target: not answered in full, and neither a
    retry replaced it nor a call continued it (``LinkIndex._retry_candidates``)."""
    return entry.children == 0 and entry.superseded_by is None and entry.status != CALL_COMPLETE


def _lost(
    entry: Entry,
    ends_incomplete: Callable[[str], bool] | None,
    session: SessionKey | None = None,
) -> bool:
    """Whether ``entry`` is a retry target (``LinkIndex._retry_of``) for a request of harness
    ``session``: it may be retried, its harness is known not to have got its answer, and it
    is that request's sample (``_same_sample``)."""
    if not _may_be_retried(entry) or not _same_sample(entry, session):
        return False
    if entry.status in (CALL_FAILED, CALL_INCOMPLETE):
        return True
    if entry.status != IN_FLIGHT or ends_incomplete is None:
        return False
    return ends_incomplete(entry.call_id)


def _same_sample(entry: Entry, session: SessionKey | None) -> bool:
    """Whether a request of harness ``session`` may retry ``entry`` (``LinkIndex._retry_of``):
    unless both name a session and the sessions differ. In a group of samples of one prompt
    each sample is its own session (OpenCode's ``x-session-id``): a sibling sample's request
    that arrives before the lost call's own retry (on another worker of ``serve --workers``,
    or sooner on this one) is a sample of its own, never that call's retry."""
    return entry.session is None or session is None or entry.session == session


def _drop(index: dict[K, dict[str, Entry]], digest: K | None, call_id: str) -> None:
    if digest is not None and digest in index:
        index[digest].pop(call_id, None)
        if not index[digest]:
            del index[digest]


def _candidates(
    entries: Iterable[Entry],
    preference: Callable[[Entry], tuple[Any, ...]] | None = None,
) -> tuple[Candidate, ...]:
    """``entries`` in ``preference`` order (default ``LinkIndex._preference``), as candidates."""
    ordered = sorted(entries, key=preference or LinkIndex._preference)
    return tuple(Candidate(e.call_id, e.rows_end, e.num_tokens, e.tokens_sha256) for e in ordered)


def add_stored(
    index: LinkIndex, call: StoredCall, answer_digests: tuple[str, str] | None = None
) -> None:
    """Index a stored call (again, if it was in flight) from its facts (``stored``).
    ``answer_digests``: ``turn_digests`` of its answer, when known already."""
    index.add(
        call.call_id,
        call.created_at,
        child_digest=call.child_digest,
        request_digest=call.request_digest,
        harness_note=call.harness_note,
        rows_end=call.rows_end,
        model=call.model,
        status=call.status,
        response=call.response,
        parent_call_id=call.parent_call_id,
        retry_of=call.retry_of,
        num_tokens=call.num_tokens,
        tokens_sha256=call.tokens_sha256,
        block_sha256=call.block_sha256,
        answer_digests=answer_digests,
        session=call.session,
        history=call.history,
    )


def add_record(
    index: LinkIndex,
    record: CallRecord,
    digests: RecordDigests | None = None,
    session: SessionOrFromRecord = FROM_RECORD,
) -> None:
    """Index a stored call (again, if it was in flight): by the child digest its record keeps
    (else derived from its request and answer), its request digest, answer and token key.
    ``digests``: the record's ``RecordDigests``, if verification made them; ``session``: its
    request's harness session, if read already (``stored.of_record``)."""
    if digests is None or not digests.describes(record):
        digests = RecordDigests(record)
    call = of_record(record, digests, session)
    add_stored(index, call, digests.answer_digests() if call.response is not None else None)


def refresh_index(index: LinkIndex, records: Iterable[CallRecord | StoredCall]) -> None:
    """Add the stored ``records`` of the rollout (in stored order) this index does not hold as
    stored: written by another replica or worker since it was loaded."""
    for record in records:
        entry = index.entries.get(record.call_id)
        if entry is None or entry.status == IN_FLIGHT:
            add_stored(index, record if isinstance(record, StoredCall) else of_record(record))
