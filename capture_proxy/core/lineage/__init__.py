"""Lineage: typed edges between the chains of one rollout (an agent's episode).

A token link (``parent_call_id``) joins two calls only when the child's prompt tokens extend
the parent's; lineage joins whole chains for the reasons a harness starts one conversation
from another: a sub-agent handed its task by a tool call (``spawned_by``), a fork that replays
part of a history (``forked_from``), a conversation rebuilt from a summary (``compacted_from``),
a stored session replayed (``resumed_from``), an episode retried (``retried_from``). Each edge
names the call it comes from and the evidence that matched (which text, which span).

Pure and read-time: edges are found from the captured records of a rollout (no stored state,
no I/O), deterministically, in time linear in the rollout's messages.
"""

from capture_proxy.core.lineage.find import find_lineage
from capture_proxy.core.lineage.model import LineageEdge, LineageKind
from capture_proxy.core.lineage.rules import LineageRules

__all__ = ["LineageEdge", "LineageKind", "LineageRules", "find_lineage"]
