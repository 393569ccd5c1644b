"""Rollout completeness on both stores: a cut-off call that a complete retry supersedes no
longer makes its rollout incomplete (in any arrival order, across a reopen), while a
rollout-level mark, an unretried or badly retried cut-off call, and a freeze keep it; and a
store from before the retry link (SQLite layout 4, PostgreSQL layout 2) is recounted."""

from __future__ import annotations

import sqlite3
from typing import Any

import psycopg
import pytest

from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic
from capture_proxy.store.postgres import PostgresStore
from capture_proxy.store.sqlite import SQLiteStore
from tests.factories import record
from tests.store.test_lifecycle import reopen


def attempt(
    call_id: str, status: CallStatus, retry_of: str | None = None, *, at: float = 0.0
) -> CallRecord:
    """One attempt of the same request: a cut-off one has part of the generation."""
    generation = [5, 6, 7] if status is CallStatus.COMPLETE else [5]
    rec = record(call_id, [1, 2, 3, 4], generation, created_at=at, status=status)
    return rec.replace(retry_of=retry_of)


CUT, OK, FAILED = CallStatus.INCOMPLETE, CallStatus.COMPLETE, CallStatus.FAILED


async def incomplete(store: Any, rollout_id: str = "r1") -> bool:
    info = await store.get_rollout(rollout_id)
    assert info is not None
    return bool(info.incomplete)


async def test_a_complete_retry_of_a_cut_off_call_makes_the_rollout_complete(store):
    await store.put_call(attempt("a", CUT))
    assert await incomplete(store)
    await store.put_call(attempt("b", OK, retry_of="a", at=1.0))
    assert not await incomplete(store)
    await store.put_call(attempt("b", OK, retry_of="a", at=1.0))  # a re-put changes nothing
    assert not await incomplete(store)
    info = await store.get_rollout("r1")
    assert (info.num_calls, info.version, info.diagnostics) == (2, 2, [])
    assert [r.call_id for r in await store.get_rollout_calls("r1")] == ["a", "b"]
    assert (await store.get_call("b")).retry_of == "a"
    store = await reopen(store)
    try:
        assert not await incomplete(store)
    finally:
        await store.close()


@pytest.mark.parametrize("order", ["abc", "cab", "cba", "bca"])
async def test_a_chain_of_attempts_is_superseded_in_any_arrival_order(store, order):
    """a cut off, b (retries a) cut off, c (retries b) complete: the rollout reads complete
    once all three are stored, whatever came first."""
    calls = {"a": attempt("a", CUT), "b": attempt("b", CUT, "a"), "c": attempt("c", OK, "b")}
    for call_id in order:
        await store.put_call(calls[call_id])
    assert not await incomplete(store)


@pytest.mark.parametrize(
    ("second", "want"),
    [
        (attempt("b", CUT, retry_of="a"), True),  # the retry was cut off too
        (attempt("b", FAILED, retry_of="a"), True),  # the retry failed: no answer
        (attempt("b", OK), True),  # the same request again, not a retry: a sibling sample
        (attempt("b", OK, retry_of="x"), True),  # a retry of another call
    ],
    ids=["cut-retry", "failed-retry", "sibling", "other-retry"],
)
async def test_only_a_complete_retry_of_the_call_supersedes_it(store, second, want):
    await store.put_call(attempt("a", CUT))
    await store.put_call(second)
    assert await incomplete(store) is want


async def test_a_rollout_level_mark_stays_whatever_the_retries(store):
    await store.put_call(attempt("a", CUT))
    await store.mark_rollout_incomplete("r1", Diagnostic("store_failed", {"call_id": "z"}))
    await store.put_call(attempt("b", OK, retry_of="a"))
    assert await incomplete(store)
    info = await store.get_rollout("r1")
    assert info.incomplete and [d.kind for d in info.diagnostics] == ["store_failed"]


