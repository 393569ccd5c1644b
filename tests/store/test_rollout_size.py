"""A put reads a bounded number of rows whatever its rollout's size (issue 22): the prompt
parent is chosen with the same answer as before, without reading the rollout's other rows
(SQLite: the writer's prefix index, ``store.prompt_parents``, read once per rollout; PostgreSQL:
an index range from the verified parent's depth), the call's retry family comes from its own
index, and a replica's refresh reads the calls under one child digest
(``calls_by_child_digest``)."""

from __future__ import annotations

import dataclasses
import random
import sqlite3

import numpy as np
import pytest

from capture_proxy.core.prefixes import PREFIX_BLOCK, StoredPrefix, choose_prompt_parent
from capture_proxy.core.stored_form import token_digest
from capture_proxy.store.postgres import PostgresStore
from capture_proxy.store.prompt_parents import _LOAD
from capture_proxy.store.sql import (
    CALL_COLUMNS,
    CHILDREN_ANCESTRY,
    CHILDREN_OF,
    RETRY_FAMILY,
    RETRY_LINKS,
    SQLITE,
)
from capture_proxy.store.sqlite import SQLiteStore
from tests.factories import record
from tests.store.conftest import rows


async def test_parents_in_a_rollout_of_many_roots_are_chosen_as_before(store):
    # 30 roots of distinct tasks (prompts of different lengths), then a chain of three.
    for i in range(30):
        await store.put_call(record(f"root{i:02d}", [100 + i] * (1 + i % 7), [1, 2], created_at=i))
    await store.put_call(record("a", [7, 8], [9], created_at=40.0))
    b = dataclasses.replace(record("b", [7, 8, 9, 10], [11], created_at=41.0), parent_call_id="a")
    await store.put_call(b)
    # A parent given by hand that is not a prefix (root03: 6 tokens, as deep as the prompt):
    # the real, shallower one is still found.
    c = record("c", [7, 8, 9, 10, 11, 12], [13], created_at=42.0)
    await store.put_call(dataclasses.replace(c, parent_call_id="root03"))
    got = rows(
        store,
        "SELECT call_id, prompt_parent_call_id, prompt_prefix_len FROM calls "
        "WHERE call_id IN ('a', 'b', 'c', 'root00', 'root29') ORDER BY call_id",
    )
    assert got == [
        ("a", None, 0),
        ("b", "a", 3),
        ("c", "b", 5),
        ("root00", None, 0),
        ("root29", None, 0),
    ]
    assert [r.call_id for r in await store.get_rollout_calls("r1")][-3:] == ["a", "b", "c"]
    assert (await store.get_call("c")).prompt_token_ids.tolist() == [7, 8, 9, 10, 11, 12]


async def test_sqlite_put_reads_candidates_and_retry_links_through_their_indexes(tmp_path):
    store = SQLiteStore(tmp_path / "s")
    await store.open()
    await store.put_call(record("a", [1, 2], [3]))
    await store.close()
    with sqlite3.connect(store.db_path) as db:
        plans = {
            "candidates": db.execute("EXPLAIN QUERY PLAN " + _LOAD, ("r1",)).fetchall(),
            "links": db.execute(
                "EXPLAIN QUERY PLAN " + SQLITE.sql(RETRY_LINKS), ("r1",)
            ).fetchall(),
        }
    details = {k: [row[3] for row in v] for k, v in plans.items()}
    assert details == {
        # read once per rollout and process, on its first put
        "candidates": ["SEARCH calls USING INDEX calls_by_prefix (rollout_id=?)"],
        "links": ["SEARCH calls USING INDEX calls_retry_links (rollout_id=?)"],
    }


