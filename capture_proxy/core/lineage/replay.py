"""The replay rules of lineage: a lost turn (``resumed_after_interrupt``) or a replayed
history (``forked_from``, ``resumed_from``); see ``capture_proxy.core.lineage.find``. Pure."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from capture_proxy.core.lineage.messages import (
    compared,
    message_key,
    message_text,
    prefix_digests,
    squash,
    tool_calls,
)
from capture_proxy.core.lineage.model import LineageEdge, LineageKind
from capture_proxy.core.lineage.rollout import (
    Rollout,
    common_prefix,
    lowest_ranked,
    positions,
    same,
)
from capture_proxy.core.lineage.sessions import Rank
from capture_proxy.core.records import CallRecord
from harness_notes.lineage import ForkMarker, InterruptedTurn


def _replay_kind(
    rollout: Rollout,
    root: CallRecord,
    messages: list[Mapping[str, Any]],
    k: int,
    source: CallRecord,
) -> tuple[LineageKind, str, dict[str, Any]]:
    after = messages[k:]
    for marker in rollout.rules.of(ForkMarker):
        for i, message in enumerate(after):
            if marker.text in message_text(message):
                details = {"marker": marker.text, "message_index": positions(root)[k + i]}
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


def _replayed(rollout: Rollout, root: CallRecord) -> LineageEdge | None:
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
        chosen = lowest_ranked(found)
        if not chosen:
            continue
        source, kind, rule, details = chosen[0]
        evidence = {
            "rule": rule,
            "num_messages": k,
            "common_prefix_tokens": common_prefix(root.prompt_token_ids, source.full_token_ids()),
            **details,
            **rollout.session_evidence(root, source),
        }
        chain_id = rollout.chain_of[source.call_id]
        return LineageEdge(kind, chain_id, source.call_id, evidence)
    return None


def resumed(rollout: Rollout, root: CallRecord) -> LineageEdge | None:
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


def _interrupted(rollout: Rollout, root: CallRecord) -> LineageEdge | None:
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
        found = rollout.best(LineageKind.RESUMED_AFTER_INTERRUPT, root, exact, same)
        if not found:
            continue
        source = found[-1]
        evidence = {
            "rule": f"{harness}.interrupted_turn",
            "num_messages": k,
            "common_prefix_tokens": common_prefix(root.prompt_token_ids, source.full_token_ids()),
            "marker": text,
            "message_index": positions(root)[k],
            **rollout.session_evidence(root, source),
        }
        chain_id = rollout.chain_of[source.call_id]
        return LineageEdge(LineageKind.RESUMED_AFTER_INTERRUPT, chain_id, source.call_id, evidence)
    return None
