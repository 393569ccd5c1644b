"""The embedded store's table layout: its tables, indexes and the steps that bring an older
store's layout to ``LAYOUT_VERSION`` (``PRAGMA user_version``).

Owns the DDL and the migration of ``sqlite.py``'s database; what the tables hold is described
there. Runs on the writer's connection, inside one ``BEGIN IMMEDIATE`` transaction
(``write_transaction``): a crash leaves the old layout, and the next open migrates again.
Must not hold a store operation's SQL (``sql.py``, ``sqlite.py``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from capture_proxy.store import sql
from capture_proxy.store.base import StoreError

T = TypeVar("T")

#: Table layout version (``PRAGMA user_version``); 0 is the layout of schema v1 records,
#: 4 added the lifecycle (snapshots, late calls, metadata, retirements), 5 the retry link
#: (``calls.retry_of``) and ``rollouts.incomplete_calls``, 6 the indexes that keep a put's
#: reads bounded whatever the rollout's size (``calls_by_prefix``, ``calls_retry_links``,
#: ``calls_late``), 7 the counts that listings and ``/health`` read instead of counting rows
#: (``rollouts.num_calls``, the ``counters`` row ``calls``), 8 the number of chains a listing
#: reads (``rollouts.num_chains``, ``core.chain_counts``) and those of the viewer's list
#: (``num_failed``, ``num_incomplete``, ``num_refused``, ``rollout_kinds``), the retry
#: family's index (``calls_by_retry_of``) and the child digest a replica's refresh reads by
#: (``calls.child_digest``, ``calls_by_child_digest``), 9 the block digest a put's prompt
#: parent is found by (``calls.tokens_block_sha256``, ``store.prompt_parents``; NULL in rows
#: written before), 10 the images of calls (``images``: one row per image, content-addressed
#: by the SHA-256 of its bytes; ``call_images``: which calls carry it).
LAYOUT_VERSION = 10
_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,
    schema_version INTEGER NOT NULL,
    meta TEXT NOT NULL,
    prompt_token_ids BLOB NOT NULL,
    generation_token_ids BLOB NOT NULL,
    generation_log_probs BLOB NOT NULL,
    routed_experts BLOB,
    prompt_parent_call_id TEXT,
    prompt_prefix_len INTEGER NOT NULL DEFAULT 0,
    num_prompt_tokens INTEGER NOT NULL DEFAULT 0,
    num_generation_tokens INTEGER NOT NULL DEFAULT 0,
    tokens_sha256 BLOB NOT NULL DEFAULT x'',
    messages_delta TEXT NOT NULL DEFAULT '[]',
    messages_prefix_len INTEGER NOT NULL DEFAULT 0,
    num_messages INTEGER NOT NULL DEFAULT 0,
    messages_sha256 BLOB NOT NULL DEFAULT x'',
    messages_chain BLOB NOT NULL DEFAULT x'',
    late INTEGER NOT NULL DEFAULT 0,
    retry_of TEXT,
    child_digest TEXT,
    tokens_block_sha256 BLOB
);
CREATE INDEX IF NOT EXISTS calls_by_rollout ON calls (rollout_id, created_at);
CREATE TABLE IF NOT EXISTS json_blobs (
    sha256 BLOB PRIMARY KEY,
    json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS call_json (
    call_id TEXT NOT NULL,
    sha256 BLOB NOT NULL,
    PRIMARY KEY (call_id, sha256)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS call_json_by_sha ON call_json (sha256);
CREATE TABLE IF NOT EXISTS tombstones (
    rollout_id TEXT PRIMARY KEY,
    deleted_at REAL NOT NULL,
    snapshot_id TEXT,
    version INTEGER,
    deleted_calls INTEGER
);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0,
    diagnostics TEXT NOT NULL DEFAULT '[]',
    version INTEGER NOT NULL DEFAULT 0,
    incomplete_calls INTEGER NOT NULL DEFAULT 0,
    num_calls INTEGER NOT NULL DEFAULT 0,
    num_chains INTEGER DEFAULT 0,
    num_failed INTEGER NOT NULL DEFAULT 0,
    num_incomplete INTEGER NOT NULL DEFAULT 0,
    num_refused INTEGER NOT NULL DEFAULT 0,
    metadata TEXT NOT NULL DEFAULT '{}',
    snapshot_id TEXT,
    frozen_at REAL,
    frozen_num_calls INTEGER,
    export_cursor INTEGER
);
CREATE TABLE IF NOT EXISTS rollout_kinds (
    rollout_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    PRIMARY KEY (rollout_id, kind)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS images (
    sha256 BLOB PRIMARY KEY,
    media_type TEXT NOT NULL,
    width INTEGER NOT NULL,
    height INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS call_images (
    call_id TEXT NOT NULL,
    sha256 BLOB NOT NULL,
    PRIMARY KEY (call_id, sha256)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS call_images_by_sha ON call_images (sha256);
"""
# Created after the columns exist (an older store gets them in the migration first).
_INDEXES = """
CREATE UNIQUE INDEX IF NOT EXISTS rollouts_by_cursor ON rollouts (export_cursor)
    WHERE export_cursor IS NOT NULL;
CREATE INDEX IF NOT EXISTS calls_by_prefix ON calls
    (rollout_id, num_prompt_tokens + num_generation_tokens, tokens_sha256, created_at, call_id)
    WHERE status = 'complete' AND num_generation_tokens > 0;
CREATE INDEX IF NOT EXISTS calls_retry_links ON calls (rollout_id)
    WHERE late = 0 AND (status = 'incomplete' OR retry_of IS NOT NULL);
CREATE INDEX IF NOT EXISTS calls_late ON calls (rollout_id, created_at, call_id) WHERE late = 1;
CREATE INDEX IF NOT EXISTS calls_by_retry_of ON calls (rollout_id, retry_of)
    WHERE retry_of IS NOT NULL;
CREATE INDEX IF NOT EXISTS calls_by_child_digest ON calls (rollout_id, child_digest)
    WHERE child_digest IS NOT NULL;
"""

