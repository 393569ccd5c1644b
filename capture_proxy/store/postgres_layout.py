"""The shared store's table layout: ``MIGRATIONS``, one step per layout version, each recorded
in ``schema_migrations``, and their application on open.

Owns the DDL of ``postgres.py``'s database (the tables of ``sqlite_layout.py``, in PostgreSQL's
types). ``migrate_layout`` applies the missing steps in one transaction under a global advisory
lock (replicas starting together migrate once), refuses a layout newer than it knows, and
rewrites records older than the codec's schema version (``sql.migrate_records``; none today:
this store began at v3). Must not hold a store operation's SQL (``sql.py``, ``postgres.py``).
"""

from __future__ import annotations

import time
from typing import Any

from capture_proxy.store import sql
from capture_proxy.store.base import StoreError

#: Advisory lock key held while migrating (any constant; "capture" in ASCII).
_MIGRATION_LOCK = 0x63617074757265

#: One step per layout version; applied in order, each recorded in ``schema_migrations``.
MIGRATIONS: tuple[str, ...] = (
    # 1: the layout of schema v3 records (sqlite.py's LAYOUT_VERSION 3).
    """
    CREATE TABLE calls (
        call_id text PRIMARY KEY,
        rollout_id text NOT NULL,
        created_at double precision NOT NULL,
        status text NOT NULL,
        schema_version integer NOT NULL,
        meta text NOT NULL,
        prompt_token_ids bytea NOT NULL,
        generation_token_ids bytea NOT NULL,
        generation_log_probs bytea NOT NULL,
        routed_experts bytea,
        prompt_parent_call_id text,
        prompt_prefix_len integer NOT NULL DEFAULT 0,
        num_prompt_tokens integer NOT NULL DEFAULT 0,
        num_generation_tokens integer NOT NULL DEFAULT 0,
        tokens_sha256 bytea NOT NULL DEFAULT '',
        messages_delta text NOT NULL DEFAULT '[]',
        messages_prefix_len integer NOT NULL DEFAULT 0,
        num_messages integer NOT NULL DEFAULT 0,
        messages_sha256 bytea NOT NULL DEFAULT '',
        messages_chain bytea NOT NULL DEFAULT ''
    );
    CREATE INDEX calls_by_rollout ON calls (rollout_id, created_at, call_id);
    CREATE TABLE json_blobs (
        sha256 bytea PRIMARY KEY,
        json text NOT NULL
    );
    CREATE TABLE call_json (
        call_id text NOT NULL,
        sha256 bytea NOT NULL REFERENCES json_blobs (sha256),
        PRIMARY KEY (call_id, sha256)
    );
    CREATE INDEX call_json_by_sha ON call_json (sha256);
    CREATE TABLE tombstones (
        rollout_id text PRIMARY KEY,
        deleted_at double precision NOT NULL
    );
    CREATE TABLE rollouts (
        rollout_id text PRIMARY KEY,
        created_at double precision NOT NULL,
        incomplete boolean NOT NULL DEFAULT false,
        diagnostics text NOT NULL DEFAULT '[]'
    );
    """,
    # 2: the lifecycle (sqlite.py's LAYOUT_VERSION 4): snapshots, late calls, metadata,
    # retirements, the store-wide export cursor. Before it every stored call counted, so a
    # rollout's revision is its number of calls.
    """
    ALTER TABLE calls ADD COLUMN late boolean NOT NULL DEFAULT false;
    ALTER TABLE rollouts
        ADD COLUMN version bigint NOT NULL DEFAULT 0,
        ADD COLUMN metadata text NOT NULL DEFAULT '{}',
        ADD COLUMN snapshot_id text,
        ADD COLUMN frozen_at double precision,
        ADD COLUMN frozen_num_calls integer,
        ADD COLUMN export_cursor bigint;
    ALTER TABLE tombstones
        ADD COLUMN snapshot_id text,
        ADD COLUMN version bigint,
        ADD COLUMN deleted_calls integer;
    UPDATE rollouts SET version = (SELECT count(*) FROM calls c
        WHERE c.rollout_id = rollouts.rollout_id);
    CREATE UNIQUE INDEX rollouts_by_cursor ON rollouts (export_cursor)
        WHERE export_cursor IS NOT NULL;
    CREATE TABLE counters (
        name text PRIMARY KEY,
        value bigint NOT NULL
    );
    INSERT INTO counters (name, value) VALUES ('export_cursor', 0);
    """,
    # 3: the retry link as a column (sqlite.py's LAYOUT_VERSION 5) and the rollout's count of
    # incomplete calls no complete retry supersedes (``core.completeness``; counted after the
    # steps, ``_count_incomplete_calls``); ``rollouts.incomplete`` says from now on only that
    # a rollout-level diagnostic marked it (``mark_rollout_incomplete`` always adds one).
    """
    ALTER TABLE calls ADD COLUMN retry_of text;
    ALTER TABLE rollouts ADD COLUMN incomplete_calls integer NOT NULL DEFAULT 0;
    UPDATE calls SET retry_of = meta::json ->> 'retry_of'
        WHERE meta::json ->> 'retry_of' IS NOT NULL;
    UPDATE rollouts SET incomplete = false WHERE diagnostics = '[]';
    """,
    # 4: the indexes that keep a put's reads bounded whatever the rollout's size (sqlite.py's
    # LAYOUT_VERSION 6): prompt-parent candidates by prompt + generation length, the retry
    # links, the late calls.
    """
    CREATE INDEX IF NOT EXISTS calls_by_prefix ON calls
        (rollout_id, (num_prompt_tokens + num_generation_tokens))
        WHERE status = 'complete' AND num_generation_tokens > 0;
    CREATE INDEX IF NOT EXISTS calls_retry_links ON calls (rollout_id)
        WHERE NOT late AND (status = 'incomplete' OR retry_of IS NOT NULL);
    CREATE INDEX IF NOT EXISTS calls_late ON calls (rollout_id, created_at, call_id) WHERE late;
    """,
    # 5: the rollout's number of calls, kept by every put and delete, so that a listing reads
    # it instead of counting the rollout's rows (sqlite.py's LAYOUT_VERSION 7).
    """
    ALTER TABLE rollouts ADD COLUMN num_calls bigint NOT NULL DEFAULT 0;
    UPDATE rollouts SET num_calls = (SELECT count(*) FROM calls c
        WHERE c.rollout_id = rollouts.rollout_id);
    """,
    # 6: the number of chains a listing reads and the viewer list's counts (counted after the
    # steps, ``recount_rollouts``),
    # the retry family's index and the child digest a replica's refresh reads by (sqlite.py's
    # LAYOUT_VERSION 8).
    """
    ALTER TABLE rollouts ADD COLUMN IF NOT EXISTS num_chains bigint DEFAULT 0,
        ADD COLUMN IF NOT EXISTS num_failed bigint NOT NULL DEFAULT 0,
        ADD COLUMN IF NOT EXISTS num_incomplete bigint NOT NULL DEFAULT 0,
        ADD COLUMN IF NOT EXISTS num_refused bigint NOT NULL DEFAULT 0;
    CREATE TABLE IF NOT EXISTS rollout_kinds (
        rollout_id text NOT NULL,
        kind text NOT NULL,
        PRIMARY KEY (rollout_id, kind)
    );
    ALTER TABLE calls ADD COLUMN IF NOT EXISTS child_digest text;
    UPDATE calls SET child_digest = meta::json -> 'linking' ->> 'child_digest'
        WHERE meta::json -> 'linking' ->> 'child_digest' IS NOT NULL;
    CREATE INDEX IF NOT EXISTS calls_by_retry_of ON calls (rollout_id, retry_of)
        WHERE retry_of IS NOT NULL;
    CREATE INDEX IF NOT EXISTS calls_by_child_digest ON calls (rollout_id, child_digest)
        WHERE child_digest IS NOT NULL;
    """,
    # 7: the block digest a put's prompt parent is found by (``prefixes.token_digests``;
    # sqlite.py's LAYOUT_VERSION 9): the candidates of a block or more are those filed under
    # one of the prompt's block digests, not every call of the rollout in the length range.
    # NULL in rows written before (read aside, as before).
    """
    ALTER TABLE calls ADD COLUMN IF NOT EXISTS tokens_block_sha256 bytea;
    CREATE INDEX IF NOT EXISTS calls_by_block ON calls (rollout_id, tokens_block_sha256)
        WHERE status = 'complete' AND num_generation_tokens > 0;
    """,
    # 8: the images of calls (sqlite.py's LAYOUT_VERSION 10): one row per image,
    # content-addressed by the SHA-256 of its bytes, and which calls carry it.
    """
    CREATE TABLE IF NOT EXISTS images (
        sha256 bytea PRIMARY KEY,
        media_type text NOT NULL,
        width integer NOT NULL,
        height integer NOT NULL,
        data bytea NOT NULL
    );
    CREATE TABLE IF NOT EXISTS call_images (
        call_id text NOT NULL,
        sha256 bytea NOT NULL REFERENCES images (sha256),
        PRIMARY KEY (call_id, sha256)
    );
    CREATE INDEX IF NOT EXISTS call_images_by_sha ON call_images (sha256);
    """,
)
LAYOUT_VERSION = len(MIGRATIONS)


def migrate_layout(db: Any, where: str) -> None:
    """Apply the missing steps of ``MIGRATIONS`` and rewrite older records, in one
    transaction under the migration lock (a crash leaves the old layout). ``where``: the
    store's redacted URL, for the error raised (StoreError) on a newer layout."""
    with db.transaction():
        db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY, "
            "applied_at double precision NOT NULL)"
        )
        row = db.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()
        version = int(row[0])
        if version > LAYOUT_VERSION:
            raise StoreError(
                f"store at {where} has layout {version}; this reader knows up to {LAYOUT_VERSION}"
            )
        for step in range(version + 1, LAYOUT_VERSION + 1):
            db.execute(MIGRATIONS[step - 1])
            db.execute(
                "INSERT INTO schema_migrations (version, applied_at) VALUES (%s, %s)",
                (step, time.time()),
            )
        if version < 3:
            # Layout 3: count each rollout's incomplete calls (after ``retry_of`` is filled).
            sql.recount_incomplete_calls(sql.POSTGRES, db)
        sql.migrate_records(sql.POSTGRES, db)
        if version < 6:
            # Layout 6: count each rollout's chains (its records in the current schema).
            sql.recount_rollouts(sql.POSTGRES, db)
