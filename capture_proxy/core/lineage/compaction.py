"""The ``compacted_from`` rule of lineage (see ``capture_proxy.core.lineage.find``). Pure."""

from __future__ import annotations

from capture_proxy.core.lineage.messages import compared, message_text, squash, text_sha256
from capture_proxy.core.lineage.model import LineageEdge, LineageKind
from capture_proxy.core.lineage.rollout import Rollout, lowest_ranked, positions, same
from capture_proxy.core.lineage.sessions import Rank
from capture_proxy.core.records import CallRecord
from harness_notes.lineage import SummaryPrefix


def _compaction_edge(
    rollout: Rollout, root: CallRecord, source: CallRecord, rule: str, index: int, carried: str
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
    rollout: Rollout, root: CallRecord, found: list[CallRecord]
) -> CallRecord | None:
    """Of ``found`` (in arrival order), the latest earlier call of another chain that ranks
    best by session as the origin of a compaction into ``root``."""
    best = rollout.best(LineageKind.COMPACTED_FROM, root, rollout.earlier_other(found, root), same)
    return best[-1] if best else None


def compacted(rollout: Rollout, root: CallRecord) -> LineageEdge | None:
    messages = compared(root.request_messages)
    texts = [squash(message_text(m)) for m in messages]
    at = positions(root)
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
    chosen = lowest_ranked(matched)
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


def _carried_inside(rollout: Rollout, root: CallRecord, text: str) -> tuple[CallRecord, str] | None:
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
