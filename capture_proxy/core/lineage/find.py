"""Finding the lineage edges of one rollout's chains (see ``capture_proxy.core.lineage``).

Only chain roots get edges (a call that is not a root already has a token parent). For each
root, in arrival order:

1. ``retried_from``: the root is recorded as a retry (``retry_of``) of a call of another chain.
2. ``resumed_after_interrupt``: the root's compared messages begin with the whole request of an
   earlier call of another chain, then, where that call's answer was, a harness's declared
   placeholder for a lost turn (``InterruptedTurn``: Claude Code's "No response requested."
   after ``--continue``), then more messages; the longest such request wins.
3. History replayed (only when 2 found nothing): the root's compared messages
   (``lineage.messages``) begin with the whole conversation of an earlier call of another
   chain: its request, then its answer (or, as a fork replays it, some of the answer's tool
   calls unchanged); the longest such prefix wins. After it: a harness's fork marker, or a
   branch the first chain did not take, is ``forked_from``; a new user message after the
   conversation of a chain's last call is ``resumed_from``; anything else (a tool result the
   link was refused for) ``forked_from``.
4. ``spawned_by`` (only when 2 and 3 found nothing): a text part of the root's first user
   message is the input of an earlier tool call of another chain: a declared sub-agent tool's
   prompt field, else any string argument of at least ``min_tool_input_chars``. Two roots with
   the same text (identical sub-agents) take the tool calls in order, one each.
5. ``compacted_from`` (only when 2 to 4 found nothing): the root carries the answer of a
   summary call of another chain: the body of a declared summary tag, the text after a
   declared summary prefix, the answer to a declared summary instruction, else (generic) a
   message whose whole text is an earlier answer of at least ``min_carried_chars``, else
   (generic) a message that holds a whole earlier answer of at least ``min_carried_chars``
   inside other text ("Summary of the earlier conversation: <answer>"); of several such
   calls, the latest before the root (a compaction follows its summary call). 64 characters
   (about 12 to 16 tokens of English) is longer than the short answers every session gives
   ("Done.", "All tests pass now."), so two unrelated sessions are not joined by one.

Sessions: when the root's request names a harness session (``sessions``), the calls of that
session are taken before those of another, by each rule among the calls it matches (the rule's
own order applies among them: longest history, tool calls in order, latest summary). The
kinds its harness always keeps in one session (``SessionField.edge_kinds``; Claude Code:
``spawned_by``, ``compacted_from``) never join two sessions; the others may, where no call of
the root's session matches (a session forked into a new one). A root that names the session
that spawned it (OpenCode's ``x-parent-session-id``) takes the kinds that come from there
(``SessionField.parent_edge_kinds``: ``spawned_by``) only from a call of that session. Calls
that name no session are ranked between the two, so harnesses that send none keep the rules
without sessions.

Cost: one hash per call for the answer index and one per call for the request index (by the
number of compared request messages and the last one's key), the compared messages of each
root hashed once, and a full request digest only for the calls whose length and last message
match a root's prefix; each call's session read once: linear in the rollout's messages.
Deterministic: the same records give the same edges in any order. Pure: no I/O.
"""

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
    text_parts,
    text_sha256,
    tool_calls,
)
from capture_proxy.core.lineage.model import LineageEdge, LineageKind
from capture_proxy.core.lineage.sessions import Rank, rank
from capture_proxy.core.records import CallRecord
from capture_proxy.core.sessions import Session, session_of
from harness_notes import ALL_LINEAGE
from harness_notes.lineage import (
    ForkMarker,
    InterruptedTurn,
    LineageDeclaration,
    SessionField,
    SpawnTool,
    SummaryPrefix,
    SummaryRequest,
    SummaryTags,
)

T = TypeVar("T")