async def test_sqlite_retry_family_and_refresh_are_index_searches(tmp_path):
    store = SQLiteStore(tmp_path / "s")
    await store.open()
    await store.put_call(record("a", [1, 2], [3]))
    await store.close()
    refresh = (
        CHILDREN_ANCESTRY
        + f"SELECT {CALL_COLUMNS} FROM calls WHERE call_id IN (SELECT id FROM anc)"
    )
    with sqlite3.connect(store.db_path) as db:
        plans = {
            "family": db.execute(
                "EXPLAIN QUERY PLAN " + SQLITE.sql(RETRY_FAMILY), ("x", "r1", "c", "r1", "r1", "c")
            ).fetchall(),
            "children": db.execute("EXPLAIN QUERY PLAN " + CHILDREN_OF, ("r1", "d")).fetchall(),
            "refresh": db.execute("EXPLAIN QUERY PLAN " + refresh, ("r1", "d")).fetchall(),
        }
    reads = {
        k: [row[3] for row in v if row[3].startswith(("SEARCH", "SCAN c"))]
        for k, v in plans.items()
    }
    pk = "SEARCH c USING INDEX sqlite_autoindex_calls_1 (call_id=?)"
    assert reads == {
        "family": [
            pk,
            "SEARCH c USING INDEX calls_by_retry_of (rollout_id=? AND retry_of=?)",
            pk,
        ],
        "children": [
            "SEARCH calls USING INDEX calls_by_child_digest (rollout_id=? AND child_digest=?)"
        ],
        "refresh": [
            "SEARCH calls USING INDEX sqlite_autoindex_calls_1 (call_id=?)",
            "SEARCH calls USING INDEX calls_by_child_digest (rollout_id=? AND child_digest=?)",
            pk,
        ],
    }


