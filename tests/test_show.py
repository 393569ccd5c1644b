"""``capture-proxy show`` through the command line: what reaches a pipe or a file is whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from capture_proxy.cli import main
from capture_proxy.core.records import Diagnostic, DiagnosticKind
from capture_proxy.store.sqlite import SQLiteStore
from tests.factories import record

#: Longer than any cell 80 columns leave it (the width Rich takes when it is not on a terminal).
ROLLOUT = "task-0042-swe-bench-verified-django__django-11099-attempt-a1"
KINDS = f"{DiagnosticKind.FOREIGN_TURN}, {DiagnosticKind.HARNESS_NOTE_REWRITTEN}"


def _store(tmp_path: Path) -> Path:
    async def fill() -> None:
        store = SQLiteStore(tmp_path)
        await store.open()
        try:
            call = record("call_0123456789abcdef", [1, 2, 3], [4, 5], rollout_id=ROLLOUT)
            diagnostics = [
                Diagnostic(DiagnosticKind.HARNESS_NOTE_REWRITTEN),
                Diagnostic(DiagnosticKind.FOREIGN_TURN),
            ]
            await store.put_call(call.replace(diagnostics=diagnostics))
        finally:
            await store.close()

    asyncio.run(fill())
    return tmp_path


def test_piped_output_keeps_every_value_whole(tmp_path, capsys, monkeypatch):
    """Not on a terminal and no ``COLUMNS``: each value on one line, in full (a rollout id and
    the diagnostic kinds are what one greps the output for)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    store = _store(tmp_path)
    assert main(["show", "--store", str(store)]) == 0
    listing = capsys.readouterr().out
    assert "…" not in listing
    row = next(line for line in listing.splitlines() if ROLLOUT in line)
    assert KINDS in row
    assert main(["show", "--store", str(store), ROLLOUT]) == 0
    tree = capsys.readouterr().out
    assert "…" not in tree
    assert f"{ROLLOUT} complete  calls 1 · chains 1 · branches 0 · resolved 0" in tree
    assert KINDS in tree


@pytest.mark.parametrize("columns", ["60", "40"])
def test_a_narrow_width_folds_values_instead_of_cutting_them(
    tmp_path, capsys, monkeypatch, columns
):
    """``COLUMNS`` set (or a narrow terminal): a value too long for its cell wraps onto the next
    lines of the cell, every character kept."""
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["show", "--store", str(_store(tmp_path))]) == 0
    listing = capsys.readouterr().out
    assert "…" not in listing
    assert all(len(line) <= int(columns) for line in listing.splitlines())
    first_cells = [line.split("│")[1].strip() for line in listing.splitlines() if "│" in line]
    assert "".join(first_cells).startswith(ROLLOUT)


def test_a_named_mismatch_shows_the_stored_verdict_and_a_position_only_when_known(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("COLUMNS", raising=False)

    def mismatch(cls: str, **position: int) -> list[Diagnostic]:
        details = {"class": cls, "parent_call_id": "call-a", **position}
        return [Diagnostic(DiagnosticKind.PARENT_DIGEST_MISMATCH, details)]

    async def fill() -> None:
        store = SQLiteStore(tmp_path)
        await store.open()
        try:
            await store.put_call(record("call-a", [1, 2], [3], created_at=1.0))
            refused = record("call-b", [1, 2, 9, 4], [5], created_at=2.0)
            await store.put_call(
                refused.replace(
                    linking={"verdict": "refused"}, diagnostics=mismatch("retokenized", position=2)
                )
            )
            # a captured turn under an edited history: unresolved, and no position to name
            edited = record("call-c", [7, 8], [9], created_at=3.0)
            await store.put_call(
                edited.replace(
                    linking={"verdict": "unresolved"}, diagnostics=mismatch("history_edited")
                )
            )
        finally:
            await store.close()

    asyncio.run(fill())
    assert main(["show", "--store", str(tmp_path), "r1"]) == 0
    tree = capsys.readouterr().out
    assert "refused: retokenized from #1 at 2" in tree
    assert "unresolved: history_edited from #1" in tree
    assert "at None" not in tree
    assert "refused: history_edited" not in tree


def test_call_ids_are_whole_and_a_frozen_rollout_says_so(tmp_path, capsys, monkeypatch):
    """Issue 26: ``show`` cut call ids to 14 characters, and a frozen rollout read "complete"."""
    monkeypatch.setenv("COLUMNS", "400")
    store = _store(tmp_path)

    async def freeze() -> None:
        s = SQLiteStore(store)
        await s.open()
        try:
            await s.freeze_rollout(ROLLOUT)
        finally:
            await s.close()

    asyncio.run(freeze())
    assert main(["show", "--store", str(store), ROLLOUT]) == 0
    tree = capsys.readouterr().out
    assert "call_0123456789abcdef" in tree
    assert f"{ROLLOUT} complete · frozen  calls 1" in tree
    assert main(["show", "--store", str(store)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if ROLLOUT in line)
    assert "complete · frozen" in row