_V2_COLUMNS = {
    "prompt_parent_call_id": "TEXT",
    "prompt_prefix_len": "INTEGER NOT NULL DEFAULT 0",
    "num_prompt_tokens": "INTEGER NOT NULL DEFAULT 0",
    "num_generation_tokens": "INTEGER NOT NULL DEFAULT 0",
    "tokens_sha256": "BLOB NOT NULL DEFAULT x''",
}
_V3_COLUMNS = {
    "messages_delta": "TEXT NOT NULL DEFAULT '[]'",
    "messages_prefix_len": "INTEGER NOT NULL DEFAULT 0",
    "num_messages": "INTEGER NOT NULL DEFAULT 0",
    "messages_sha256": "BLOB NOT NULL DEFAULT x''",
    "messages_chain": "BLOB NOT NULL DEFAULT x''",
}
# Layout 4, per table.
_V4_COLUMNS = {
    "calls": {"late": "INTEGER NOT NULL DEFAULT 0"},
    "rollouts": {
        "version": "INTEGER NOT NULL DEFAULT 0",
        "metadata": "TEXT NOT NULL DEFAULT '{}'",
        "snapshot_id": "TEXT",
        "frozen_at": "REAL",
        "frozen_num_calls": "INTEGER",
        "export_cursor": "INTEGER",
    },
    "tombstones": {"snapshot_id": "TEXT", "version": "INTEGER", "deleted_calls": "INTEGER"},
}
_V7_COLUMNS = {"rollouts": {"num_calls": "INTEGER NOT NULL DEFAULT 0"}}
_V8_COLUMNS = {
    "calls": {"child_digest": "TEXT"},
    "rollouts": {
        "num_chains": "INTEGER DEFAULT 0",
        "num_failed": "INTEGER NOT NULL DEFAULT 0",
        "num_incomplete": "INTEGER NOT NULL DEFAULT 0",
        "num_refused": "INTEGER NOT NULL DEFAULT 0",
    },
}
_V9_COLUMNS = {"calls": {"tokens_block_sha256": "BLOB"}}
_V5_COLUMNS = {
    "calls": {"retry_of": "TEXT"},
    "rollouts": {"incomplete_calls": "INTEGER NOT NULL DEFAULT 0"},
}


