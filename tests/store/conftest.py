"""The store contract suite runs against every store: each test that takes ``store`` or
``make_store`` runs once on SQLite and once on PostgreSQL (marker ``postgres``; a real server,
the session's ``postgres_server``, a new database per store)."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from capture_proxy.store.base import CaptureStore
from capture_proxy.store.postgres import PostgresStore
from capture_proxy.store.sqlite import SQLiteStore

STORE_KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]

MakeStore = Callable[[], Awaitable[Any]]


@pytest.fixture(params=STORE_KINDS)
def store_kind(request) -> str:
    return str(request.param)


@pytest.fixture
async def make_store(store_kind, tmp_path, request) -> AsyncIterator[MakeStore]:
    """``await make_store()``: a new, empty, open store of this test's kind (closed after)."""
    opened: list[CaptureStore] = []
    server = request.getfixturevalue("postgres_server") if store_kind == "postgres" else None

    async def make() -> Any:
        if server is not None:
            store: Any = PostgresStore(server.create_database(), pool_size=4)
        else:
            store = SQLiteStore(tmp_path / f"store{len(opened)}")
        await store.open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


@pytest.fixture
async def store(make_store):
    return await make_store()


def rows(store: Any, sql: str) -> list[tuple[Any, ...]]:
    """Run ``sql`` (no parameters; SQL both databases speak) on the store's own database from
    a separate connection; bytea/BLOB values as ``bytes``."""
    if isinstance(store, PostgresStore):
        import psycopg

        with psycopg.connect(store.url) as conn:
            out = conn.execute(sql).fetchall()
        return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in out]
    with sqlite3.connect(store.db_path) as db:
        return db.execute(sql).fetchall()


def stored_bytes(store: Any) -> int:
    """How many bytes the store holds: SQLite's pages (committed WAL frames included); for
    PostgreSQL the stored values' sizes (its pages are preallocated in large steps)."""
    if isinstance(store, PostgresStore):
        cols = [
            "meta", "prompt_token_ids", "generation_token_ids", "generation_log_probs",
            "routed_experts", "tokens_sha256", "messages_delta", "messages_sha256",
            "messages_chain",
        ]
        calls = " + ".join(f"coalesce(octet_length({c}), 0)" for c in cols)
        (total,) = rows(
            store,
            f"SELECT (SELECT coalesce(sum({calls}), 0) FROM calls) + "
            "(SELECT coalesce(sum(octet_length(json) + 32), 0) FROM json_blobs)",
        )[0]
        return int(total)
    (pages,) = rows(store, "PRAGMA page_count")[0]
    (size,) = rows(store, "PRAGMA page_size")[0]
    return int(pages * size)
