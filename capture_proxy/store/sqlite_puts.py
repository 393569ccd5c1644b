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
hold puts rolled back). A group of one put takes no savepoint: its refusal rolls the
transaction back. The store's count of calls (``counters``) is updated once per group.

What the writer remembers (``keep``: no other process writes the store) spares it statements
whose answer it knows: the JSON texts it stored, each rollout's prompt-parent index, and of
each rollout it stored a call of, that it is not deleted, whether it is frozen, and the status,
``StoredMessages`` and the JSON texts its prompt ancestry refers to of its calls stored lately
(a child's linked parent and prompt parent). Every other write transaction (delete, freeze,
retire, ...) forgets its rollout first (``SQLiteStore._transaction``).

A call's reference to a JSON text (``call_json``) is written unless its prompt parent or one of
that call's prompt ancestors holds it (a session's tools list and system prompt: every call
after the first refers to the texts its first call stored). Every read of a call reads its
prompt ancestors' texts too (``sql.blobs_of`` over ``ANCESTRY``, the rollout, or
``CHILDREN_ANCESTRY``), a prompt parent is a call of the same rollout, and only a delete of the
whole rollout deletes references: what a read finds is the same, and a put writes two pages
fewer (the ``call_json`` row and its index entry).

Writer thread only. Must not: open connections or threads (``sqlite``'s).
"""

from __future__ import annotations

import sqlite3
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.core.linking.record_digests import RecordDigests, token_states
from capture_proxy.core.prefixes import StoredPrefix
from capture_proxy.core.records import CallRecord, CallStatus
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.stored_form import (
    COLUMNS,
    EncodedRecord,
    StoredMessages,
    column_values,
)
from capture_proxy.store import image_rows, lifecycle, sql
from capture_proxy.store.prompt_parents import PromptParents
from capture_proxy.store.sql import SQLITE

#: Content addresses a writer remembers as stored (``SQLiteStore._stored_blobs``) at most.
_STORED_BLOBS_MAX = 4096
#: Rollouts whose state a writer remembers at most (least recently put dropped first), and
#: calls per rollout (the oldest dropped first: a child's parent is a recent call).
_KNOWN_ROLLOUTS_MAX = 4096
_KNOWN_CALLS_MAX = 64

# The codec's columns, then the store's own: ``late``, ``retry_of``, ``child_digest``,
# ``tokens_block_sha256``.
_INSERT_CALL = (
    f"INSERT OR IGNORE INTO calls ({sql.CALL_COLUMNS}, late, {sql.STORE_COLUMNS}, "
    "tokens_block_sha256) "
    f"VALUES ({','.join('?' * (len(COLUMNS) + 4))})"
)

# What a put needs of its rollout's state (``lifecycle``): tombstoned, frozen, and whether it
# holds calls (``rollouts.num_calls``, kept by every put and delete: when none, its prompt-parent
# index starts empty without a read). Key reads, none of the rollout's texts.
_PUT_STATE = (
    "SELECT EXISTS (SELECT 1 FROM tombstones WHERE rollout_id = ?), "
    "EXISTS (SELECT 1 FROM rollouts WHERE rollout_id = ? AND snapshot_id IS NOT NULL), "
    "EXISTS (SELECT 1 FROM rollouts WHERE rollout_id = ? AND num_calls > 0)"
)


@dataclass
class _Known:
    """A rollout the writer stored a call of in this process (``keep`` only), as of that put:
    not deleted (a delete forgets it), ``frozen`` or not (a freeze forgets it), and of its calls
    stored since, the latest ``_KNOWN_CALLS_MAX``: call id -> (``CallStatus`` value,
    ``StoredMessages``, the addresses of the JSON texts that ``call_json`` holds for the call
    or one of its prompt ancestors), what a child's put reads of its parents (none changes once
    stored: a re-put keeps the original)."""

    frozen: bool
    calls: dict[str, tuple[str, StoredMessages, frozenset[bytes]]] = field(default_factory=dict)

    def messages(self, call_id: str) -> StoredMessages | None:
        call = self.calls.get(call_id)
        return None if call is None else call[1]

    def texts(self, call_id: str | None) -> frozenset[bytes]:
        """The JSON texts a read of ``call_id`` finds through it and its prompt ancestors
        (empty when not remembered)."""
        call = None if call_id is None else self.calls.get(call_id)
        return _NO_TEXTS if call is None else call[2]


_NO_TEXTS: frozenset[bytes] = frozenset()


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
        #: the rollouts a put stored a call of, least recently put first (``_Known``)
        self.rollouts: OrderedDict[str, _Known] = OrderedDict()

    def forget(self, rollout_id: str | None) -> None:
        """Another write transaction (it may delete texts and the rollout's calls, freeze or
        delete the rollout); None: forget every rollout."""
        self.stored_blobs.clear()
        self.prompt_parents.forget(rollout_id)
        if rollout_id is None:
            self.rollouts.clear()
        else:
            self.rollouts.pop(rollout_id, None)

    def group(
        self, db: sqlite3.Connection, items: list[tuple[Any, ...]]
    ) -> list[tuple[int | None, BaseException | None]]:
        """Store ``items`` (``(record, request, digests)`` each: see ``one``) in one
        transaction: per item the bytes written or the error that refused it. Raises what fails
        the transaction itself (the commit, or an error after which SQLite rolled it back): no
        item is stored then."""
        outcomes: list[tuple[int | None, BaseException | None]] = []
        alone = len(items) == 1  # its refusal rolls the transaction back: no savepoint
        inserted = 0
        db.execute("BEGIN IMMEDIATE")
        try:
            for record, request, digests in items:
                if not alone:
                    db.execute("SAVEPOINT put")
                try:
                    written, new = self.one(db, record, request, digests)
                except Exception as exc:
                    if not db.in_transaction:
                        raise  # SQLite rolled the whole transaction back
                    if alone:  # nothing written, nothing remembered
                        db.execute("ROLLBACK")
                        return [(None, exc)]
                    db.execute("ROLLBACK TO put")
                    db.execute("RELEASE put")
                    outcomes.append((None, exc))
                    continue
                if not alone:
                    db.execute("RELEASE put")
                inserted += new
                outcomes.append((written, None))
            if inserted:
                db.execute(sql.COUNT_CALLS, (inserted,))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            self.forget(None)  # it may remember puts that were rolled back
            raise
        return outcomes

    def one(
        self,
        db: sqlite3.Connection,
        record: CallRecord,
        request: RequestEncoding | None,
        digests: RecordDigests | None = None,
    ) -> tuple[int, int]:
        """Store one record inside the open transaction: the bytes new to the store, and 1
        when the call is new (0: a re-put), which the caller adds to the store's count.
        ``digests``: the proxy's ``RecordDigests`` of the record (taken when they are of its
        very arrays: the prompt is not hashed again here), or None."""
        stored_blobs = self.stored_blobs
        prompt_parents = self.prompt_parents
        rollout_id = record.rollout_id
        prompt = record.prompt_token_ids
        # the prompt hashed once (or not at all here): parent, digests
        states, tokens_sha256, block_sha256 = token_states(record, digests)
        known = self.rollouts.get(rollout_id) if self.keep else None

        def body() -> tuple[int, bool, EncodedRecord | None]:
            has_calls = True
            if known is None:
                tombstoned, frozen, has_calls = db.execute(_PUT_STATE, (rollout_id,) * 3).fetchone()
                lifecycle.refuse_deleted(record, bool(tombstoned))
                frozen = bool(frozen)
            else:  # stored by this writer since its last other write: not deleted
                frozen = known.frozen
            may_recount = lifecycle.may_recount(record)
            links = sql.retry_family(SQLITE, db, record) if may_recount else []
            prompt_parent = prompt_parents.choose(
                db, rollout_id, prompt, record.call_id, states, empty=not has_calls
            )
            enc = lifecycle.encode_with_parent(
                record,
                request,
                prompt_parent,
                lambda c: (known and known.messages(c)) or sql.stored_messages(SQLITE, db, c),
                tokens_sha256,
            )
            written = 0
            own = sql.store_columns(record)
            block = block_sha256 if _is_prompt_parent(record) else None
            cur = db.execute(_INSERT_CALL, (*column_values(enc), frozen, *own, block))
            inserted = bool(cur.rowcount)
            if inserted:
                held = _NO_TEXTS if known is None else known.texts(enc.prompt_parent_call_id)
                written = sql.encoded_bytes(enc) + sql.store_json(
                    SQLITE, db, enc, known=stored_blobs, held=held
                )
                written += image_rows.store_images(SQLITE, db, record)
            else:
                row = db.execute(sql.STORED_CALL, (enc.call_id,)).fetchone()
                lifecycle.check_re_put(None if row is None else sql.encoded_row(row), enc)
            effect = lifecycle.call_effect(record, frozen=frozen, inserted=inserted)
            counted = effect.version_delta and record.linkable and record.linking is not None
            parent = self._parent_status(db, record, known) if counted else None
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
            return written, frozen, enc if inserted else None  # a re-put's texts may be others

        written, frozen, stored = body()
        if self.keep:  # no other writer (rolled back: ``forget``)
            self._remember(record, frozen, stored, tokens_sha256, block_sha256, known)
        return written, int(stored is not None)

    def _parent_status(
        self, db: sqlite3.Connection, record: CallRecord, known: _Known | None
    ) -> str | None:
        """``sql.parent_status``, from memory when this writer stored the parent lately."""
        parent = record.parent_call_id
        if known is not None and parent is not None:
            call = known.calls.get(parent)
            if call is not None:
                return call[0]
        return sql.parent_status(SQLITE, db, record)

    def _remember(
        self,
        record: CallRecord,
        frozen: bool,
        stored: EncodedRecord | None,
        tokens_sha256: bytes,
        block_sha256: bytes,
        before: _Known | None,
    ) -> None:
        """What a put that succeeded tells the writer (``keep`` only): the rollout's state,
        and for a call inserted (``stored``) its status, texts and prefix. ``before``: the
        rollout as the put found it remembered (its prompt parent's texts)."""
        rollout_id = record.rollout_id
        known = self.rollouts.get(rollout_id)
        if known is None:
            known = self.rollouts[rollout_id] = _Known(frozen)
            if len(self.rollouts) > _KNOWN_ROLLOUTS_MAX:
                self.rollouts.popitem(last=False)
        else:
            self.rollouts.move_to_end(rollout_id)
        if stored is None:
            return
        own = {bytes.fromhex(sha) for sha in stored.json_blobs}
        # ``before`` is None when the put read the rollout's state (the parent's texts unknown:
        # its references were all written)
        held = _NO_TEXTS if before is None else before.texts(stored.prompt_parent_call_id)
        texts = held if own <= held else held | own
        calls = known.calls
        calls[record.call_id] = (
            stored.status,
            StoredMessages(
                stored.call_id,
                stored.prompt_parent_call_id,
                stored.messages_prefix_len,
                stored.num_messages,
                stored.messages_chain,
            ),
            texts,
        )
        if len(calls) > _KNOWN_CALLS_MAX:
            del calls[next(iter(calls))]
        stored_blobs = self.stored_blobs
        if len(stored_blobs) > _STORED_BLOBS_MAX:
            stored_blobs.clear()
        stored_blobs.update(own)
        if _is_prompt_parent(record):
            n = record.num_prompt_tokens + record.num_generation_tokens
            call = StoredPrefix(record.call_id, record.created_at, n, tokens_sha256)
            self.prompt_parents.stored(rollout_id, call, block_sha256)
