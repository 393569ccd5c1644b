"""A rollout's chains laid out as a tree: one row per call, with the guides that draw it.

Pure. Rows come chain by chain (root first, then depth-first, as ``build_chains`` orders
calls); superseded retries are drawn as dimmed siblings just before the member that superseded
them (they are never branches); calls outside every chain (incomplete, failed) are listed
apart. Marks per row: the verdict, a refused link with its class, first differing position and
the digest parent it was refused from, ``retry of``, branch points, and membership of the main
chain (the chain with the most generated tokens, as the summary's ``main_chain_id``).

``guides`` are the box-drawing cells left of a row (``│ ``, ``├─``, ``└─``, two spaces), as
``tree(1)`` draws them, so a template renders the tree without computing anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_proxy.core.chains import build_chains
from capture_proxy.core.records import CallRecord, DiagnosticKind
from capture_proxy.core.summary import link_stats


@dataclass(frozen=True)
class RefusedLink:
    """A digest-resolved parent whose tokens the call does not extend (link refused)."""

    parent_call_id: str
    parent_number: int | None
    mismatch_class: str
    position: int | None


@dataclass(frozen=True)
class TreeRow:
    """One call in the tree. ``number``: 1-based position of the call in the rollout by
    arrival (``#3``). ``num_new_prompt_tokens``: prompt tokens after the parent's prompt +
    generation (the whole prompt for a root)."""

    call_id: str
    number: int
    chain_id: str | None
    depth: int
    guides: tuple[str, ...]
    parent_call_id: str | None
    status: str
    verdict: str | None
    refused: RefusedLink | None
    retry_of_number: int | None
    superseded_by_number: int | None
    is_main: bool
    is_chain_start: bool
    num_children: int
    latency_ms: float | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_new_prompt_tokens: int
    num_generation_tokens: int
    has_routed_experts: bool
    diagnostic_kinds: tuple[str, ...]

    @property
    def is_branch_point(self) -> bool:
        return self.num_children > 1


@dataclass(frozen=True)
class RolloutTree:
    rollout_id: str
    rows: list[TreeRow]
    unlinked: list[TreeRow]
    main_chain_id: str | None
    num_chains: int
    num_branches: int
    num_refused: int
    num_retries: int


def refused_link(record: CallRecord, numbers: dict[str, int]) -> RefusedLink | None:
    """The refused link of ``record`` (its ``parent_digest_mismatch``), or None."""
    for d in record.diagnostics:
        if d.kind == DiagnosticKind.PARENT_DIGEST_MISMATCH:
            parent = str(d.details.get("parent_call_id") or "")
            if not parent and record.linking:
                parent = str(record.linking.get("digest_parent_call_id") or "")
            position = d.details.get("position")
            return RefusedLink(
                parent_call_id=parent,
                parent_number=numbers.get(parent),
                mismatch_class=str(d.details.get("class", d.details.get("reason", "unknown"))),
                position=position if isinstance(position, int) else None,
            )
    return None


class _Drawing:
    """One rollout's records and chains, and the rows drawn from them so far."""

    def __init__(self, rollout_id: str, records: list[CallRecord]) -> None:
        self.chains = chains = build_chains(rollout_id, records)
        self.main = link_stats(records, chains)["main_chain_id"]
        self.by_id = {r.call_id: r for r in records}
        ordered = sorted(records, key=lambda r: (r.created_at, r.call_id))
        self.numbers = {r.call_id: i + 1 for i, r in enumerate(ordered)}
        self.parent_of = chains.parent_of
        self.children: dict[str | None, list[str]] = {}
        for chain in chains.chains:
            for r in chain.calls:
                self.children.setdefault(self.parent_of[r.call_id], []).append(r.call_id)
        # Superseded retries: siblings of the member that superseded them, drawn before it.
        self.superseded_by_kept: dict[str, list[str]] = {}
        for old, kept in chains.superseded.items():
            self.superseded_by_kept.setdefault(kept, []).append(old)
        self.chain_of = {r.call_id: c.chain_id for c in chains.chains for r in c.calls}
        self.rows: list[TreeRow] = []

    def row(
        self, call_id: str, depth: int, guides: tuple[str, ...], chain_id: str | None
    ) -> TreeRow:
        by_id, numbers = self.by_id, self.numbers
        r = by_id[call_id]
        # A superseded retry is in no chain: its stored link names the parent it extends.
        parent = self.parent_of.get(call_id, r.parent_call_id)
        inherited = 0
        if parent is not None and parent in by_id:
            inherited = by_id[parent].num_prompt_tokens + by_id[parent].num_generation_tokens
        superseded_by = self.chains.superseded.get(call_id)
        return TreeRow(
            call_id=call_id,
            number=numbers[call_id],
            chain_id=chain_id,
            depth=depth,
            guides=guides,
            parent_call_id=parent,
            status=r.status.value,
            verdict=(r.linking or {}).get("verdict"),
            refused=refused_link(r, numbers),
            retry_of_number=numbers.get(r.retry_of) if r.retry_of else None,
            superseded_by_number=numbers.get(superseded_by) if superseded_by else None,
            is_main=chain_id is not None and chain_id == self.main,
            is_chain_start=depth == 0 and call_id == chain_id,
            num_children=len(self.children.get(call_id, [])),
            latency_ms=r.latency_ms,
            finish_reason=r.finish_reason,
            num_prompt_tokens=r.num_prompt_tokens,
            num_new_prompt_tokens=max(0, r.num_prompt_tokens - inherited),
            num_generation_tokens=r.num_generation_tokens,
            has_routed_experts=r.routed_experts is not None,
            diagnostic_kinds=tuple(sorted({d.kind for d in r.diagnostics})),
        )

    def retries_of(self, call_id: str) -> list[str]:
        """The retries ``call_id`` superseded, in call-number order."""
        return sorted(self.superseded_by_kept.get(call_id, []), key=lambda c: self.numbers[c])

    def walk(
        self, call_id: str, depth: int, prefix: tuple[str, ...], guide: tuple[str, ...]
    ) -> None:
        """Draw ``call_id`` and, unless it is a superseded retry, its subtree depth-first."""
        self.rows.append(self.row(call_id, depth, prefix + guide, self.chain_of.get(call_id)))
        if call_id in self.chains.superseded:
            return
        kids: list[str] = []
        for kid in self.children.get(call_id, []):
            kids.extend(self.retries_of(kid))
            kids.append(kid)
        below = prefix + (("│ " if guide == ("├─",) else "  ",) if guide else ())
        for i, kid in enumerate(kids):
            self.walk(kid, depth + 1, below, ("└─",) if i == len(kids) - 1 else ("├─",))


def build_call_tree(rollout_id: str, records: list[CallRecord]) -> RolloutTree:
    """The viewer's call tree of a rollout: its chains' rows in drawing order, then the calls
    outside every chain (see the module docstring)."""
    drawing = _Drawing(rollout_id, records)
    chains = drawing.chains
    for chain in chains.chains:
        for old in drawing.retries_of(chain.chain_id):
            drawing.rows.append(drawing.row(old, 0, (), None))
        drawing.walk(chain.chain_id, 0, (), ())
    rows = drawing.rows
    drawn = {r.call_id for r in rows}
    unlinked = [
        drawing.row(r.call_id, 0, (), None) for r in chains.unlinked if r.call_id not in drawn
    ]
    return RolloutTree(
        rollout_id=rollout_id,
        rows=rows,
        unlinked=unlinked,
        main_chain_id=drawing.main,
        num_chains=len(chains.chains),
        num_branches=sum(c.num_branches for c in chains.chains),
        num_refused=sum(1 for r in rows if r.refused is not None),
        num_retries=sum(1 for r in records if r.retry_of is not None),
    )