@dataclass(frozen=True)
class LineageRules:
    """The harness declarations the rules use, and the generic rules' thresholds (chars)."""

    declarations: tuple[LineageDeclaration, ...] = ALL_LINEAGE
    min_tool_input_chars: int = 64
    min_carried_chars: int = 64

    _by_kind: dict[type, tuple[Any, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        """Raises ValueError for a ``SessionField`` naming an edge kind there is none of."""
        kinds = {k.value for k in LineageKind}
        for d in self.declarations:
            declared = d.edge_kinds | d.parent_edge_kinds if isinstance(d, SessionField) else set()
            if not declared <= kinds:
                unknown = sorted(declared - kinds)
                raise ValueError(f"{d.harness} session: no lineage edge kind {unknown[0]!r}")
            self._by_kind[type(d)] = (*self._by_kind.get(type(d), ()), d)

    def of(self, kind: type[Any]) -> tuple[Any, ...]:
        """The declarations of one kind (grouped once: this is asked per call)."""
        return self._by_kind.get(kind, ())


def _count_compared(
    messages: list[dict[str, Any]],
) -> tuple[int, Mapping[str, Any] | None]:
    """How many messages take part in the comparison, and the last of them."""
    skipped = sum(1 for m in messages if m.get("role") in SKIPPED_ROLES)
    for message in reversed(messages):
        if message.get("role") not in SKIPPED_ROLES:
            return len(messages) - skipped, message
    return 0, None


def _order(record: CallRecord) -> tuple[float, str]:
    return (record.created_at, record.call_id)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class _Rollout:
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
    #: an answer carried inside a longer message (``_carried_inside``)
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
        calls = sorted((c for ch in self.chains.chains for c in ch.calls), key=_order)
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
        return _best(ranked)

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
            if self.chain_of.get(c.call_id) not in (None, own) and _order(c) <= _order(root)
        ]


def _best(ranked: list[tuple[Rank | None, T]]) -> list[T]:
    """The items of the lowest rank (None: left out), in order."""
    ranks = [r for r, _ in ranked if r is not None]
    if not ranks:
        return []
    top = min(ranks)
    return [item for r, item in ranked if r == top]


def _same(call: CallRecord) -> CallRecord:
    return call


def _positions(root: CallRecord) -> list[int]:
    """The index in ``request_messages`` of each compared message (evidence names those)."""
    return [i for i, m in enumerate(root.request_messages) if m.get("role") not in SKIPPED_ROLES]


def _retried(rollout: _Rollout, root: CallRecord) -> LineageEdge | None:
    earlier = root.retry_of
    if earlier is None or earlier not in rollout.chain_of:
        return None
    if rollout.chain_of[earlier] == rollout.chain_of[root.call_id]:
        return None
    evidence = {"rule": "retry_of"}
    return LineageEdge(LineageKind.RETRIED_FROM, rollout.chain_of[earlier], earlier, evidence)


def _replay_kind(
    rollout: _Rollout,
    root: CallRecord,
    messages: list[Mapping[str, Any]],
    k: int,
    source: CallRecord,
) -> tuple[LineageKind, str, dict[str, Any]]:
    after = messages[k:]
    for marker in rollout.rules.of(ForkMarker):
        for i, message in enumerate(after):
            if marker.text in message_text(message):
                details = {"marker": marker.text, "message_index": _positions(root)[k + i]}
                return LineageKind.FORKED_FROM, f"{marker.harness}.fork_marker", details
    next_role = str(after[0].get("role")) if after else None
    details = {"next_role": next_role}
    if source.call_id in rollout.has_child:
        return LineageKind.FORKED_FROM, "generic.history_branch", details
    if next_role == "user":
        return LineageKind.RESUMED_FROM, "generic.history_replayed", details
    return LineageKind.FORKED_FROM, "generic.history_replayed", details


def _replays_answer(turn: Mapping[str, Any], answer: Mapping[str, Any]) -> bool:
    """``turn`` is ``answer`` as a harness replays it: the same compared message, or (a fork
    replaying only the tool call that started it) some of its tool calls, each unchanged."""
    if message_key(turn) == message_key(answer):
        return True
    if turn.get("role") != "assistant" or not turn.get("tool_calls"):
        return False
    own = {call_id: (name, args) for call_id, name, args in tool_calls(answer)}
    replayed = list(tool_calls(turn))
    return bool(replayed) and all(own.get(i) == (n, a) for i, n, a in replayed)


def _replayed(rollout: _Rollout, root: CallRecord) -> LineageEdge | None:
    messages = compared(root.request_messages)
    keys = [message_key(m) for m in messages]
    digests: list[bytes] | None = None
    # k: the replayed conversation is messages[:k], its last message an earlier call's answer
    for k in range(len(messages), 1, -1):
        if messages[k - 1].get("role") != "assistant":
            continue
        candidates = rollout.requests.get((k - 1, hashlib.sha256(keys[k - 2]).digest()))
        if not candidates:
            continue
        if digests is None:
            digests = prefix_digests(keys)
        found = []
        for source in rollout.earlier_other(candidates, root):
            answer = source.response_message
            if answer is None or rollout.request_digest(source) != digests[k - 2]:
                continue
            if not _replays_answer(messages[k - 1], answer):
                continue
            kind, rule, details = _replay_kind(rollout, root, messages, k, source)
            ranked = rollout.rank(kind, root, source)
            found.append((ranked, (source, kind, rule, details)))
            if ranked is Rank.SAME:
                break  # the first of the root's session: none after it ranks better
        chosen = _best(found)
        if not chosen:
            continue
        source, kind, rule, details = chosen[0]
        evidence = {
            "rule": rule,
            "num_messages": k,
            "common_prefix_tokens": _common_prefix(root.prompt_token_ids, source.full_token_ids()),
            **details,
            **rollout.session_evidence(root, source),
        }
        chain_id = rollout.chain_of[source.call_id]
        return LineageEdge(kind, chain_id, source.call_id, evidence)
    return None


def _resumed(rollout: _Rollout, root: CallRecord) -> LineageEdge | None:
    """The replay rules: a lost turn (``_interrupted``) or a replayed history (``_replayed``),
    whichever covers the longer head of the root's request (a lost call's request and its
    placeholder, against a conversation and its answer; the replayed one when they tie). A
    lost turn early in a session that went on is in the history of every later resume: the
    call the resume replays whole is the one it continues."""
    interrupted = _interrupted(rollout, root)
    replayed = _replayed(rollout, root)
    if interrupted is None:
        return replayed
    if replayed is not None and replayed.evidence["num_messages"] >= (
        interrupted.evidence["num_messages"] + 1
    ):
        return replayed
    return interrupted


def _interrupted(rollout: _Rollout, root: CallRecord) -> LineageEdge | None:
    """``resumed_after_interrupt``: the root replays the whole request of an earlier call of
    another chain, then a declared placeholder (``InterruptedTurn``) where its answer was, then
    more messages; the longest such request, of the calls with it the root's session's, the
    latest."""
    placeholders = {squash(d.text): d.harness for d in rollout.rules.of(InterruptedTurn)}
    if not placeholders:
        return None
    messages = compared(root.request_messages)
    digests: list[bytes] | None = None
    # k: the placeholder's index; messages[:k] the lost call's request, something after it
    for k in range(len(messages) - 2, 0, -1):
        message = messages[k]
        if message.get("role") != "assistant" or message.get("tool_calls"):
            continue
        text = squash(message_text(message))
        harness = placeholders.get(text)
        if harness is None:
            continue
        if digests is None:
            digests = prefix_digests([message_key(m) for m in messages])
        candidates = rollout.requests.get(
            (k, hashlib.sha256(message_key(messages[k - 1])).digest())
        )
        earlier = rollout.earlier_other(candidates or (), root)
        exact = [c for c in earlier if rollout.request_digest(c) == digests[k - 1]]
        found = rollout.best(LineageKind.RESUMED_AFTER_INTERRUPT, root, exact, _same)
        if not found:
            continue
        source = found[-1]
        evidence = {
            "rule": f"{harness}.interrupted_turn",
            "num_messages": k,
            "common_prefix_tokens": _common_prefix(root.prompt_token_ids, source.full_token_ids()),
            "marker": text,
            "message_index": _positions(root)[k],
            **rollout.session_evidence(root, source),
        }
        chain_id = rollout.chain_of[source.call_id]
        return LineageEdge(LineageKind.RESUMED_AFTER_INTERRUPT, chain_id, source.call_id, evidence)
    return None


def _first_user(messages: list[Mapping[str, Any]]) -> tuple[int, Mapping[str, Any]] | None:
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            return i, message
    return None


def _spawned(rollout: _Rollout, root: CallRecord) -> LineageEdge | None:
    first = _first_user(compared(root.request_messages))
    if first is None:
        return None
    index, message = _positions(root)[first[0]], first[1]
    for text in dict.fromkeys([squash(message_text(message)), *map(squash, text_parts(message))]):
        entries = rollout.tool_inputs.get(text) if text else None
        if not entries:
            continue
        allowed = {c.call_id for c in rollout.earlier_other((e[0] for e in entries), root)}
        entries = [e for e in entries if e[0].call_id in allowed]
        # the root's session's first (Claude Code's only: a sub-agent is its spawner's
        # session); OpenCode's: its parent session's only (a sub-agent has a session of its own)
        entries = rollout.best(LineageKind.SPAWNED_BY, root, entries, lambda e: e[0])
        if not entries:
            continue
        unused = [e for e in entries if (e[0].call_id, e[1]) not in rollout.used_spawns]
        call, tool_call_id, name, arg, rule = (unused or entries)[0]
        rollout.used_spawns.add((call.call_id, tool_call_id))
        evidence = {
            "rule": rule,
            "tool_name": name,
            "tool_call_id": tool_call_id,
            "field": arg,
            "message_index": index,
            "text_sha256": text_sha256(text),
            "num_chars": len(text),
            **rollout.session_evidence(root, call),
        }
        chain_id = rollout.chain_of[call.call_id]
        return LineageEdge(LineageKind.SPAWNED_BY, chain_id, call.call_id, evidence)
    return None


def _compaction_edge(
    rollout: _Rollout, root: CallRecord, source: CallRecord, rule: str, index: int, carried: str
) -> LineageEdge:
    chain_id = rollout.chain_of[source.call_id]
    evidence = {
        "rule": rule,
        "message_index": index,
        "text_sha256": text_sha256(carried),
        "num_chars": len(carried),
        "replaces_chain_id": chain_id,
        **rollout.session_evidence(root, source),
    }
    return LineageEdge(LineageKind.COMPACTED_FROM, chain_id, source.call_id, evidence)


def _latest_of_session(
    rollout: _Rollout, root: CallRecord, found: list[CallRecord]
) -> CallRecord | None:
    """Of ``found`` (in arrival order), the latest earlier call of another chain that ranks
    best by session as the origin of a compaction into ``root``."""
    best = rollout.best(LineageKind.COMPACTED_FROM, root, rollout.earlier_other(found, root), _same)
    return best[-1] if best else None


def _compacted(rollout: _Rollout, root: CallRecord) -> LineageEdge | None:
    messages = compared(root.request_messages)
    texts = [squash(message_text(m)) for m in messages]
    at = _positions(root)
    kind = LineageKind.COMPACTED_FROM
    # the latest summary before the root first (a compaction follows its summary call), of the
    # root's session first: the first one it carries of the best session rank
    matched: list[tuple[Rank | None, tuple[CallRecord, str, str, int]]] = []
    for source, carried, rule in reversed(rollout.summaries):
        ranked = rollout.rank(kind, root, source)
        if ranked is None or not rollout.earlier_other([source], root):
            continue
        users = (i for i, m in enumerate(messages) if m.get("role") == "user")
        hit = next((i for i in users if carried in texts[i]), None)
        if hit is None:
            continue
        matched.append((ranked, (source, carried, rule, hit)))
        if ranked is Rank.SAME:
            break  # the latest of the root's session: none after it ranks better
    chosen = _best(matched)
    if chosen:
        source, carried, rule, i = chosen[0]
        return _compaction_edge(rollout, root, source, rule, at[i], carried)
    prefixes = [(squash(d.prefix), d.harness) for d in rollout.rules.of(SummaryPrefix)]
    for i, text in enumerate(texts):
        for prefix, harness in prefixes:
            if text.startswith(prefix):
                carried = text[len(prefix) :].strip()
                found = _latest_of_session(
                    rollout, root, rollout.answers.get(text_sha256(carried), [])
                )
                if found is not None:
                    rule = f"{harness}.summary_prefix"
                    return _compaction_edge(rollout, root, found, rule, at[i], carried)
    for i, text in enumerate(texts):
        if len(text) < rollout.rules.min_carried_chars:
            continue
        found = _latest_of_session(rollout, root, rollout.answers.get(text_sha256(text), []))
        if found is not None:
            rule = "generic.answer_text_carried"
            return _compaction_edge(rollout, root, found, rule, at[i], text)
    for i, text in enumerate(texts):
        if messages[i].get("role") == "assistant":
            continue  # a summary is handed to the model, not written by it
        inside = _carried_inside(rollout, root, text)
        if inside is not None:
            source, carried = inside
            rule = "generic.answer_text_inside"
            return _compaction_edge(rollout, root, source, rule, at[i], carried)
    return None


def _carried_inside(
    rollout: _Rollout, root: CallRecord, text: str
) -> tuple[CallRecord, str] | None:
    """The latest earlier call of another chain whose whole answer (at least
    ``min_carried_chars``, squashed) appears inside ``text`` ("Summary of the earlier
    conversation: <answer>"), with that answer; at the first offset where one is, the best
    session rank, then the longest answer, then the latest.

    Cost: one dict lookup of a ``min_carried_chars`` slice per offset of ``text`` (the anchor
    index holds each answer's first characters), so O(len(text) * min_carried_chars) per
    message of a root that no other rule joined, whatever the number of calls in the rollout;
    a candidate is compared in full only when its first characters match."""
    width = rollout.rules.min_carried_chars
    anchors = rollout.answer_anchors
    for start in range(len(text) - width + 1):
        candidates = anchors.get(text[start : start + width])
        if not candidates:
            continue
        found = [(t, c) for t, c in candidates if text.startswith(t, start)]
        allowed = {c.call_id for c in rollout.earlier_other((c for _, c in found), root)}
        found = [(t, c) for t, c in found if c.call_id in allowed]
        found = rollout.best(LineageKind.COMPACTED_FROM, root, found, lambda o: o[1])
        if found:
            best = max(len(t) for t, _ in found)
            carried, source = [(t, c) for t, c in found if len(t) == best][-1]
            return source, carried
    return None


def find_lineage(
    chains: RolloutChains, rules: LineageRules | None = None
) -> dict[str, list[LineageEdge]]:
    """The lineage edges into each chain's root, by chain id (chains without edges are left
    out). See the module docstring for the rules and their order."""
    rollout = _Rollout(rules or LineageRules(), chains)
    rollout.index()
    out: dict[str, list[LineageEdge]] = {}
    for root in sorted((chain.calls[0] for chain in chains.chains), key=_order):
        edges = [e for e in (_retried(rollout, root),) if e is not None]
        found = _resumed(rollout, root) or _spawned(rollout, root) or _compacted(rollout, root)
        if found is not None:
            edges.append(found)
        if edges:
            out[root.call_id] = edges
    return out


def count_by_kind(lineage: Mapping[str, list[LineageEdge]]) -> dict[str, int]:
    """Edges counted by kind (every kind present, zero when none)."""
    counts = {kind.value: 0 for kind in LineageKind}
    for edges in lineage.values():
        for edge in edges:
            counts[edge.kind.value] += 1
    return counts