def write_transaction(db: sqlite3.Connection, body: Callable[[], T]) -> T:
    """Run ``body`` in ``BEGIN IMMEDIATE`` ... ``COMMIT``; roll back on any exception (unless
    SQLite already did, e.g. after SQLITE_FULL, so the original error is the one raised)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        result = body()
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    return result


def migrate_layout(db: sqlite3.Connection, db_path: Path) -> None:
    """Create the tables, or bring an older store's to ``LAYOUT_VERSION`` (one transaction).
    Raises StoreError for a layout newer than this reader knows."""
    row = db.execute("PRAGMA user_version").fetchone()
    version = int(row[0]) if row else 0
    if version > LAYOUT_VERSION:
        raise StoreError(
            f"store at {db_path} has layout {version}; this reader knows up to {LAYOUT_VERSION}"
        )
    # CREATE ... IF NOT EXISTS leaves an older ``calls`` table as it is; executescript
    # runs outside the transaction below, which adds the missing columns.
    db.executescript(_SCHEMA)

    def body() -> None:
        _add_columns(db)
        if version < 4:
            # Before the lifecycle every stored call counted: the revision is their count.
            db.execute(
                "UPDATE rollouts SET version = (SELECT count(*) FROM calls c "
                "WHERE c.rollout_id = rollouts.rollout_id)"
            )
        # The indexes need the columns (executescript would commit: one statement each).
        for statement in _INDEXES.strip().split(";"):
            if statement.strip():
                db.execute(statement)
        sql.migrate_records(sql.SQLITE, db)
        if version < 5:
            _count_incomplete_calls(db)
        if version < 7:
            _count_calls(db)
        if version < 8:
            _count_chains(db)
        db.execute(f"PRAGMA user_version={LAYOUT_VERSION}")

    write_transaction(db, body)


def _add_columns(db: sqlite3.Connection) -> None:
    """The columns of layouts 1 to 9 that an older table lacks."""
    columns = {
        "calls": _V2_COLUMNS
        | _V3_COLUMNS
        | _V4_COLUMNS["calls"]
        | _V5_COLUMNS["calls"]
        | _V8_COLUMNS["calls"]
        | _V9_COLUMNS["calls"],
        "rollouts": _V4_COLUMNS["rollouts"]
        | _V5_COLUMNS["rollouts"]
        | _V7_COLUMNS["rollouts"]
        | _V8_COLUMNS["rollouts"],
        "tombstones": _V4_COLUMNS["tombstones"],
    }
    for table, wanted in columns.items():
        existing = {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
        for name, decl in wanted.items():
            if name not in existing:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")


def _count_incomplete_calls(db: sqlite3.Connection) -> None:
    """Layout 5: the retry links out of the records' metadata, the incomplete calls counted
    per rollout, and ``rollouts.incomplete`` kept only where a rollout-level diagnostic
    set it (before, it also said that some call was incomplete, superseded or not)."""
    db.execute(
        "UPDATE calls SET retry_of = json_extract(meta, '$.retry_of') "
        "WHERE json_valid(meta) AND json_extract(meta, '$.retry_of') IS NOT NULL"
    )
    db.execute("UPDATE rollouts SET incomplete = 0 WHERE diagnostics = '[]'")
    sql.recount_incomplete_calls(sql.SQLITE, db)


def _count_calls(db: sqlite3.Connection) -> None:
    """Layout 7: each rollout's number of calls, and the store's (``counters`` row ``calls``),
    kept from now on by every put and delete."""
    db.execute(
        "UPDATE rollouts SET num_calls = (SELECT count(*) FROM calls c "
        "WHERE c.rollout_id = rollouts.rollout_id)"
    )
    db.execute("INSERT OR REPLACE INTO counters (name, value) SELECT 'calls', count(*) FROM calls")


def _count_chains(db: sqlite3.Connection) -> None:
    """Layout 8: the child digests out of the records' metadata, and each rollout's number of
    chains, of failed, incomplete and refused calls and its calls' diagnostic kinds, kept from
    now on by every put."""
    db.execute(
        "UPDATE calls SET child_digest = json_extract(meta, '$.linking.child_digest') "
        "WHERE json_valid(meta) AND json_extract(meta, '$.linking.child_digest') IS NOT NULL"
    )
    sql.recount_rollouts(sql.SQLITE, db)
