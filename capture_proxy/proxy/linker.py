"""The driver of the linking steps over the store, the recent calls and the engine.

Owns the per-rollout ``LinkIndex`` cache (``RolloutIndexes``: filled lazily from the store the
first time a rollout is seen by this process, so a restart loses nothing; with a shared store,
written by other replicas too, refreshed from the store when a digest misses), the calls
stored lately (``RecentCalls``: a parent is read from memory, not decoded from the store, see
``get_call``; stored records never change, so this holds with replicas too), and the answers
to the commands of the core's steps (``capture_proxy.core.linking.parent_lookup.resolve_step``,
``capture_proxy.core.linking.late_retry.late_retry_step`` and
``capture_proxy.core.linking.verification.verify_step``): a parent record, the stored calls a
history continues (by child digest), a prefix ancestor from the cached index, texts from the
engine's ``/detokenize``. Every linking decision is the core's; this module must not take one.

With an ``IndexFeed`` (a worker of ``serve --workers`` on the embedded store: ``store.remote``)
a cached index is brought up to date before it is used whenever the rollout's count of
committed writes moved past what it reflects: the calls stored since are read (their index
facts only) and added, so a worker links as one process would, whichever worker stored the
rollout's earlier calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from capture_proxy.core.known_bodies import KnownBodies
from capture_proxy.core.known_messages import KnownMessages, MessageFacts
from capture_proxy.core.known_tools import KnownTools, ToolsFacts
from capture_proxy.core.linking.claims import ChildClaims
from capture_proxy.core.linking.commands import (
    AwaitAttempts,
    CatchUp,
    Command,
    Detokenize,
    FindPrefixAncestor,
    ReadParent,
    ReadParentCandidates,
    Step,
)
from capture_proxy.core.linking.index import LinkIndex, add_record, refresh_index
from capture_proxy.core.linking.late_retry import AttemptsInFlight, late_retry_step
from capture_proxy.core.linking.parent_lookup import resolve_step
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.linking.stored import FROM_RECORD, SessionOrFromRecord, StoredCall
from capture_proxy.core.linking.verification import verify_step
from capture_proxy.core.records import CallRecord
from capture_proxy.proxy.cache_bounds import CacheBounds
from capture_proxy.proxy.recent import RecentCalls
from capture_proxy.proxy.rollout_indexes import RolloutIndexes
from capture_proxy.store.base import CaptureStore

log = logging.getLogger("capture_proxy")

#: ``decode(token_ids) -> text``; None when decoding is not possible.
Decoder = Callable[[list[int]], Awaitable[str | None]]

T = TypeVar("T")

#: How long a retry's second look (``late_retry``) waits at most for an identical request of
#: its session in flight on another worker to end (seconds): that worker finds a harness gone
#: within ``executor.CLIENT_CHECK_S`` (0.5 s) and stores the call; a call whose harness is
#: still there is no attempt the retry replaces, and is not waited for longer.
ATTEMPT_WAIT_S = 2.0
#: How often that wait looks at the workers' counts (seconds).
ATTEMPT_POLL_S = 0.01


class IndexFeed(Protocol):
    """What keeps a rollout's cached index current when other processes store its calls
    (``store.remote.WorkerStore``): a count of the rollout's committed writes read without
    I/O, and its rows stored after a rowid."""

    def stamp(self, rollout_id: str) -> int: ...

    async def last_rowid(self, rollout_id: str) -> int: ...

    async def stored_since(
        self, rollout_id: str, after_rowid: int
    ) -> tuple[list[StoredCall] | None, int]: ...

    def own_put_stamp(self, call_id: str) -> int | None: ...


class Linker:
    """One per proxy process. ``refuse_note_parents``: ``parent_resolution = source_history``;
    ``bounds``: what its caches may hold (default: their full sizes)."""

    def __init__(
        self,
        store: CaptureStore,
        *,
        refuse_note_parents: bool = False,
        max_rollouts: int = 10_000,
        bounds: CacheBounds | None = None,
        refresh_on_miss: bool = False,
        feed: IndexFeed | None = None,
        claims: ChildClaims | None = None,
        attempts: AttemptsInFlight | None = None,
        on_index_load: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        bounds = bounds if bounds is not None else CacheBounds.of()
        self.feed = feed
        #: the workers' calls in flight by the candidate each was resolved to (``serve
        #: --workers``): identical siblings continued at once on two workers take two parents
        self.claims = claims
        #: the workers' calls in flight by request and session (``serve --workers``): a
        #: retry's attempt still in flight on another worker is waited for (``late_retry``)
        self.attempts = attempts
        #: per cached rollout (with ``feed``): [its count of writes, the last rowid] its index
        #: reflects
        self._sync: dict[str, list[int]] = {}
        self.refuse_note_parents = refuse_note_parents
        #: another process may have written calls of a cached rollout (replicas on a shared
        #: store, a rollout moved between them): a digest miss reloads the index first
        self.refresh_on_miss = refresh_on_miss
        #: the rollouts' indexes in memory: bounded by rollouts and by calls, dropped ones
        #: made again from the store when needed, one with calls in flight here kept
        self.indexes = RolloutIndexes(max_rollouts, bounds.index_calls, on_evict=self._evicted)
        #: told of each index made from the store (a metric)
        self.on_index_load = on_index_load
        self._locks: dict[str, asyncio.Lock] = {}
        #: the records this process stored lately (the parents of the next calls)
        self.recent = RecentCalls(bounds.recent_bytes)
        #: facts of the messages of the requests this process saw lately
        self.known_messages = KnownMessages(bounds.message_facts_bytes)
        #: facts of the tools of the requests this process saw lately
        self.known_tools = KnownTools(bounds.tools_bytes)
        #: the latest request bodies of the sessions this process served (a call parses the
        #: bytes its history does not repeat)
        self.known_bodies = KnownBodies(bounds.request_bodies_bytes)
        #: per call in flight here, whether it is known to end failed or incomplete (its
        #: executor's ``ends_incomplete``), until ``release``
        self._ends_incomplete: dict[str, Callable[[], bool]] = {}

    def _evicted(self, rollout_id: str) -> None:
        """The rollout's index was dropped for the bounds: what is kept beside it goes too."""
        self._sync.pop(rollout_id, None)
        lock = self._locks.get(rollout_id)
        if lock is not None and not lock.locked():
            del self._locks[rollout_id]

    async def _index(self, rollout_id: str) -> LinkIndex:
        index = self.indexes.get(rollout_id)
        if index is not None:
            return index
        lock = self._locks.setdefault(rollout_id, asyncio.Lock())
        async with lock:
            index = self.indexes.peek(rollout_id)
            if index is None:
                index, sync = await self._load_index(rollout_id)
                if self.on_index_load is not None:
                    self.on_index_load()
                if sync is not None:
                    self._sync[rollout_id] = sync
                self.indexes.put(rollout_id, index)
        return index

    async def _load_index(self, rollout_id: str) -> tuple[LinkIndex, list[int] | None]:
        """The rollout's index made from the store, and (with a ``feed``) the write count and
        the last rowid it reflects: from the rows' index facts (``of_row``: no record decoded,
        the calls' history keys read from their message chains), else (a row cannot tell
        them, or the store does not read them so) from the records read whole."""
        feed = self.feed
        index = LinkIndex()
        if feed is None:
            facts, last, stamp = await self.store.rollout_index_facts(rollout_id), 0, 0
        else:
            stamp = feed.stamp(rollout_id)  # counted BEFORE the read: later writes read again
            facts, last = await feed.stored_since(rollout_id, 0)
        calls: Sequence[StoredCall | CallRecord] | None = facts
        if calls is None:
            if feed is not None:  # bounded BEFORE the read, as the count
                last = await feed.last_rowid(rollout_id)
            calls = await self.store.get_rollout_calls(rollout_id)
        refresh_index(index, calls)
        return index, None if feed is None else [stamp, last]

    async def _current_index(self, rollout_id: str) -> LinkIndex:
        """The rollout's index holding every call stored before now (``IndexFeed``)."""
        index = self.indexes.get(rollout_id)
        feed = self.feed
        if index is None:
            return await self._index(rollout_id)
        if feed is None:
            return index
        stamp = feed.stamp(rollout_id)
        sync = self._sync.get(rollout_id)
        if sync is not None and sync[0] == stamp:
            return index
        calls, last = await feed.stored_since(rollout_id, sync[1] if sync else 0)
        if calls is None:
            # Rows that cannot tell their facts: the rollout's records read whole, and those
            # the index lacks added to it (not an index made again: its calls in flight here
            # are not in the store). The last rowid bounded BEFORE the read, as the count.
            last = await feed.last_rowid(rollout_id)
            refresh_index(index, await self.store.get_rollout_calls(rollout_id))
        else:
            refresh_index(index, calls)
        self._sync[rollout_id] = [stamp, last]
        self.indexes.count(rollout_id, index)
        return index

    def _is_current(self, rollout_id: str) -> bool:
        """True when the cached index holds every call of the rollout stored (``feed``: its
        count of writes is the one the index reflects)."""
        assert self.feed is not None
        sync = self._sync.get(rollout_id)
        return sync is not None and sync[0] == self.feed.stamp(rollout_id)

    def has_calls(self, rollout_id: str) -> bool:
        """True when this process has seen a call of the rollout (stored or in flight) and
        still holds its index."""
        index = self.indexes.peek(rollout_id)
        return index is not None and bool(index.entries)

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout's index and recent calls (it was deleted)."""
        self.indexes.drop(rollout_id)
        self._sync.pop(rollout_id, None)
        self._locks.pop(rollout_id, None)
        self.recent.forget(rollout_id)

    async def get_call(self, call_id: str) -> CallRecord | None:
        """A stored call, as ``store.get_call`` answers it: from the recent calls when this
        process stored or read it lately (read-only, like the store's records), else from the
        store (and kept: the candidates another worker stored are looked up by every
        continuation that tries them)."""
        record = self.recent.get(call_id)
        if record is not None:
            return record
        record = await self.store.get_call(call_id)
        if record is not None:
            self.recent.put(record)
        return record

    async def resolve(
        self,
        rollout_id: str,
        linking_messages: list[dict[str, Any]],
        body: dict[str, Any],
        *,
        call_id: str,
        created_at: float,
        linking_facts: Sequence[MessageFacts] | None = None,
        tools_facts: ToolsFacts | None = None,
        session: tuple[str, str] | None = None,
        retry_requested: bool = False,
        ends_incomplete: Callable[[], bool] | None = None,
        request_digest: str | None = None,
        history_keys: tuple[bytes | None, bytes | None] = (None, None),
    ) -> Resolution:
        """Request-time verdict for a call (before it is forwarded). The call's request digest
        is registered at once (in flight), so a later identical request is known; it is this
        call's retry only when this call's harness is known not to have got its answer (it
        failed or was left incomplete, also while it is in flight and its
        ``ends_incomplete()`` says so), else a sibling sample (``LinkIndex.resolve``).
        ``linking_facts``: the ``known_messages`` facts of ``linking_messages``,
        ``tools_facts`` the ``known_tools`` facts of ``body["tools"]``; ``session`` the harness
        session the request names (a tie-breaker among token-identical candidates);
        ``request_digest``: the body's ``digests.request_digest``, when made already;
        ``history_keys``: ``capture.PreparedRequest.history_keys`` (candidates that sent the
        history this request continues come first)."""
        # Counted in flight before its index is looked at: the step may await the store (a
        # catch-up, the candidates of a miss) before it files the call there, and an index
        # evicted meanwhile would be the one the call is filed in, reloaded without it for
        # the next call. Undone when the resolution fails.
        counted = self.indexes.pin(call_id, rollout_id)
        try:
            index = (
                await self._current_index(rollout_id)
                if self.feed is not None
                else self.indexes.get(rollout_id) or await self._index(rollout_id)
            )
            step = resolve_step(
                index,
                rollout_id,
                linking_messages,
                body,
                call_id=call_id,
                created_at=created_at,
                linking_facts=linking_facts,
                tools_facts=tools_facts,
                refuse_note_parents=self.refuse_note_parents,
                refresh_on_miss=self.refresh_on_miss,
                claims=self.claims,
                index_current=(lambda: self._is_current(rollout_id)) if self.feed else None,
                session=session,
                retry_requested=retry_requested,
                ends_incomplete=self._known_to_end_incomplete,
                attempts=self.attempts,
                known_request_digest=request_digest,
                history_keys=history_keys,
            )
            resolution = await self._drive(step, None)
        except BaseException:
            if counted:
                self.indexes.unpin(call_id)
            raise
        if ends_incomplete is not None:
            self._ends_incomplete[call_id] = ends_incomplete
        self.indexes.count(rollout_id, index)
        return resolution

    def _known_to_end_incomplete(self, call_id: str) -> bool:
        """Whether ``call_id``, in flight here, is known to end failed or incomplete."""
        ends_incomplete = self._ends_incomplete.get(call_id)
        return ends_incomplete is not None and ends_incomplete()

    def release(self, rollout_id: str, call_id: str, *, unstored: bool = False) -> None:
        """``call_id`` ended (its record stored, or not to be): the candidate it claimed
        (``resolve`` with claims) is free for the other workers' calls. ``unstored``: it ended
        with no record stored and no answer given as a success (the store refused it): it is
        filed as failed in the rollout's index (``LinkIndex.end_unstored``: its retry names
        it)."""
        self._ends_incomplete.pop(call_id, None)
        self.indexes.unpin(call_id)
        index = self.indexes.peek(rollout_id) if unstored else None
        if index is not None:
            index.end_unstored(call_id)
        if self.claims is not None:
            self.claims.release(call_id)
        if self.attempts is not None:
            self.attempts.release(call_id)

    async def remember(
        self,
        record: CallRecord,
        message_facts: Sequence[MessageFacts] | None = None,
        digests: RecordDigests | None = None,
        session: SessionOrFromRecord = FROM_RECORD,
    ) -> None:
        """Make a persisted call findable by its children (by digest, and its record in
        memory, with the facts of its request messages). ``digests``: the ones ``verify``
        filled for this record (its prompt is then not hashed again); ``session``: the
        harness session its request names, as the call's flow read it for ``resolve``
        (``FROM_RECORD``: read from the record)."""
        rollout_id = record.rollout_id
        index = self.indexes.get(rollout_id) or await self._index(rollout_id)
        add_record(index, record, digests, session)
        self.indexes.count(rollout_id, index)
        self.recent.put(record, message_facts, digests)
        if self.feed is not None:  # its put counted; nothing else came between: current
            stamp = self.feed.own_put_stamp(record.call_id)
            sync = self._sync.get(rollout_id)
            if stamp is not None and sync is not None and sync[0] == stamp - 1:
                sync[0] = stamp

    def message_facts(self, call_id: str) -> tuple[MessageFacts, ...] | None:
        """The facts of a recent call's request messages (None when not in memory)."""
        return self.recent.message_facts(call_id)

    async def verify(
        self,
        record: CallRecord,
        resolution: Resolution,
        linking_messages: list[dict[str, Any]],
        *,
        harness_note: str | None,
        retry_count: str | None,
        decode: Decoder | None,
        digests: RecordDigests | None = None,
        prefill: Mapping[str, Any] | None = None,
    ) -> CallRecord:
        """``record`` with the verdict, the digests and the diagnostics attached, and its
        parent set only when its tokens extend the parent's (``verify_step`` decides).
        ``digests``: ``RecordDigests(record, prefill)``, filled here, to hand to ``remember``;
        ``prefill``: the trailing assistant message the call continued. A retry that found no
        call to retry when it arrived looks again first (``late_retry.late_retry_step``)."""
        resolution = await self._drive(
            late_retry_step(
                resolution,
                rollout_id=record.rollout_id,
                call_id=record.call_id,
                ends_incomplete=self._known_to_end_incomplete,
            ),
            None,
        )
        parent = resolution.parent_call_id
        earlier = self.recent.digests(parent) if parent is not None else None
        if digests is not None and earlier is not None:
            digests.seed(earlier)  # (the prompt's blocks it shares with its parent's: not hashed)
        step = verify_step(
            record,
            resolution,
            linking_messages,
            harness_note=harness_note,
            retry_count=retry_count,
            can_decode=decode is not None,
            digests=digests,
            prefill=prefill,
        )
        return await self._drive(step, decode)

    async def _drive(self, step: Step[T], decode: Decoder | None) -> T:
        """Run a core step to its end, answering each command it asks."""
        try:
            command = next(step)
            while True:
                reply = await self._answer(command, decode)
                command = step.send(reply)
        except StopIteration as done:
            result: T = done.value
            return result

    async def _answer(self, command: Command[Any], decode: Decoder | None) -> Any:
        if isinstance(command, ReadParent):
            return await self.get_call(command.call_id)
        if isinstance(command, ReadParentCandidates):
            return await self.store.get_calls_by_child_digest(
                command.rollout_id, command.parent_digest
            )
        if isinstance(command, CatchUp):
            return await self._current_index(command.rollout_id)
        if isinstance(command, FindPrefixAncestor):
            index = await self._current_index(command.rollout_id)
            return index.prefix_ancestor(
                command.prompt_token_ids, model=command.model, exclude=command.exclude
            )
        if isinstance(command, AwaitAttempts):
            return await self._await_attempts(command.key)
        if isinstance(command, Detokenize) and decode is not None:
            return await _detokenize(command, decode)
        raise TypeError(f"no answer to {type(command).__name__}")

    async def _await_attempts(self, key: str) -> bool:
        """Wait, at most ``ATTEMPT_WAIT_S``, until no other worker has a call in flight with
        ``key``; whether one had."""
        attempts = self.attempts
        if attempts is None or not attempts.claimed_elsewhere(key):
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ATTEMPT_WAIT_S
        while attempts.claimed_elsewhere(key) and loop.time() < deadline:
            await asyncio.sleep(ATTEMPT_POLL_S)
        return True


async def _detokenize(
    command: Detokenize, decode: Decoder
) -> tuple[str | None, str | None, str | None] | None:
    try:
        parent_prompt, parent_full, child_prompt = await asyncio.gather(
            decode(command.parent_prompt),
            decode(command.parent_full),
            decode(command.child_prompt),
        )
    except Exception as exc:  # classification is best effort; the refusal stands
        log.warning("detokenize for mismatch classification failed: %s", exc)
        return None
    return parent_prompt, parent_full, child_prompt
