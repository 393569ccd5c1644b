"""The indexes of one rollout's calls that the lineage rules look up, and the helpers the
rules share (see ``capture_proxy.core.lineage.find``). Pure."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from capture_proxy.core.chains import RolloutChains
from capture_proxy.core.lineage.messages import (
    SKIPPED_ROLES,
    compared,
    message_key,
    message_text,
    prefix_digests,
    squash,
    text_sha256,
    tool_calls,
)
from capture_proxy.core.lineage.model import LineageKind
from capture_proxy.core.lineage.rules import LineageRules
from capture_proxy.core.lineage.sessions import Rank, rank
from capture_proxy.core.records import CallRecord
from capture_proxy.core.sessions import Session, session_of
from harness_notes.lineage import SessionField, SpawnTool, SummaryRequest, SummaryTags

T = TypeVar("T")


def _count_compared(
    messages: list[dict[str, Any]],
) -> tuple[int, Mapping[str, Any] | None]:
    """How many messages take part in the comparison, and the last of them."""
    skipped = sum(1 for m in messages if m.get("role") in SKIPPED_ROLES)
    for message in reversed(messages):
        if message.get("role") not in SKIPPED_ROLES:
            return len(messages) - skipped, message
    return 0, None


def order(record: CallRecord) -> tuple[float, str]:
    return (record.created_at, record.call_id)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class Rollout:
    """The indexes of one rollout's calls that the rules look up."""

    rules: LineageRules
    chains: RolloutChains
    chain_of: dict[str, str] = field(default_factory=dict)
    has_child: set[str] = field(default_factory=set)
    #: (number of compared request messages, sha256 of the last one's key) -> calls
    requests: dict[tuple[int, bytes], list[CallRecord]] = field(default_factory=dict)
    #: sha256 of an answer's squashed text -> calls
    answers: dict[str, list[CallRecord]] = field(default_factory=dict)
    #: an answer's first ``min_carried_chars`` squashed characters -> (its text, call), for
    #: an answer carried inside a longer message (``compaction._carried_inside``)
    answer_anchors: dict[str, list[tuple[str, CallRecord]]] = field(default_factory=dict)
    #: squashed tool input text -> (call, tool_call_id, tool name, field, rule)
    tool_inputs: dict[str, list[tuple[CallRecord, str, str, str, str]]] = field(
        default_factory=dict
    )
    summaries: list[tuple[CallRecord, str, str]] = field(default_factory=list)
    used_spawns: set[tuple[str, str]] = field(default_factory=set)
    _request: dict[str, bytes] = field(default_factory=dict)
    _sessions: dict[str, Session | None] = field(default_factory=dict)

    def index(self) -> None:
        for chain in self.chains.chains:
            for call in chain.calls:
                self.chain_of[call.call_id] = chain.chain_id
            self.has_child.update(p for p in chain.parent_of.values() if p is not None)
        calls = sorted((c for ch in self.chains.chains for c in ch.calls), key=order)
        spawn_fields = {(d.tool_name, d.prompt_field): d.harness for d in self.rules.of(SpawnTool)}
        for call in calls:
            answer = call.response_message
            if answer is None:
                continue
            n, last = _count_compared(call.request_messages)
            if last is not None:
                key = hashlib.sha256(message_key(last)).digest()
                self.requests.setdefault((n, key), []).append(call)
            text = squash(message_text(answer))
            if len(text) >= self.rules.min_carried_chars:
                self.answers.setdefault(text_sha256(text), []).append(call)
                anchor = text[: self.rules.min_carried_chars]
                self.answer_anchors.setdefault(anchor, []).append((text, call))
            self._index_tool_inputs(call, answer, spawn_fields)
            self._index_summary(call, answer, text, last)

    def _index_tool_inputs(
        self, call: CallRecord, answer: Mapping[str, Any], spawn_fields: dict[tuple[str, str], str]
    ) -> None:
        for tool_call_id, name, args in tool_calls(answer):
            if not isinstance(args, Mapping):
                continue
            for arg, value in args.items():
                if not isinstance(value, str):
                    continue
                harness = spawn_fields.get((name, str(arg)))
                text = squash(value)
                if harness is not None:
                    rule = f"{harness}.spawn_tool"
                elif len(text) >= self.rules.min_tool_input_chars:
                    rule = "generic.tool_input_text"
                else:
                    continue
                entry = (call, tool_call_id, name, str(arg), rule)
                self.tool_inputs.setdefault(text, []).append(entry)

    def _index_summary(
        self,
        call: CallRecord,
        answer: Mapping[str, Any],
        text: str,
        asked: Mapping[str, Any] | None,
    ) -> None:
        """``asked``: the call's last compared request message."""
        raw = message_text(answer)
        for tags in self.rules.of(SummaryTags):
            start, end = raw.find(tags.open_tag), raw.rfind(tags.close_tag)
            if start >= 0 and end > start:
                body = squash(raw[start + len(tags.open_tag) : end])
                if body:
                    self.summaries.append((call, body, f"{tags.harness}.summary_tags"))
        last = squash(message_text(asked)) if asked is not None else ""
        for request in self.rules.of(SummaryRequest):
            if text and squash(request.instruction) in last:
                self.summaries.append((call, text, f"{request.harness}.summary_request"))

    def request_digest(self, call: CallRecord) -> bytes:
        """The chained digest of a call's compared request messages (computed once)."""
        digest = self._request.get(call.call_id)
        if digest is None:
            keys = [message_key(m) for m in compared(call.request_messages)]
            digest = prefix_digests(keys)[-1]
            self._request[call.call_id] = digest
        return digest

    def session(self, call: CallRecord) -> Session | None:
        """The harness session ``call``'s request names (read once)."""
        if call.call_id not in self._sessions:
            fields = self.rules.of(SessionField)
            self._sessions[call.call_id] = session_of(
                call.request_received, fields, headers=call.session_headers
            )
        return self._sessions[call.call_id]

    def rank(self, kind: LineageKind, root: CallRecord, source: CallRecord) -> Rank | None:
        """``sessions.rank`` of ``source`` as the origin of an edge of ``kind`` into ``root``."""
        return rank(kind.value, self.session(root), self.session(source))

    def best(
        self,
        kind: LineageKind,
        root: CallRecord,
        options: Iterable[T],
        source: Callable[[T], CallRecord],
    ) -> list[T]:
        """The ``options`` (in the rule's order) whose source call (``source(option)``) ranks
        best by session as the origin of an edge of ``kind`` into ``root``: the root's
        session's, else those naming none, else another session's where ``kind`` may join
        two; empty when none may be the origin."""
        ranked = [(self.rank(kind, root, source(o)), o) for o in options]
        return lowest_ranked(ranked)

    def session_evidence(self, root: CallRecord, source: CallRecord) -> dict[str, str]:
        """``{"session": id}`` when both calls name that session, ``{"parent_session": id}``
        when ``source`` names the session ``root`` names as the one that spawned it, else
        nothing."""
        mine, theirs = self.session(root), self.session(source)
        if mine is None or theirs is None:
            return {}
        if mine.key == theirs.key:
            return {"session": mine.session_id}
        if mine.parent_key == theirs.key:
            return {"parent_session": theirs.session_id}
        return {}

    def earlier_other(self, calls: Iterable[CallRecord], root: CallRecord) -> list[CallRecord]:
        """The calls, of another chain than ``root``'s, received no later than it."""
        own = self.chain_of[root.call_id]
        return [
            c
            for c in calls
            if self.chain_of.get(c.call_id) not in (None, own) and order(c) <= order(root)
        ]


def lowest_ranked(ranked: list[tuple[Rank | None, T]]) -> list[T]:
    """The items of the lowest rank (None: left out), in order."""
    ranks = [r for r, _ in ranked if r is not None]
    if not ranks:
        return []
    top = min(ranks)
    return [item for r, item in ranked if r == top]


def same(call: CallRecord) -> CallRecord:
    return call


def positions(root: CallRecord) -> list[int]:
    """The index in ``request_messages`` of each compared message (evidence names those)."""
    return [i for i, m in enumerate(root.request_messages) if m.get("role") not in SKIPPED_ROLES]
