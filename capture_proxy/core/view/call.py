"""The call page's model: which tokens to show (one page of the sequence and, for a refused
link, the two sides from the first difference), then the spans once their text is known. Pure.

Two steps so the adapter can detokenise only what is shown: ``plan_call`` picks the page and
the refused parent and says which token ids it needs (``CallPlan.token_ids``); ``call_view``
turns the plan and the id -> text mapping into spans.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from capture_proxy.core.chains import build_chains
from capture_proxy.core.records import CallRecord
from capture_proxy.core.view import tokens
from capture_proxy.core.view.call_tree import RefusedLink, refused_link
from capture_proxy.core.weight_versions import path_versions, spans_of


@dataclass(frozen=True)
class CallPlan:
    record: CallRecord
    number: int
    parent_call_id: str | None
    layout: tokens.CallLayout
    pages: list[tokens.Page]
    page: tokens.Page
    refused: RefusedLink | None
    refused_parent: CallRecord | None
    #: the path's weight versions, ``core.weight_versions.path_versions``
    versions: tuple[list[str], np.ndarray]

    def token_ids(self) -> set[int]:
        """Ids whose text the page shows."""
        full = self.record.full_token_ids()
        ids = set(full[self.page.start : self.page.end].tolist())
        if self.refused_parent is not None and self.refused is not None:
            _, a, b = tokens.diff_ids(self.refused_parent, self.record, self.refused.position)
            ids.update(a.tolist())
            ids.update(b.tolist())
        return {int(i) for i in ids}


@dataclass(frozen=True)
class CallView:
    plan: CallPlan
    spans: list[tokens.TokenSpan]
    role_counts: dict[str, int]
    bucket_counts: list[int]
    diff: tokens.LinkDiff | None
    #: ``(version, num_tokens, slot)`` generated on the path, oldest first
    version_counts: list[tuple[str, int, int]]
    #: the call's own spans, ``(version, start, end, slot)`` over its generation
    own_spans: list[tuple[str, int, int, int]]


def ancestors_of(call_id: str, parent_of: Mapping[str, str | None]) -> list[str]:
    """The call's path above it, root first."""
    out: list[str] = []
    node = parent_of.get(call_id)
    while node is not None:
        out.append(node)
        node = parent_of.get(node)
    return out[::-1]


def plan_call(
    record: CallRecord,
    records: list[CallRecord],
    page_number: int | None,
    page_size: int = tokens.PAGE_SIZE,
) -> CallPlan:
    """``records``: the call's rollout (for its path and a refused link's parent);
    ``page_number``: 1-based, None for ``tokens.default_page``, clamped to the pages."""
    by_id = {r.call_id: r for r in records}
    by_id.setdefault(record.call_id, record)
    parent_of = build_chains(record.rollout_id, list(by_id.values())).parent_of
    ancestors = [by_id[c] for c in ancestors_of(record.call_id, parent_of)]
    lay = tokens.layout(record, ancestors)
    all_pages = tokens.pages(lay.seq_len, page_size)
    number = page_number if page_number is not None else tokens.default_page(lay, page_size)
    number = min(max(1, number), len(all_pages))
    ordered = sorted(by_id.values(), key=lambda r: (r.created_at, r.call_id))
    numbers = {r.call_id: i + 1 for i, r in enumerate(ordered)}
    refused = refused_link(record, numbers)
    refused_parent = by_id.get(refused.parent_call_id) if refused is not None else None
    return CallPlan(
        record=record,
        number=numbers[record.call_id],
        parent_call_id=ancestors[-1].call_id if ancestors else None,
        layout=lay,
        pages=all_pages,
        page=all_pages[number - 1],
        refused=refused,
        refused_parent=refused_parent,
        versions=path_versions([*ancestors, record]),
    )


def call_view(plan: CallPlan, texts: Mapping[int, str] | None) -> CallView:
    diff = None
    if plan.refused is not None and plan.refused_parent is not None:
        diff = tokens.link_diff(
            plan.refused_parent,
            plan.record,
            plan.refused.position,
            plan.refused.mismatch_class,
            texts,
        )
    table = plan.versions[0]
    return CallView(
        plan=plan,
        spans=tokens.spans(
            plan.record, plan.layout, plan.page.start, plan.page.end, texts, plan.versions
        ),
        role_counts=tokens.role_counts(plan.layout),
        bucket_counts=tokens.bucket_counts(plan.record),
        diff=diff,
        version_counts=tokens.version_counts(plan.versions),
        own_spans=[
            (v, start, end, table.index(v) % tokens.VERSION_SLOTS)
            for v, start, end in spans_of(plan.record)
        ],
    )
