"""Request-time parent resolution and response-time verification, over the store.

Owns the per-rollout ``LinkIndex`` cache (filled lazily from the store the first time a rollout
is seen by this process, so a restart loses nothing; with a shared store, written by other
replicas too, refreshed from the store when a digest misses), the calls stored lately
(``RecentCalls``: a parent is read from memory, not decoded from the store, see ``get_call``;
stored records never change, so this holds with replicas too) and the fail-closed verification
of a resolved link against the parent's stored tokens. The decisions are the core's
(``capture_proxy.core.linking``); this module fetches what they need: the parent record, and on
a mismatch the detokenised texts from the engine's ``/detokenize`` for the classification.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from capture_proxy.core.known_messages import KnownMessages, MessageFacts, turn_payloads
from capture_proxy.core.linking import (
    HISTORY_EDITED_REASON,
    IN_FLIGHT,
    MODEL_SCOPE_REASON,
    NO_MATCH_REASON,
    TOOL_CALL_IDS_REASON,
    TURN_REWRITTEN_REASON,
    Candidate,
    DecodedTexts,
    LinkIndex,
    Resolution,
    Verdict,
    child_digest,
    child_digest_after,
    classify_mismatch,
    extends_by_digest,
    history_digest,
    linking_items,
    request_digest,
)
from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic, DiagnosticKind
from capture_proxy.core.routed_experts import rows_end
from capture_proxy.core.splice import SpliceRefused, check_extension
from capture_proxy.core.stored_form import token_digest
from capture_proxy.proxy.recent import DEFAULT_MAX_BYTES, RecentCalls
from capture_proxy.store.base import CaptureStore

log = logging.getLogger("capture_proxy")

#: ``decode(token_ids) -> text``; None when decoding is not possible.
Decoder = Callable[[list[int]], Awaitable[str | None]]


def _token_key(record: CallRecord) -> dict[str, Any]:
    """Length and digest of a complete call's prompt + generation (for digest verification)."""
    if record.status is not CallStatus.COMPLETE or record.num_generation_tokens == 0:
        return {}
    return {
        "num_tokens": record.num_prompt_tokens + record.num_generation_tokens,
        "tokens_sha256": token_digest(record.prompt_token_ids, record.generation_token_ids),
    }


def _history_unchanged(parent: CallRecord, linking_messages: list[dict[str, Any]]) -> bool:
    """True when the child's history is the parent's request as the engine got it, its
    answer, then new messages: compared canonically, so a token difference inside the parent's
    prompt is the template's doing, not the harness's. (A parent whose rewritten harness note
    is gone from the child's history does not count as unchanged: the note was in its
    prompt.)"""
    try:
        check_extension(parent.request_messages, linking_messages)
    except SpliceRefused:
        return False
    return True


