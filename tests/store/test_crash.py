"""Crash safety: a writer killed with SIGKILL mid-loop leaves a store that opens and holds every
call it acknowledged (printed after ``put_call`` returned), in both synchronous modes (a crash
of the process loses nothing in ``normal`` either: the commit is in the OS's page cache)."""

from __future__ import annotations

import os
import selectors
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capture_proxy.store.sqlite import DB_FILE_NAME, SQLiteStore
from tests.core.test_codec_v2 import assert_same
from tests.store.crash_writer import chain

ROOT = Path(__file__).resolve().parents[2]


def run_and_kill(
    store_dir: Path,
    rollout_id: str,
    acks_before_kill: int,
    synchronous: str = "full",
    writers: int = 1,
) -> list[str]:
    """Start a writer, read acknowledgements until ``acks_before_kill`` (bounded: 60 s), then
    SIGKILL it; return every call id it acknowledged, including any still in the pipe."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.store.crash_writer",
            str(store_dir),
            rollout_id,
            synchronous,
            str(writers),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    acked: list[str] = []
    buf = b""
    deadline = time.monotonic() + 60
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(acked) < acks_before_kill:
            left = deadline - time.monotonic()
            assert left > 0, "writer acknowledged too slowly"
            if not sel.select(timeout=left):
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            assert data, f"writer exited: {proc.stderr.read().decode() if proc.stderr else ''}"
            buf += data
            *lines, buf = buf.split(b"\n")
            acked += [line.decode() for line in lines]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    rest = proc.stdout.read()  # acknowledged between our last read and the kill
    acked += [line.decode() for line in (buf + rest).split(b"\n") if line]
    proc.stdout.close()
    if proc.stderr is not None:
        proc.stderr.close()
    return acked


@pytest.mark.parametrize("synchronous", ["full", "normal"])
async def test_sigkill_in_a_write_loop_loses_no_acknowledged_call(tmp_path, synchronous):
    store_dir = tmp_path / "store"
    acked: dict[str, list[str]] = {}
    # Several writers in a row on the same store, each killed at a different point; the
    # later ones reopen a store the earlier kills left behind.
    for i, n in enumerate((3, 11, 1, 25, 7)):
        rollout_id = f"crash{i}"
        acked[rollout_id] = run_and_kill(store_dir, rollout_id, n, synchronous)
        assert len(acked[rollout_id]) >= n
    with sqlite3.connect(store_dir / DB_FILE_NAME) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = SQLiteStore(store_dir)
    await store.open()
    try:
        for rollout_id, ids in acked.items():
            stored = {r.call_id: r for r in await store.get_rollout_calls(rollout_id)}
            expected = {r.call_id: r for r in chain(rollout_id, len(stored) + 1)}
            assert set(ids) <= set(stored)
            for call_id, rec in stored.items():
                assert_same(rec, expected[call_id])
            one = await store.get_call(ids[-1])
            assert one is not None
            assert_same(one, expected[ids[-1]])
    finally:
        await store.close()


async def test_sigkill_during_group_commits_loses_no_acknowledged_call(tmp_path):
    """Eight chains written at once: the writer commits the puts that queued during the
    previous commit together; every put acknowledged before the kill is stored, whole."""
    store_dir = tmp_path / "store"
    acked: list[str] = []
    for i, n in enumerate((40, 9, 70)):
        acked += run_and_kill(store_dir, f"group{i}", n, "full", writers=8)
    with sqlite3.connect(store_dir / DB_FILE_NAME) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = SQLiteStore(store_dir)
    await store.open()
    try:
        rollouts = sorted({call_id.rsplit("-", 1)[0] for call_id in acked})
        assert len(rollouts) >= 8  # each writer acknowledged at least once
        for rollout_id in rollouts:
            stored = {r.call_id: r for r in await store.get_rollout_calls(rollout_id)}
            expected = {r.call_id: r for r in chain(rollout_id, len(stored) + 1)}
            mine = [c for c in acked if c.rsplit("-", 1)[0] == rollout_id]
            assert set(mine) <= set(stored)
            for call_id, rec in stored.items():
                assert_same(rec, expected[call_id])
    finally:
        await store.close()
