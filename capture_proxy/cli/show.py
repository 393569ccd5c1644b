"""``capture-proxy show``: the viewer's rollout listing and chain tree in a terminal (Rich).

Reads a store directory with the store's own methods (no proxy running, no engine) and prints
the same page models the viewer renders (``core.view``): without a rollout id, every rollout
(status, calls, chains, refused links, incomplete, reward, age, diagnostic kinds); with one, its
facts and its chains as a tree with the same marks.

No value is ever cut short: a cell too narrow for its value wraps it onto more lines
(``overflow="fold"``, never Rich's ``…``), and output that is not a terminal (a pipe, a file)
is as wide as its longest line unless ``COLUMNS`` says otherwise, so each value stays whole on
one line for ``grep``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from capture_proxy.core.chains import build_chains
from capture_proxy.core.summary import link_stats
from capture_proxy.core.view.call_tree import TreeRow, build_call_tree
from capture_proxy.core.view.rollouts import RolloutRow, format_reward, rollout_row
from capture_proxy.store.sqlite import SQLiteStore

PAGE = 500
STATUS_STYLE = {"complete": "green", "incomplete": "yellow", "failed": "red"}
#: Columns of a console that is not a terminal and has no ``COLUMNS``: wider than any line
#: (a table is only as wide as its cells, so nothing is padded to it).
UNBOUNDED_WIDTH = 1_000_000


def make_console() -> Console:
    """The console ``show`` prints on: a terminal's width, or ``COLUMNS`` when it is set;
    anything else (a pipe, a file) is not wrapped at all, where Rich would take 80 columns."""
    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return console
    return Console(width=UNBOUNDED_WIDTH)


def _dash(value: object) -> str:
    return "–" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def rollouts_table(rows: list[RolloutRow]) -> Table:
    table = Table(title="rollouts", title_justify="left")
    for name, justify in [
        ("rollout", "left"),
        ("status", "left"),
        ("calls", "right"),
        ("chains", "right"),
        ("refused", "right"),
        ("incomplete", "left"),
        ("reward", "right"),
        ("age", "right"),
        ("diagnostics", "left"),
    ]:
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        table.add_row(
            r.rollout_id,
            Text(r.state, style=STATUS_STYLE[r.status]),
            str(r.num_calls),
            str(r.num_chains),
            str(r.refused_links or ""),
            "yes" if r.incomplete else "no",
            format_reward(r.reward),
            r.age,
            ", ".join(r.diagnostic_kinds),
        )
    return table


def _link_text(r: TreeRow) -> Text:
    text = Text()
    if r.refused is not None:
        # The stored verdict: ``refused``, ``prefix`` (linked to an ancestor after the
        # refusal), or ``unresolved`` (a captured turn under an edited history: no position).
        text.append(f"{r.verdict or 'refused'}: {r.refused.mismatch_class}", style="bold red")
        text.append(f" from #{r.refused.parent_number}")
        if r.refused.position is not None:
            text.append(f" at {r.refused.position}")
    elif r.verdict:
        text.append(r.verdict, style="dim")
    if r.retry_of_number:
        text.append(f" retry of #{r.retry_of_number}", style="yellow")
    if r.superseded_by_number:
        text.append(f" superseded by #{r.superseded_by_number}", style="dim")
    if r.is_branch_point:
        text.append(f" {r.num_children} branches", style="green")
    return text


def tree_table(rollout_id: str, rows: list[TreeRow], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for name in ("call", "link", "latency", "finish", "prompt (new)", "generated", "diagnostics"):
        justify = "right" if name in ("latency", "generated") else "left"
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        call = Text("".join(r.guides), style="dim")
        call.append(f"#{r.number} ", style="bold blue" if r.is_main else "bold")
        call.append(r.call_id, style="dim")  # whole: the README promises no value is cut
        if r.is_main and r.is_chain_start:
            call.append(" main", style="blue")
        table.add_row(
            call,
            _link_text(r),
            "–" if r.latency_ms is None else f"{r.latency_ms:,.0f} ms",
            r.finish_reason or "–",
            f"{r.num_prompt_tokens:,} (+{r.num_new_prompt_tokens:,})",
            f"{r.num_generation_tokens:,}",
            ", ".join(r.diagnostic_kinds),
        )
    return table


async def show(store_dir: Path, rollout_id: str | None, console: Console) -> int:
    """Print the listing, or one rollout; returns the exit status (1: unknown rollout)."""
    store = SQLiteStore(store_dir, exclusive=False)  # a reader beside a running proxy
    await store.open()
    try:
        now = time.time()
        if rollout_id is None:
            rows: list[RolloutRow] = []
            after = None
            while True:
                infos = await store.list_rollouts(limit=PAGE, after=after)
                for info in infos:
                    records = await store.get_rollout_calls(info.rollout_id)
                    rows.append(
                        rollout_row(
                            rollout_id=info.rollout_id,
                            created_at=info.created_at,
                            incomplete=info.incomplete,
                            rollout_diagnostic_kinds=[d.kind for d in info.diagnostics],
                            records=records,
                            metadata=info.metadata.to_json() if info.metadata is not None else None,
                            now=now,
                            frozen=info.snapshot is not None,
                        )
                    )
                if len(infos) < PAGE:
                    break
                after = infos[-1].rollout_id
            console.print(rollouts_table(rows))
            return 0
        found = await store.get_rollout(rollout_id)
        if found is None:
            console.print(f"rollout {rollout_id} not found in {store_dir}", style="red")
            return 1
        info = found
        records = await store.get_rollout_calls(rollout_id)
    finally:
        await store.close()
    row = rollout_row(
        rollout_id=info.rollout_id,
        created_at=info.created_at,
        incomplete=info.incomplete,
        rollout_diagnostic_kinds=[d.kind for d in info.diagnostics],
        records=records,
        metadata=info.metadata.to_json() if info.metadata is not None else None,
        now=now,
        frozen=info.snapshot is not None,
    )
    tree = build_call_tree(rollout_id, records)
    stats = link_stats(records, build_chains(rollout_id, records))
    refused = ", ".join(f"{k} {v}" for k, v in stats["links_refused"].items())
    console.print(
        f"[bold]{rollout_id}[/] [{STATUS_STYLE[row.status]}]{row.state}[/]  "
        f"calls {row.num_calls} · chains {tree.num_chains} · branches {tree.num_branches} · "
        f"resolved {stats['links_resolved']} · refused {tree.num_refused}"
        f"{f' ({refused})' if refused else ''} · retries {tree.num_retries} · "
        f"reward {format_reward(row.reward)} · age {row.age}"
    )
    console.print(tree_table(rollout_id, tree.rows, "chains"))
    if tree.unlinked:
        console.print(tree_table(rollout_id, tree.unlinked, "not in a chain"))
    return 0


def run(args: argparse.Namespace) -> int:
    """``capture-proxy show [--store DIR] [ROLLOUT]``: 0, or 2 when there is no store."""
    if not args.store.is_dir():
        print(f"capture-proxy: no store at {args.store}", file=sys.stderr)
        return 2
    return asyncio.run(show(args.store, args.rollout, make_console()))