class Linker:
    """One per proxy process. ``refuse_note_parents``: ``parent_resolution = source_history``."""

    def __init__(
        self,
        store: CaptureStore,
        *,
        refuse_note_parents: bool = False,
        max_rollouts: int = 10_000,
        refresh_on_miss: bool = False,
        recent_max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.store = store
        self.refuse_note_parents = refuse_note_parents
        #: another process may have written calls of a cached rollout (replicas on a shared
        #: store, a rollout moved between them): a digest miss reloads the index first
        self.refresh_on_miss = refresh_on_miss
        #: most recently used rollouts' indexes; older ones are reloaded from the store when
        #: needed again, so memory stays bounded however many rollouts a process serves
        self.max_rollouts = max_rollouts
        self._indexes: OrderedDict[str, LinkIndex] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        #: the records this process stored lately (the parents of the next calls)
        self.recent = RecentCalls(recent_max_bytes)
        #: facts of the messages of the requests this process saw lately
        self.known_messages = KnownMessages()

    async def _index(self, rollout_id: str) -> LinkIndex:
        index = self._indexes.get(rollout_id)
        if index is not None:
            self._indexes.move_to_end(rollout_id)
            return index
        lock = self._locks.setdefault(rollout_id, asyncio.Lock())
        async with lock:
            index = self._indexes.get(rollout_id)
            if index is None:
                index = LinkIndex()
                for record in await self.store.get_rollout_calls(rollout_id):
                    self._add(index, record)
                self._indexes[rollout_id] = index
                self._evict()
        return index

    async def _refresh(self, rollout_id: str, index: LinkIndex) -> None:
        """Add the stored calls of the rollout this index does not hold as stored (written
        by another replica since it was loaded), in stored order."""
        for record in await self.store.get_rollout_calls(rollout_id):
            entry = index.entries.get(record.call_id)
            if entry is None or entry.status == IN_FLIGHT:
                self._add(index, record)

    def _evict(self) -> None:
        while len(self._indexes) > self.max_rollouts:
            old, _ = self._indexes.popitem(last=False)
            lock = self._locks.get(old)
            if lock is not None and not lock.locked():
                del self._locks[old]

    def has_calls(self, rollout_id: str) -> bool:
        """True when this process has seen a call of the rollout (stored or in flight) and
        still holds its index."""
        index = self._indexes.get(rollout_id)
        return index is not None and bool(index.entries)

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout's index and recent calls (it was deleted)."""
        self._indexes.pop(rollout_id, None)
        self._locks.pop(rollout_id, None)
        self.recent.forget(rollout_id)

    async def get_call(self, call_id: str) -> CallRecord | None:
        """A stored call, as ``store.get_call`` answers it: from the recent calls when this
        process stored it lately (read-only, like the store's records), else from the store."""
        record = self.recent.get(call_id)
        return record if record is not None else await self.store.get_call(call_id)

    @staticmethod
    def _add(index: LinkIndex, record: CallRecord) -> None:
        linking = record.linking or {}
        child = linking.get("child_digest")
        response = record.response_message if record.status is not CallStatus.FAILED else None
        if child is None and response is not None:
            child = child_digest(record.request_messages, response)
        index.add(
            record.call_id,
            record.created_at,
            # A failed call has no answer to continue from; it is indexed for its request
            # only (a later identical request retries it).
            child_digest=child if response is not None else None,
            request_digest=linking.get("request_digest"),
            harness_note=bool(linking.get("harness_note")),
            rows_end=rows_end(record),
            model=record.model,
            status=record.status.value,
            response=response,
            parent_call_id=record.parent_call_id,
            retry_of=record.retry_of,
            **_token_key(record),
        )

    async def resolve(
        self,
        rollout_id: str,
        linking_messages: list[dict[str, Any]],
        body: dict[str, Any],
        *,
        call_id: str,
        created_at: float,
        retry_requested: bool = False,
        linking_facts: Sequence[MessageFacts] | None = None,
    ) -> Resolution:
        """Request-time verdict for a call (before it is forwarded). The call's request digest
        is registered at once (in flight), so a later identical request is known; it is this
        call's retry only on an explicit signal (``retry_requested``: the harness's retry
        header; or this call failed or was left incomplete), else a sibling sample.
        ``linking_facts``: the ``known_messages`` facts of ``linking_messages``."""
        index = await self._index(rollout_id)
        req_digest = request_digest(body)
        items = linking_items(linking_messages)
        model = body.get("model")
        payloads = turn_payloads(linking_facts) if linking_facts is not None else None
        parent_digest = history_digest(linking_messages, payloads)

        def resolve() -> Resolution:
            return index.resolve(
                parent_digest,
                req_digest,
                model=model,
                last_turn=items[-1] if items else None,
                retry_requested=retry_requested,
                refuse_note_parents=self.refuse_note_parents,
            )

        resolution = resolve()
        if (
            self.refresh_on_miss
            and resolution.verdict is Verdict.UNRESOLVED
            and parent_digest is not None
        ):
            await self._refresh(rollout_id, index)
            resolution = resolve()
        index.add(call_id, created_at, child_digest=None, request_digest=req_digest, model=model)
        return resolution

    async def remember(
        self, record: CallRecord, message_facts: Sequence[MessageFacts] | None = None
    ) -> None:
        """Make a persisted call findable by its children (by digest, and its record in
        memory, with the facts of its request messages)."""
        self._add(await self._index(record.rollout_id), record)
        self.recent.put(record, message_facts)

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
    ) -> CallRecord:
        """Attach the verdict, the digests and the diagnostics to ``record``; set its parent
        only when the parent's prompt + generation ids are a prefix of its prompt ids: the
        first digest candidate that verifies, else (refused or unmatched) the deepest
        token-exact ancestor of the same model (verdict ``prefix``), else none."""
        diagnostics = list(record.diagnostics)
        verdict, reason, parent_call_id = resolution.verdict, resolution.reason, None
        if harness_note is not None:
            diagnostics.append(
                Diagnostic(DiagnosticKind.HARNESS_NOTE_REWRITTEN, {"note": harness_note})
            )
        if resolution.retry_of is not None:
            details: dict[str, Any] = {"retry_of": resolution.retry_of}
            if retry_count is not None:
                details["retry_count_header"] = retry_count
            diagnostics.append(Diagnostic(DiagnosticKind.RETRY, details))
        if reason == NO_MATCH_REASON:
            diagnostics.append(Diagnostic(DiagnosticKind.FOREIGN_TURN, {"reason": reason}))
        elif reason is not None and reason.startswith(MODEL_SCOPE_REASON):
            diagnostics.append(Diagnostic(DiagnosticKind.PARENT_MODEL_MISMATCH, {"reason": reason}))
        elif resolution.mismatch is not None:
            diagnostics.append(
                Diagnostic(DiagnosticKind.PARENT_DIGEST_MISMATCH, dict(resolution.mismatch))
            )
        if reason == TURN_REWRITTEN_REASON:
            diagnostics.append(
                Diagnostic(
                    DiagnosticKind.TURN_REWRITTEN,
                    {"parent_call_id": resolution.parent_call_id, "reason": reason},
                )
            )
        if verdict is Verdict.RESOLVED:
            assert resolution.parent_call_id is not None
            verified = self._verified_by_digest(record, resolution.candidates)
            if verified is not None:
                # The common case, without reading the parent: the digest of the child's
                # prompt head equals the digest of a candidate's prompt + generation.
                parent_call_id, reason = verified, None
            else:
                verdict, reason, parent_call_id, mismatch = await self._check_tokens(
                    record, resolution.parent_call_id, linking_messages, decode
                )
                if mismatch is not None:
                    diagnostics.append(Diagnostic(DiagnosticKind.PARENT_DIGEST_MISMATCH, mismatch))
        if parent_call_id is None and self._may_prefix_link(verdict, reason, record):
            index = await self._index(record.rollout_id)
            ancestor = index.prefix_ancestor(
                record.prompt_token_ids, model=record.model, exclude=record.call_id
            )
            if ancestor is not None:
                reason = f"{verdict.value}: {reason}; linked to its deepest token-exact ancestor"
                verdict, parent_call_id = Verdict.PREFIX, ancestor
        if (
            parent_call_id != resolution.parent_call_id
            and resolution.parent_call_id is not None
            and record.routed_experts_start > 0
        ):
            # Rows were asked for from the digest parent's end on; without that link the rows
            # before it are missing.
            diagnostics.append(
                Diagnostic(
                    DiagnosticKind.ROUTED_EXPERTS_MISMATCH,
                    {
                        "reason": "the digest parent's link was not taken: rows before "
                        "routed_experts_start were not asked for",
                        "routed_experts_start": record.routed_experts_start,
                    },
                )
            )
        linking = {
            "verdict": verdict.value,
            "parent_digest": resolution.parent_digest,
            "child_digest": self._child_digest(resolution, linking_messages, record),
            "request_digest": resolution.request_digest,
            "digest_parent_call_id": resolution.parent_call_id,
            "reason": reason,
            "harness_note": harness_note,
        }
        return record.replace(
            parent_call_id=parent_call_id,
            linking=linking,
            retry_of=resolution.retry_of,
            diagnostics=diagnostics,
        )

    @staticmethod
    def _verified_by_digest(record: CallRecord, candidates: tuple[Candidate, ...]) -> str | None:
        """The first candidate whose prompt + generation the record's prompt begins with,
        checked by digest (candidates without complete token data are skipped)."""
        if record.status is not CallStatus.COMPLETE:
            return None
        for candidate in candidates:
            if (
                candidate.num_tokens is not None
                and candidate.tokens_sha256 is not None
                and extends_by_digest(
                    record.prompt_token_ids, candidate.num_tokens, candidate.tokens_sha256
                )
            ):
                return candidate.call_id
        return None

    @staticmethod
    def _may_prefix_link(verdict: Verdict, reason: str | None, record: CallRecord) -> bool:
        """A refused link, or a history no call matched for a named reason (not the
        source_history refusal of a note parent, which asks for a new chain)."""
        if record.status is not CallStatus.COMPLETE:
            return False
        if verdict is Verdict.REFUSED:
            return True
        return (
            verdict is Verdict.UNRESOLVED
            and reason is not None
            and (
                reason in (NO_MATCH_REASON, HISTORY_EDITED_REASON, TOOL_CALL_IDS_REASON)
                or reason.startswith(MODEL_SCOPE_REASON)
            )
        )

    @staticmethod
    def _child_digest(
        resolution: Resolution, linking_messages: list[dict[str, Any]], record: CallRecord
    ) -> str | None:
        if record.response_message is None:
            return None
        if resolution.parent_digest is not None or not linking_items(linking_messages):
            # The request's own digest (history_digest of these messages): one more step.
            return child_digest_after(resolution.parent_digest, record.response_message)
        # Resolution failed before digesting the history: digest it now.
        return child_digest(linking_messages, record.response_message)

    async def _check_tokens(
        self,
        record: CallRecord,
        parent_id: str,
        linking_messages: list[dict[str, Any]],
        decode: Decoder | None,
    ) -> tuple[Verdict, str | None, str | None, dict[str, Any] | None]:
        """(verdict, reason, verified parent id, mismatch details)."""
        if record.status is not CallStatus.COMPLETE:
            return Verdict.UNRESOLVED, "call has no complete token data to verify", None, None
        parent = await self.get_call(parent_id)
        if parent is None or parent.status is not CallStatus.COMPLETE:
            return (
                Verdict.REFUSED,
                "parent has no complete token data",
                None,
                {
                    "parent_call_id": parent_id,
                    "reason": "parent incomplete",
                },
            )
        unchanged = _history_unchanged(parent, linking_messages)
        mismatch = classify_mismatch(
            parent.prompt_token_ids,
            parent.generation_token_ids,
            record.prompt_token_ids,
            history_unchanged=unchanged,
        )
        if mismatch is None:
            return Verdict.RESOLVED, None, parent_id, None
        texts = await self._texts(parent, record, decode) if decode is not None else None
        if texts is not None:
            reasoning = (parent.response_message or {}).get("reasoning_content") or (
                parent.response_message or {}
            ).get("reasoning")
            mismatch = classify_mismatch(
                parent.prompt_token_ids,
                parent.generation_token_ids,
                record.prompt_token_ids,
                texts=texts,
                parent_reasoning=reasoning,
                history_unchanged=unchanged,
            )
            assert mismatch is not None
        details = {
            "parent_call_id": parent_id,
            "position": mismatch.position,
            "class": mismatch.mismatch_class.value,
            "explanation": mismatch.explanation,
            "classified_with_text": texts is not None,
        }
        return (
            Verdict.REFUSED,
            f"tokens do not chain ({mismatch.mismatch_class.value})",
            None,
            details,
        )

    @staticmethod
    async def _texts(parent: CallRecord, child: CallRecord, decode: Decoder) -> DecodedTexts | None:
        try:
            parts = await asyncio.gather(
                decode(parent.prompt_token_ids.tolist()),
                decode(parent.full_token_ids().tolist()),
                decode(child.prompt_token_ids.tolist()),
            )
        except Exception as exc:  # classification is best effort; the refusal stands
            log.warning("detokenize for mismatch classification failed: %s", exc)
            return None
        if any(p is None for p in parts):
            return None
        return DecodedTexts(*parts)  # type: ignore[arg-type]
