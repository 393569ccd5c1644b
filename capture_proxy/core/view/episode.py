"""A rollout's episode for the viewer: its chains joined by lineage edges, as an outline.

Pure. Each chain is one row; a chain that a lineage edge leads into (``core.lineage``) is drawn
under the chain the edge comes from, with the edge's kind and the call it starts at (its
arrival number, ``#3``); chains without an edge are top-level, in chain order. A chain with
several edges is drawn under the first (``find_lineage`` orders them: a retry, then the
history, sub-agent or compaction edge) and lists the others. ``guides`` are box-drawing cells,
as in ``core.view.call_tree``.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_proxy.core.chains import RolloutChains
from capture_proxy.core.lineage import LineageEdge
from capture_proxy.core.records import CallRecord


@dataclass(frozen=True)
class EpisodeEdge:
    """One lineage edge into a chain, with the arrival number of the call it starts at."""

    kind: str
    chain_id: str
    from_call_id: str
    from_number: int | None
    rule: str | None


@dataclass(frozen=True)
class EpisodeRow:
    """One chain of the episode: its root, size, depth in the outline and edges in."""

    chain_id: str
    root_number: int | None
    num_calls: int
    num_generation_tokens: int
    depth: int
    guides: tuple[str, ...]
    edges: tuple[EpisodeEdge, ...]


def _numbers(records: list[CallRecord]) -> dict[str, int]:
    order = sorted(records, key=lambda r: (r.created_at, r.call_id))
    return {r.call_id: i for i, r in enumerate(order, 1)}


def episode_rows(
    records: list[CallRecord], chains: RolloutChains, lineage: dict[str, list[LineageEdge]]
) -> list[EpisodeRow]:
    """The episode outline (see the module docstring); [] for a rollout without chains."""
    numbers = _numbers(records)
    known = {c.chain_id for c in chains.chains}
    parent = {
        chain_id: edges[0].chain_id
        for chain_id, edges in lineage.items()
        if edges and edges[0].chain_id in known and edges[0].chain_id != chain_id
    }
    children: dict[str | None, list[str]] = {}
    for chain in chains.chains:
        children.setdefault(parent.get(chain.chain_id), []).append(chain.chain_id)
    by_id = {c.chain_id: c for c in chains.chains}
    rows: list[EpisodeRow] = []
    seen: set[str] = set()

    def walk(chain_id: str, depth: int, guides: tuple[str, ...], last: bool) -> None:
        if chain_id in seen:  # a cycle of edges, which the rules do not make
            return
        seen.add(chain_id)
        chain = by_id[chain_id]
        edges = tuple(
            EpisodeEdge(
                e.kind.value,
                e.chain_id,
                e.from_call_id,
                numbers.get(e.from_call_id),
                e.evidence.get("rule"),
            )
            for e in lineage.get(chain_id, [])
        )
        cells = guides + (("└─" if last else "├─"),) if depth else ()
        rows.append(
            EpisodeRow(
                chain_id,
                numbers.get(chain_id),
                len(chain.calls),
                sum(c.num_generation_tokens for c in chain.calls),
                depth,
                cells,
                edges,
            )
        )
        kids = children.get(chain_id, [])
        below = guides + (("  " if last else "│ "),) if depth else ()
        for i, kid in enumerate(kids):
            walk(kid, depth + 1, below, i == len(kids) - 1)

    for chain_id in children.get(None, []):
        walk(chain_id, 0, (), True)
    for chain in chains.chains:  # under a cycle: drawn top-level rather than lost
        if chain.chain_id not in seen:
            walk(chain.chain_id, 0, (), True)
    return rows
