"""A put reads a bounded number of rows whatever its rollout's size (issue 22): the prompt
parent is chosen from an index range (``calls_by_prefix``) starting at the verified parent's
depth, with the same choice as before, and the retry links come from their own index."""

from __future__ import annotations

import dataclasses
import sqlite3

from capture_proxy.store.sql import RETRY_LINKS, SQLITE
from capture_proxy.store.sqlite import _ALL_CANDIDATES, _CANDIDATES, SQLiteStore
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
            "candidates": db.execute(
                "EXPLAIN QUERY PLAN " + _CANDIDATES, {"rollout": "r1", "parent": "a", "prompt": 9}
            ).fetchall(),
            "root candidates": db.execute(
                "EXPLAIN QUERY PLAN " + _ALL_CANDIDATES, {"rollout": "r1", "prompt": 9}
            ).fetchall(),
            "links": db.execute(
                "EXPLAIN QUERY PLAN " + SQLITE.sql(RETRY_LINKS), ("r1",)
            ).fetchall(),
        }
    details = {k: [row[3] for row in v] for k, v in plans.items()}
    assert details == {
        "candidates": [
            "SEARCH calls USING INDEX calls_by_prefix (rollout_id=? AND <expr>>? AND <expr><?)",
            "SCALAR SUBQUERY 1",  # the verified parent's depth: one row, by its call id
            "SEARCH p USING INDEX sqlite_autoindex_calls_1 (call_id=?)",
        ],
        "root candidates": [
            "SEARCH calls USING INDEX calls_by_prefix (rollout_id=? AND <expr>>? AND <expr><?)"
        ],
        "links": ["SEARCH calls USING INDEX calls_retry_links (rollout_id=?)"],
    }