async def test_calls_by_child_digest_are_those_a_history_continues(store):
    def linked(call_id, prompt, gen, digest, n, parent=None, rollout_id="r1"):
        rec = record(call_id, prompt, gen, rollout_id=rollout_id, created_at=n)
        return rec.replace(linking={"child_digest": digest}, parent_call_id=parent)

    a = linked("a", [1, 2], [3], "da", 0)
    b = linked("b", [1, 2, 3, 4], [5], "db", 1, parent="a")
    b2 = linked("b2", [1, 2, 3, 4], [5], "db", 2, parent="a")  # a sibling sample, answered alike
    other = linked("o", [1, 2, 3, 4], [5], "db", 3, rollout_id="r2")
    for rec in (a, b, b2, other, record("plain", [9], [9], created_at=4)):
        await store.put_call(rec)
    found = await store.get_calls_by_child_digest("r1", "db")
    assert [r.call_id for r in found] == ["b", "b2"]
    # decoded whole (their prompts are stored after their prompt parent's tokens)
    assert [r.prompt_token_ids.tolist() for r in found] == [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert found[0].linking == {"child_digest": "db"} and found[0].parent_call_id == "a"
    assert await store.get_calls_by_child_digest("r1", "none") == []
    assert [r.call_id for r in await store.get_calls_by_child_digest("r2", "db")] == ["o"]


def _sweep(n: int, seed: int) -> list:
    """An evaluation sweep and its sessions in one rollout: roots of many lengths around and
    past a block (one system prompt), some continued by a turn that extends them, some
    resubmitted whole (identical prompts), so that calls share blocks and prefixes."""
    rng = random.Random(seed)
    system = list(range(50))
    out, done = [], []
    for i in range(n):
        if done and rng.random() < 0.3:
            parent = rng.choice(done)
            prompt = [*parent[1], *parent[2], *[rng.randrange(9000, 9100)] * rng.randrange(1, 40)]
        elif done and rng.random() < 0.1:
            prompt = list(rng.choice(done)[1])
        else:
            size = rng.choice([5, PREFIX_BLOCK - 60, PREFIX_BLOCK, 2 * PREFIX_BLOCK + 7, 700])
            prompt = [*system, *(rng.randrange(1000, 2000) for _ in range(size))]
        gen = [rng.randrange(3000, 3100) for _ in range(rng.choice([1, 3, 30]))]
        done.append((f"c{i:03d}", prompt, gen))
        out.append(record(f"c{i:03d}", prompt, gen, created_at=float(rng.randrange(5))))
    return out


def _expected_parents(records: list) -> dict[str, str | None]:
    """The prompt parents ``choose_prompt_parent`` gives over every call stored before each."""
    seen: list[StoredPrefix] = []
    out = {}
    for r in records:
        parent = choose_prompt_parent(r.prompt_token_ids, seen, exclude=r.call_id)
        out[r.call_id] = None if parent is None else parent.call_id
        n = r.num_prompt_tokens + r.num_generation_tokens
        seen.append(
            StoredPrefix(
                r.call_id, r.created_at, n, token_digest(r.prompt_token_ids, r.generation_token_ids)
            )
        )
    return out


async def test_prompt_parents_of_a_sweep_are_the_scan_of_every_stored_call(store):
    records = _sweep(160, seed=3)
    for r in records:
        await store.put_call(r)
    if isinstance(store, SQLiteStore):
        # The rollout's rows were read once (on its first put); the others came from memory.
        assert list(store._puts.prompt_parents._rollouts) == ["r1"]
    got = dict(rows(store, "SELECT call_id, prompt_parent_call_id FROM calls"))
    assert got == _expected_parents(records)
    assert sum(v is not None for v in got.values()) > 40  # the sweep links many
    for r in records[::17]:
        assert (await store.get_call(r.call_id)).prompt_token_ids.tolist() == (
            r.prompt_token_ids.tolist()
        )


async def test_rows_without_a_block_digest_are_still_prompt_parents(tmp_path):
    # A store written before layout 9: the rows' block digests are NULL. A new process reads
    # them aside and compares them as before.
    long_prompt = list(range(2 * PREFIX_BLOCK + 5))
    store = SQLiteStore(tmp_path / "s")
    await store.open()
    await store.put_call(record("old-long", long_prompt, [7, 8]))
    await store.put_call(record("old-short", [1, 2], [3]))
    await store.close()
    with sqlite3.connect(store.db_path) as db:
        db.execute("UPDATE calls SET tokens_block_sha256 = NULL")
    store = SQLiteStore(tmp_path / "s")
    await store.open()
    try:
        await store.put_call(record("new-long", [*long_prompt, 7, 8, 9], [10], created_at=1))
        await store.put_call(record("new-short", [1, 2, 3, 4], [5], created_at=1))
        got = rows(
            store,
            "SELECT call_id, prompt_parent_call_id, prompt_prefix_len FROM calls "
            "WHERE call_id LIKE 'new-%' ORDER BY call_id",
        )
        assert got == [
            ("new-long", "old-long", 2 * PREFIX_BLOCK + 7),
            ("new-short", "old-short", 3),
        ]
        call = await store.get_call("new-long")
        assert call.prompt_token_ids.tolist() == [*long_prompt, 7, 8, 9]
    finally:
        await store.close()


async def test_a_deleted_rollouts_calls_are_no_prompt_parents(tmp_path):
    store = SQLiteStore(tmp_path / "s")
    await store.open()
    try:
        await store.put_call(record("a", [1, 2], [3], rollout_id="r2"))
        assert await store.delete_rollout("r2") == 1
        await store.put_call(record("b", [1, 2, 3, 4], [5], rollout_id="r3"))
        await store.put_call(record("c", [1, 2, 3, 4, 5, 6], [7], rollout_id="r3"))
        got = rows(store, "SELECT call_id, prompt_parent_call_id FROM calls ORDER BY call_id")
        assert got == [("b", None), ("c", "b")]
        assert np.array_equal((await store.get_call("c")).prompt_token_ids, [1, 2, 3, 4, 5, 6])
    finally:
        await store.close()


async def test_postgres_rows_without_a_block_digest_are_still_prompt_parents(store):
    # Rows written before migration 7 have no block digest: read aside, as before.
    if not isinstance(store, PostgresStore):
        pytest.skip("SQLite's own case: test_rows_without_a_block_digest_are_still_prompt_parents")
    import psycopg

    long_prompt = list(range(2 * PREFIX_BLOCK + 5))
    await store.put_call(record("old-long", long_prompt, [7, 8]))
    with psycopg.connect(store.url) as conn:
        conn.execute("UPDATE calls SET tokens_block_sha256 = NULL")
    await store.put_call(record("new-long", [*long_prompt, 7, 8, 9], [10], created_at=1))
    got = rows(
        store,
        "SELECT prompt_parent_call_id, prompt_prefix_len FROM calls WHERE call_id = 'new-long'",
    )
    assert got == [("old-long", 2 * PREFIX_BLOCK + 7)]
    assert (await store.get_call("new-long")).prompt_token_ids.tolist() == [*long_prompt, 7, 8, 9]