async def test_a_late_retry_leaves_the_frozen_rollout_as_it_was_read(store):
    await store.put_call(attempt("a", CUT))
    await store.freeze_rollout("r1")
    await store.put_call(attempt("b", OK, retry_of="a", at=1.0))  # late: not in the snapshot
    info = await store.get_rollout("r1")
    assert info.incomplete and info.late_call_ids == ("b",)
    await store.put_call(record("y", [1], [2], rollout_id="r2"))
    await store.freeze_rollout("r2")
    await store.put_call(record("z", [1], [], rollout_id="r2", status=CUT))  # late, cut off
    assert not await incomplete(store, "r2")


async def _old_rollouts(store: Any) -> None:
    """r1: a cut-off call and its complete retry; r2: a cut-off call; r3: complete, marked."""
    await store.open()
    await store.put_call(attempt("a", CUT))
    await store.put_call(attempt("b", OK, retry_of="a", at=1.0))
    await store.put_call(record("c", [1], [], rollout_id="r2", status=CUT))
    await store.put_call(record("d", [1], [2], rollout_id="r3"))
    await store.mark_rollout_incomplete("r3", Diagnostic("store_failed", {"call_id": "e"}))
    await store.close()


async def _assert_recounted(store: Any) -> None:
    await store.open()
    try:
        assert [await incomplete(store, r) for r in ("r1", "r2", "r3")] == [False, True, True]
        await store.put_call(attempt("f", OK, retry_of="c").replace(rollout_id="r2"))
        assert not await incomplete(store, "r2")  # the new count goes on from the old
    finally:
        await store.close()


async def test_a_sqlite_layout_4_store_is_recounted(tmp_path):
    await _old_rollouts(s := SQLiteStore(tmp_path / "v4"))
    with sqlite3.connect(s.db_path) as db:  # layout 4: one flag for calls and marks alike
        db.executescript(
            "DROP INDEX calls_retry_links; DROP INDEX calls_by_prefix; DROP INDEX calls_late; "
            "DROP INDEX calls_by_retry_of; DROP INDEX calls_by_child_digest; "
            "ALTER TABLE calls DROP COLUMN retry_of; ALTER TABLE calls DROP COLUMN child_digest; "
            "ALTER TABLE rollouts DROP COLUMN incomplete_calls; "
            "ALTER TABLE rollouts DROP COLUMN num_chains; "
            "UPDATE rollouts SET incomplete = 1; PRAGMA user_version=4;"
        )
    await _assert_recounted(SQLiteStore(tmp_path / "v4"))
    with sqlite3.connect(s.db_path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 10
        links = db.execute("SELECT call_id, retry_of FROM calls ORDER BY call_id").fetchall()
        assert links == [("a", None), ("b", "a"), ("c", None), ("d", None), ("f", "c")]


@pytest.mark.postgres
async def test_a_postgres_layout_2_store_is_recounted(postgres_server):
    url = postgres_server.create_database()
    await _old_rollouts(PostgresStore(url, pool_size=2))
    with psycopg.connect(url, autocommit=True) as conn:  # layout 2: one flag for both
        conn.execute(
            "DROP INDEX calls_retry_links, calls_by_prefix, calls_late, calls_by_retry_of, "
            "calls_by_child_digest; "
            "ALTER TABLE calls DROP COLUMN retry_of, DROP COLUMN child_digest; "
            "ALTER TABLE rollouts DROP COLUMN incomplete_calls, DROP COLUMN num_calls, "
            "DROP COLUMN num_chains; "
            "UPDATE rollouts SET incomplete = true; "
            "DELETE FROM schema_migrations WHERE version > 2"
        )
    await _assert_recounted(PostgresStore(url, pool_size=2))
    with psycopg.connect(url) as conn:
        applied = conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
        assert applied == (8,)
        links = conn.execute("SELECT call_id, retry_of FROM calls ORDER BY call_id").fetchall()
        assert links == [("a", None), ("b", "a"), ("c", None), ("d", None), ("f", "c")]
