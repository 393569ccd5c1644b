"""The per-rollout link index: captured calls by child, request and answer digest.

Owns ``LinkIndex`` (lookups that cost the same at call 5 and at call 5,000, why a history
matched no call, the deepest token-exact ancestor; the candidates' preference order is
``candidate_order``'s and the retry target ``retry_target``'s, over the maps kept here) and
how a stored record enters it (``add_record``, ``refresh_index``). Pure: no aiohttp, no
I/O; the adapter that owns the cache reads the records and hands them in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from capture_proxy.core.linking.candidate_order import (
    candidates,
    ordered_matches,
    preferring,
    retried_parent_first,
)
from capture_proxy.core.linking.digests import (
    tool_call_ids,
    turn_digest,
    turn_digests,
)
from capture_proxy.core.linking.entries import (
    CALL_COMPLETE,  # noqa: F401 (index's name still, as is CALL_INCOMPLETE)
    CALL_FAILED,
    CALL_INCOMPLETE,  # noqa: F401
    IN_FLIGHT,
    Entry,
    SessionKey,
    age,
)
from capture_proxy.core.linking.mismatch import MismatchClass
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.resolution import Candidates, Resolution
from capture_proxy.core.linking.retry_target import late_retry_of, may_be_retried, retry_target
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
from capture_proxy.core.records import CallRecord

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
    #: are: ``candidate_order``), so resolving does not look at every call that shares the digest
    _childless: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)
    #: per request digest, its latest call by (``created_at``, call id): the retry target
    #: unless it was continued (``retry_target``)
    _latest_request: dict[str, Entry] = field(default_factory=dict, repr=False)
    #: per request digest, its calls that may still be a retry's target: in flight, failed or
    #: incomplete, without a child, not replaced (``retry_target``; a complete call never is, so
    #: a request repeated by thousands of answered samples costs nothing here)
    _retry_candidates: dict[str, dict[str, Entry]] = field(default_factory=dict, repr=False)
    #: the complete calls by their token prefixes (``prefix_ancestor``)
    _prefixes: PrefixIndex = field(default_factory=PrefixIndex, repr=False)
    #: calls by their ``history`` (``candidate_order``: the same history first)
    _by_history: dict[bytes, dict[str, Entry]] = field(default_factory=dict, repr=False)
    #: calls filed without a ``history`` by their child digest (``candidate_order``; read whole
    #: from the store, ``add_record``; none when every call was filed with one)
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
        candidates, ``candidate_order.preferring``). ``history``: its request's ``history_keys``
        own key (None when not known: the one it was filed with before is kept)."""
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
        identical request is its retry, ``retry_target``) and no longer counts as a child of the
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
                self._latest_request[digest] = max(rest.values(), key=age)

    def _file_order(self, entry: Entry) -> None:
        """File ``entry`` (just indexed) among the childless and as its request's latest."""
        self._file_childless(entry)
        digest = entry.request_digest
        if digest is not None:
            latest = self._latest_request.get(digest)
            if latest is None or age(entry) >= age(latest):
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
            if may_be_retried(entry):
                self._retry_candidates.setdefault(digest, {})[entry.call_id] = entry
            else:
                _drop(self._retry_candidates, digest, entry.call_id)

    @staticmethod
    def _ordered(entries: dict[str, Entry] | None) -> list[Entry]:
        return sorted((entries or {}).values(), key=age)

    def late_retry_of(
        self,
        call_id: str,
        req_digest: str,
        session: SessionKey,
        ends_incomplete: Callable[[str], bool] | None = None,
    ) -> str | None:
        """The call that ``call_id`` retries, looked for again before it is stored
        (``retry_target.late_retry_of``, over this index)."""
        return late_retry_of(self, call_id, req_digest, session, ends_incomplete)

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
        it names one), earliest (see ``candidate_order``). With
        ``refuse_note_parents`` (``parent_resolution = source_history``), a parent whose
        prompt carried a rewritten harness note is not taken: the call starts a new chain.
        ``last_turn``: the history's last assistant message, to tell a dropped or edited turn
        from a foreign one when no call matches. ``claimed(call_id)``: True when a call in
        flight in another process was resolved to that candidate (``claims.ChildClaims``):
        such a candidate counts as having a child, as this process's own calls in flight do.
        ``ends_incomplete(call_id)``: True when a call in flight is known to end failed or
        incomplete (its record is made so, or its harness left before it was made): as a
        retry target it counts as a stored failed or incomplete call does. With ``retry_requested``
        (the retry header), see ``retry_target._session_retry_of``. ``history``: the request's
        continued history key: those that sent it first (``candidate_order``)."""
        retry_of = retry_target(self, req_digest, ends_incomplete, session, retry_requested)
        if parent_digest is None:
            return Resolution(Verdict.ROOT, None, req_digest, retry_of=retry_of)
        found = self._by_child.get(parent_digest) or {}
        matches = ordered_matches(self, parent_digest, found, model, claimed, session, history)
        if retry_of is not None and matches:
            matches = retried_parent_first(self, matches, retry_of, found, model)
        rewritten = None
        if not found and last_turn is not None and not self._is_captured_turn(last_turn, model):
            # The harness rewrote the model's last turn (Claude Code rebuilds tool inputs,
            # adding defaults): its tool-call ids still name the call that produced it.
            # Tokens decide whether the link is taken.
            ids = "\x1f".join(tool_call_ids(last_turn))
            by_ids = (self._by_tool_call_ids.get(ids) or {}).values() if ids else ()
            mine = (e for e in by_ids if e.model == model)
            matches = Candidates(candidates(mine, preferring(session)), None)
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


def _drop(index: dict[K, dict[str, Entry]], digest: K | None, call_id: str) -> None:
    if digest is not None and digest in index:
        index[digest].pop(call_id, None)
        if not index[digest]:
            del index[digest]


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
