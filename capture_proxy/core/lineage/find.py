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

Here: the order of the rules (``find_lineage``) and rule 1. The indexes the rules look up:
``lineage.rollout``; rules 2 and 3: ``lineage.replay``; 4: ``lineage.spawn``; 5:
``lineage.compaction``.
"""

from __future__ import annotations

from collections.abc import Mapping

from capture_proxy.core.chains import RolloutChains
from capture_proxy.core.lineage.compaction import compacted
from capture_proxy.core.lineage.model import LineageEdge, LineageKind
from capture_proxy.core.lineage.replay import resumed
from capture_proxy.core.lineage.rollout import Rollout, order
from capture_proxy.core.lineage.rules import LineageRules
from capture_proxy.core.lineage.spawn import spawned
from capture_proxy.core.records import CallRecord


def _retried(rollout: Rollout, root: CallRecord) -> LineageEdge | None:
    earlier = root.retry_of
    if earlier is None or earlier not in rollout.chain_of:
        return None
    if rollout.chain_of[earlier] == rollout.chain_of[root.call_id]:
        return None
    evidence = {"rule": "retry_of"}
    return LineageEdge(LineageKind.RETRIED_FROM, rollout.chain_of[earlier], earlier, evidence)


def find_lineage(
    chains: RolloutChains, rules: LineageRules | None = None
) -> dict[str, list[LineageEdge]]:
    """The lineage edges into each chain's root, by chain id (chains without edges are left
    out). See the module docstring for the rules and their order."""
    rollout = Rollout(rules or LineageRules(), chains)
    rollout.index()
    out: dict[str, list[LineageEdge]] = {}
    for root in sorted((chain.calls[0] for chain in chains.chains), key=order):
        edges = [e for e in (_retried(rollout, root),) if e is not None]
        found = resumed(rollout, root) or spawned(rollout, root) or compacted(rollout, root)
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
