"""A put reads a bounded number of rows whatever its rollout's size (issue 22): the prompt
parent is chosen from an index range (``calls_by_prefix``) starting at the verified parent's
depth, with the same choice as before, and the call's retry family comes from its own index;
a replica's refresh reads the calls under one child digest (``calls_by_child_digest``)."""

from __future__ import annotations

import dataclasses
import sqlite3

from capture_proxy.store.sql import (
    CALL_COLUMNS,
    CHILDREN_ANCESTRY,
    CHILDREN_OF,
    RETRY_FAMILY,
    RETRY_LINKS,
    SQLITE,
)
from capture_proxy.store.sqlite import _CANDIDATES, SQLiteStore
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
            "candidates": db.execute("EXPLAIN QUERY PLAN " + _CANDIDATES, ("r1", 0, 9)).fetchall(),
            "links": db.execute(
                "EXPLAIN QUERY PLAN " + SQLITE.sql(RETRY_LINKS), ("r1",)
            ).fetchall(),
        }
    details = {k: [row[3] for row in v] for k, v in plans.items()}
    assert details == {
        "candidates": [
            "SEARCH calls USING INDEX calls_by_prefix (rollout_id=? AND <expr>>? AND <expr><?)"
        ],
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
