"""The SQLite writer's puts: one call's statements, and group commit.

Owns ``put_call`` on the writer thread: the statements of one call (its rollout's state, the
prompt parent, the row, its JSON texts, the rollout's counters), what the writer remembers of
the calls it stored (the JSON texts' addresses, each rollout's prompt-parent index) and the
transaction around them. ``group`` stores the puts the writer thread took together
(``worker.WorkerThread.run_grouped``: every put queued while the previous commit ran) in ONE
transaction, each under its own savepoint: a put refused (deleted rollout, conflicting
re-put) is rolled back alone and answered with its error; the others commit together, with
one fsync under ``synchronous=FULL``. No put is answered before the commit that holds it
returned, so a put that returned is as durable as before; the fsync's cost is shared by the
calls that waited for it (at 16 clients in one rollout, about one commit per several calls).
A failed commit fails every put of the group and drops what the writer remembered (it may
hold puts rolled back).

Writer thread only. Must not: open connections or threads (``sqlite``'s).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from capture_proxy.core.codec import RequestEncoding
from capture_proxy.core.prefixes import StoredPrefix, block_states, token_digests
from capture_proxy.core.records import CallRecord, CallStatus
from capture_proxy.core.stored_form import COLUMNS, EncodedRecord, column_values
from capture_proxy.store import image_rows, lifecycle, sql
from capture_proxy.store.prompt_parents import PromptParents
from capture_proxy.store.sql import SQLITE

#: Content addresses a writer remembers as stored (``SQLiteStore._stored_blobs``) at most.
_STORED_BLOBS_MAX = 4096

# The codec's columns, then the store's own: ``late``, ``retry_of``, ``child_digest``,
# ``tokens_block_sha256``.
_INSERT_CALL = (
    f"INSERT OR IGNORE INTO calls ({sql.CALL_COLUMNS}, late, {sql.STORE_COLUMNS}, "
    "tokens_block_sha256) "
    f"VALUES ({','.join('?' * (len(COLUMNS) + 4))})"
)

# What a put needs of its rollout's state (``lifecycle``): tombstoned, frozen (two key reads,
# none of the rollout's texts).
_PUT_STATE = (
    "SELECT EXISTS (SELECT 1 FROM tombstones WHERE rollout_id = ?), "
    "EXISTS (SELECT 1 FROM rollouts WHERE rollout_id = ? AND snapshot_id IS NOT NULL)"
)


def _is_prompt_parent(record: CallRecord) -> bool:
    """A call later prompts may extend (``prefixes``): complete, with output."""
    return record.status is CallStatus.COMPLETE and record.num_generation_tokens > 0


class SQLitePuts:
    """The writer's puts and its memory of them. ``keep``: remember stored texts and prompt
    parents across transactions (only when no other process writes the store)."""

    def __init__(self, *, keep: bool) -> None:
        self.keep = keep
        #: Content addresses of JSON texts committed by this writer and not deleted since: a
        #: put skips their insert (a session's tools list is on every call). Cleared by every
        #: other write transaction, the only ones that delete texts.
        self.stored_blobs: set[bytes] = set()
        #: each rollout's stored calls by their token prefixes: a put's prompt parent without
        #: reading the rollout's other rows
        self.prompt_parents = PromptParents()

    def forget(self, rollout_id: str | None) -> None:
        """Another write transaction (it may delete texts and the rollout's calls); None:
        forget every rollout."""
        self.stored_blobs.clear()
        self.prompt_parents.forget(rollout_id)

    def group(
        self, db: sqlite3.Connection, items: list[tuple[Any, ...]]
    ) -> list[tuple[int | None, BaseException | None]]:
        """Store ``items`` (``(record, request)`` each) in one transaction: per item the bytes
        written or the error that refused it. Raises what fails the transaction itself (the
        commit, or an error after which SQLite rolled it back): no item is stored then."""
        outcomes: list[tuple[int | None, BaseException | None]] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            for record, request in items:
                db.execute("SAVEPOINT put")
                try:
                    written = self.one(db, record, request)
                except Exception as exc:
                    if not db.in_transaction:
                        raise  # SQLite rolled the whole transaction back
                    db.execute("ROLLBACK TO put")
                    db.execute("RELEASE put")
                    outcomes.append((None, exc))
                    continue
                db.execute("RELEASE put")
                outcomes.append((written, None))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            self.forget(None)  # it may remember puts that were rolled back
            raise
        return outcomes

    def one(
        self, db: sqlite3.Connection, record: CallRecord, request: RequestEncoding | None
    ) -> int:
        """Store one record inside the open transaction; the bytes new to the store."""
        stored_blobs = self.stored_blobs
        prompt_parents = self.prompt_parents
        prompt = record.prompt_token_ids
        states = block_states(prompt)  # the prompt hashed once: parent, digests
        tokens_sha256, block_sha256 = token_digests(prompt, record.generation_token_ids, states)

        def body() -> tuple[int, EncodedRecord | None]:
            tombstoned, frozen = db.execute(_PUT_STATE, (record.rollout_id,) * 2).fetchone()
            lifecycle.refuse_deleted(record, bool(tombstoned))
            frozen = bool(frozen)
            may_recount = lifecycle.may_recount(record)
            links = sql.retry_family(SQLITE, db, record) if may_recount else []
            prompt_parent = prompt_parents.choose(
                db, record.rollout_id, prompt, record.call_id, states
            )
            enc = lifecycle.encode_with_parent(
                record,
                request,
                prompt_parent,
                lambda c: sql.stored_messages(SQLITE, db, c),
                tokens_sha256,
            )
            written = 0
            own = sql.store_columns(record)
            block = block_sha256 if _is_prompt_parent(record) else None
            cur = db.execute(_INSERT_CALL, (*column_values(enc), frozen, *own, block))
            inserted = bool(cur.rowcount)
            if inserted:
                written = sql.encoded_bytes(enc) + sql.store_json(
                    SQLITE, db, enc, known=stored_blobs
                )
                written += image_rows.store_images(SQLITE, db, record)
                db.execute(sql.COUNT_CALLS, (1,))
            else:
                row = db.execute(sql.STORED_CALL, (enc.call_id,)).fetchone()
                lifecycle.check_re_put(None if row is None else sql.encoded_row(row), enc)
            effect = lifecycle.call_effect(record, frozen=frozen, inserted=inserted)
            counted = effect.version_delta and record.linkable and record.linking is not None
            parent = sql.parent_status(SQLITE, db, record) if counted else None
            incomplete, chains = lifecycle.count_deltas(record, effect, links, parent)
            tally = lifecycle.call_tally(record) if inserted else (0, 0, 0)
            db.execute(
                SQLITE.sql(sql.UPSERT_ROLLOUT),
                (
                    enc.rollout_id,
                    enc.created_at,
                    incomplete,
                    effect.version_delta,
                    int(inserted),
                    chains,
                    *tally,
                ),
            )
            if inserted:
                sql.keep_kinds(SQLITE, db, enc.rollout_id, (d.kind for d in record.diagnostics))
            return written, enc if inserted else None  # a re-put's texts may be others

        written, stored = body()
        if stored is not None and self.keep:  # no other writer (rolled back: ``forget``)
            if len(stored_blobs) > _STORED_BLOBS_MAX:
                stored_blobs.clear()
            stored_blobs.update(bytes.fromhex(sha) for sha in stored.json_blobs)
            if _is_prompt_parent(record):
                n = record.num_prompt_tokens + record.num_generation_tokens
                call = StoredPrefix(record.call_id, record.created_at, n, tokens_sha256)
                prompt_parents.stored(record.rollout_id, call, block_sha256)
        return written
