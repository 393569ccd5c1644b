"""The SQL both stores run, written once over a ``Dialect`` (the placeholder style and the few
places where SQLite and PostgreSQL spell a thing differently): the statements, the steps that
several operations share (a rollout's state, its retry links, deleting its rows, keeping JSON
texts, the export cursor) and the record migrations of both layouts. ``SQLITE`` and
``POSTGRES`` are the two dialects.

Owns no connection, no thread and no transaction: each function runs its statements on the
connection it is given, inside the caller's transaction. The operations' transaction bodies
are ``transactions.py``'s; ``put_call``'s are each store's own.

Statements are written with ``?`` placeholders and ``{word}`` slots (``Dialect.words``);
``Dialect.sql`` turns a template into the dialect's text once and caches it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from capture_proxy.core.chain_counts import kept_chains
from capture_proxy.core.codec import SCHEMA_VERSION, decode_records
from capture_proxy.core.completeness import RetryLink, unsuperseded_incomplete
from capture_proxy.core.record_migrations import migrate, rebase_messages
from capture_proxy.core.records import CallRecord
from capture_proxy.core.stored_form import COLUMNS, EncodedRecord, StoredMessages, column_values
from capture_proxy.store import lifecycle
from capture_proxy.store.image_rows import delete_images
from capture_proxy.store.lifecycle import LifecycleRow, Tombstone

T = TypeVar("T")
#: A driver connection (``sqlite3.Connection``, ``psycopg.Connection``): ``execute(sql,
#: args)`` returning a cursor with ``fetchone``, ``fetchall`` and ``rowcount``.
Conn = Any


@dataclass(frozen=True)
class Dialect:
    """How one database spells what the shared statements need.

    ``placeholder``: the driver's parameter marker (``?``, ``%s``). ``words``: the text of each
    ``{slot}`` of a template: ``late`` and ``not_late`` (a call's late flag, spelled as the
    partial indexes' WHERE clauses are, so the planner may use them), ``late_ids`` (an
    aggregate of a rollout's late call ids, ordered; ``late_ids_of`` reads its value) and
    ``text_order`` (a collation that orders text by bytes, or empty). ``no_limit``: the LIMIT
    value meaning "all rows". ``read_options``: keyword arguments of ``execute`` for reads of
    whole call rows (PostgreSQL: binary results). ``counts_calls``: the store keeps its number
    of calls in the ``counters`` row ``calls`` (SQLite, for ``/health``; PostgreSQL's replicas
    would all wait on one row, and its health reads the planner's estimate)."""

    name: str
    placeholder: str
    words: dict[str, str]
    no_limit: int | None
    late_ids_of: Callable[[Any], Iterable[str]]
    read_options: dict[str, Any] = field(default_factory=dict)
    counts_calls: bool = False
    _texts: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def sql(self, template: str) -> str:
        """``template`` in this dialect (its ``{slots}`` filled, ``?`` as ``placeholder``)."""
        text = self._texts.get(template)
        if text is None:
            text = template.format_map(self.words).replace("?", self.placeholder)
            self._texts[template] = text
        return text


# In ``EncodedRecord`` field order.
CALL_COLUMNS = ", ".join(COLUMNS)
# The store's own columns of a call after ``late`` (``store_columns``): the call it retries,
# and the digest under which a child finds it (``linking.child_digest``), indexed so that a
# replica's index refresh reads only the calls a history can continue (``CHILDREN_OF``).
STORE_COLUMNS = "retry_of, child_digest"
STORED_CALL = f"SELECT {CALL_COLUMNS} FROM calls WHERE call_id = ?"
# A rollout's tombstone and ``rollouts`` row (``lifecycle.state_of``); one row, NULLs for none.
STATE = (
    f"SELECT {lifecycle.STATE_COLUMNS} FROM (SELECT CAST(? AS TEXT) AS id) k "
    "LEFT JOIN tombstones t ON t.rollout_id = k.id LEFT JOIN rollouts r ON r.rollout_id = k.id"
)
# The calls completeness depends on (``core.completeness``): counted, incomplete or a retry
# (a migration's recount; a put reads only its call's ``RETRY_FAMILY``).
RETRY_LINKS = (
    "SELECT call_id, status, retry_of FROM calls WHERE rollout_id = ? AND {not_late} "
    "AND (status = 'incomplete' OR retry_of IS NOT NULL)"
)
# The stored members of a new call's retry family (the calls ``retry_of`` joins it to), as
# ``RetryLink`` rows, the call itself left out: up from the call it retries (primary key), then
# down from each of those and from the call (``calls_by_retry_of``); CROSS JOIN keeps SQLite's
# join order, so that every step is an index search. Parameters: the call's
# ``retry_of``, the rollout, the call id, the rollout, the rollout, the call id. Only these
# calls' completeness and chains can change when it is stored: the rows read are the family's,
# however many retries and incomplete calls the rollout holds. (No late call is read: counts
# change only before the freeze, when there is none.)
RETRY_FAMILY = (
    "WITH RECURSIVE up(id) AS (SELECT CAST(? AS TEXT) UNION SELECT c.retry_of FROM up "
    "CROSS JOIN calls c WHERE c.call_id = up.id AND c.rollout_id = ? AND c.retry_of IS NOT NULL), "
    "down(id) AS (SELECT id FROM up WHERE id IS NOT NULL UNION SELECT CAST(? AS TEXT) "
    "UNION SELECT c.call_id FROM down CROSS JOIN calls c "
    "WHERE c.rollout_id = ? AND c.retry_of = down.id) "
    "SELECT c.call_id, c.status, c.retry_of FROM down CROSS JOIN calls c "
    "WHERE c.call_id = down.id AND c.rollout_id = ? AND c.call_id <> ?"
)
# The status of a new call's linked parent when it is stored in the rollout (``chain_counts``).
PARENT_STATUS = "SELECT status FROM calls WHERE call_id = ? AND rollout_id = ?"
# A late call (``version`` + 0) changes neither the revision nor the counts of incomplete calls
# and chains. ``num_calls`` + 1 for a call inserted (+ 0 for a re-put), and so ``num_failed``,
# ``num_incomplete`` and ``num_refused`` (``lifecycle.call_tally``, late calls included);
# ``incomplete_calls`` and ``num_chains`` by their deltas (``core.chain_counts``; a NULL
# delta: the number of chains is no longer kept, and stays NULL).
UPSERT_ROLLOUT = (
    "INSERT INTO rollouts (rollout_id, created_at, incomplete_calls, version, num_calls, "
    "num_chains, num_failed, num_incomplete, num_refused) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (rollout_id) DO UPDATE SET "
    "incomplete_calls = rollouts.incomplete_calls + excluded.incomplete_calls, "
    "version = rollouts.version + excluded.version, "
    "num_calls = rollouts.num_calls + excluded.num_calls, "
    "num_chains = rollouts.num_chains + excluded.num_chains, "
    "num_failed = rollouts.num_failed + excluded.num_failed, "
    "num_incomplete = rollouts.num_incomplete + excluded.num_incomplete, "
    "num_refused = rollouts.num_refused + excluded.num_refused"
)
# A diagnostic kind found on a call of the rollout (``rollout_kinds``, for the viewer's list).
KEEP_KIND = "INSERT INTO rollout_kinds (rollout_id, kind) VALUES (?, ?) ON CONFLICT DO NOTHING"
# The store's number of calls (``Dialect.counts_calls``), by a signed delta.
COUNT_CALLS = "UPDATE counters SET value = value + ? WHERE name = 'calls'"
# The JSON texts the calls of a subquery of call ids refer to (the subquery follows).
_BLOBS_OF = (
    "SELECT b.sha256, b.json FROM json_blobs b WHERE b.sha256 IN "
    "(SELECT j.sha256 FROM call_json j WHERE j.call_id IN ("
)
ANCESTRY = (
    "WITH RECURSIVE anc(id) AS (SELECT CAST(? AS TEXT) UNION ALL SELECT c.prompt_parent_call_id "
    "FROM calls c JOIN anc ON c.call_id = anc.id "
    "WHERE c.prompt_parent_call_id IS NOT NULL) "
)
ROLLOUT_CALLS = "SELECT call_id FROM calls WHERE rollout_id = ?"
# A rollout's calls with a child digest (``calls_by_child_digest``), and them with their prompt
# ancestors (to decode them).
CHILDREN_OF = "SELECT call_id FROM calls WHERE rollout_id = ? AND child_digest = ?"
CHILDREN_ANCESTRY = (
    f"WITH RECURSIVE anc(id) AS ({CHILDREN_OF} UNION SELECT c.prompt_parent_call_id "
    "FROM calls c JOIN anc ON c.call_id = anc.id WHERE c.prompt_parent_call_id IS NOT NULL) "
)
ROLLOUT_SELECT = (
    "SELECT r.rollout_id, r.created_at, r.incomplete OR r.incomplete_calls > 0, "
    "r.diagnostics, r.num_calls, "
    "r.version, r.metadata, r.snapshot_id, r.frozen_at, r.frozen_num_calls, r.export_cursor, "
    "r.num_chains, r.num_failed, r.num_incomplete, r.num_refused, {call_kinds}, {late_ids} "
    "FROM rollouts r"
)


def encoded_row(row: Iterable[Any], blobs: dict[str, str] | None = None) -> EncodedRecord:
    """An ``EncodedRecord`` from a ``calls`` row of ``CALL_COLUMNS`` (buffers as ``bytes``:
    psycopg may hand back ``memoryview``-like values in binary mode); ``blobs``: its JSON."""
    values: list[Any] = [bytes(v) if isinstance(v, memoryview) else v for v in row]
    encoded = EncodedRecord(*values)
    return encoded if blobs is None else dataclasses.replace(encoded, json_blobs=blobs)


def encoded_bytes(enc: EncodedRecord) -> int:
    """The bytes of a call's own row: metadata, arrays and message delta (not the database's
    page overhead)."""
    return (
        _utf8_len(enc.meta)
        + len(enc.prompt_token_ids)
        + len(enc.generation_token_ids)
        + len(enc.generation_log_probs)
        + len(enc.routed_experts or b"")
        + _utf8_len(enc.messages_delta)
    )


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


def blobs_of(d: Dialect, db: Conn, calls_sql: str, args: tuple[Any, ...]) -> dict[str, str]:
    """The JSON texts (SHA-256 hex -> text) the calls of ``calls_sql`` (a template selecting
    call ids) refer to."""
    rows = db.execute(d.sql(_BLOBS_OF + calls_sql + "))"), args).fetchall()
    return {bytes(sha).hex(): text for sha, text in rows}


def store_json(
    d: Dialect,
    db: Conn,
    enc: EncodedRecord,
    *,
    count: bool = True,
    known: Container[bytes] = frozenset(),
    held: Container[bytes] = frozenset(),
) -> int:
    """Keep the record's content-addressed JSON (once per content) and its references, in
    SHA-256 order (one lock order across transactions). Returns the UTF-8 bytes of the texts
    new to the store (0 when not ``count``: PostgreSQL's pipelined put reads no row counts).
    ``known``: addresses whose texts the caller knows are stored (their insert is skipped; only
    the reference is written). ``held``: addresses the record's prompt parent or one of its
    prompt ancestors refers to (``call_json``), which every read of the record reads too:
    neither the text nor the reference is written."""
    written = 0
    for sha, text in sorted(enc.json_blobs.items()):
        key = bytes.fromhex(sha)
        if key in held:
            continue
        if key not in known:
            cur = db.execute(
                d.sql("INSERT INTO json_blobs (sha256, json) VALUES (?, ?) ON CONFLICT DO NOTHING"),
                (key, text),
            )
            if count and cur.rowcount > 0:
                written += len(text.encode())
        db.execute(
            d.sql("INSERT INTO call_json (call_id, sha256) VALUES (?, ?) ON CONFLICT DO NOTHING"),
            (enc.call_id, key),
        )
    return written


def stored_messages(d: Dialect, db: Conn, call_id: str) -> StoredMessages | None:
    """The ``StoredMessages`` of a stored call, or None."""
    row = db.execute(
        d.sql(
            "SELECT prompt_parent_call_id, messages_prefix_len, num_messages, messages_chain "
            "FROM calls WHERE call_id = ?"
        ),
        (call_id,),
    ).fetchone()
    return StoredMessages(call_id, row[0], row[1], row[2], bytes(row[3])) if row else None


def retry_links(d: Dialect, db: Conn, rollout_id: str) -> list[RetryLink]:
    """The rollout's counted calls that completeness depends on (``RETRY_LINKS``)."""
    return [RetryLink(*r) for r in db.execute(d.sql(RETRY_LINKS), (rollout_id,)).fetchall()]


def store_columns(record: CallRecord) -> tuple[str | None, str | None]:
    """The values of ``STORE_COLUMNS`` for ``record``."""
    linking = record.linking
    return record.retry_of, None if linking is None else linking.get("child_digest")


def keep_kinds(d: Dialect, db: Conn, rollout_id: str, kinds: Iterable[str]) -> None:
    """Note the diagnostic kinds of a new call in ``rollout_kinds`` (sorted: one lock order)."""
    for kind in sorted(set(kinds)):
        db.execute(d.sql(KEEP_KIND), (rollout_id, kind))


def retry_family(d: Dialect, db: Conn, record: CallRecord) -> list[RetryLink]:
    """The stored members of ``record``'s retry family (``RETRY_FAMILY``)."""
    rid, cid = record.rollout_id, record.call_id
    args = (record.retry_of, rid, cid, rid, rid, cid)
    return [RetryLink(*r) for r in db.execute(d.sql(RETRY_FAMILY), args).fetchall()]


def parent_status(d: Dialect, db: Conn, record: CallRecord) -> str | None:
    """The status of ``record``'s linked parent when stored in its rollout (``PARENT_STATUS``),
    else None; None without a parent."""
    if record.parent_call_id is None:
        return None
    row = db.execute(d.sql(PARENT_STATUS), (record.parent_call_id, record.rollout_id)).fetchone()
    return None if row is None else str(row[0])


def state(d: Dialect, db: Conn, rollout_id: str) -> tuple[Tombstone | None, LifecycleRow | None]:
    """The rollout's tombstone and ``rollouts`` row (``lifecycle.state_of``), one statement."""
    return lifecycle.state_of(db.execute(d.sql(STATE), (rollout_id,)).fetchone())


def next_cursor(d: Dialect, db: Conn) -> int:
    """The next export cursor, from the ``counters`` row (inside the caller's transaction).

    Not a SEQUENCE: ``nextval`` is handed out outside transactions, so a freeze could take 5,
    commit after another's 6, and a trainer that had already read past 6 would never see it.
    The row update holds the row's lock until COMMIT: freezes take cursors one at a time, each
    after the previous one committed (or rolled back, giving its number back), so cursors
    commit in increasing order."""
    row = db.execute(
        d.sql(
            "INSERT INTO counters (name, value) VALUES ('export_cursor', 1) "
            "ON CONFLICT (name) DO UPDATE SET value = counters.value + 1 RETURNING value"
        )
    ).fetchone()
    return int(row[0])


def delete_rows(d: Dialect, db: Conn, rollout_id: str) -> int:
    """Delete a rollout's calls, their unshared JSON texts and its bookkeeping (inside the
    caller's transaction). Returns the number of calls deleted."""
    shas = [
        bytes(r[0])
        for r in db.execute(
            d.sql(f"SELECT DISTINCT sha256 FROM call_json WHERE call_id IN ({ROLLOUT_CALLS})"),
            (rollout_id,),
        ).fetchall()
    ]
    db.execute(d.sql(f"DELETE FROM call_json WHERE call_id IN ({ROLLOUT_CALLS})"), (rollout_id,))
    for sha in sorted(shas):  # texts no remaining call refers to, in one lock order
        db.execute(
            d.sql(
                "DELETE FROM json_blobs WHERE sha256 = ? AND NOT EXISTS "
                "(SELECT 1 FROM call_json WHERE sha256 = ?)"
            ),
            (sha, sha),
        )
    delete_images(d, db, rollout_id)
    deleted = db.execute(d.sql("DELETE FROM calls WHERE rollout_id = ?"), (rollout_id,)).rowcount
    db.execute(d.sql("DELETE FROM rollouts WHERE rollout_id = ?"), (rollout_id,))
    db.execute(d.sql("DELETE FROM rollout_kinds WHERE rollout_id = ?"), (rollout_id,))
    if d.counts_calls and deleted:
        db.execute(d.sql(COUNT_CALLS), (-deleted,))
    return int(deleted)


def recount_incomplete_calls(d: Dialect, db: Conn) -> None:
    """Count every rollout's incomplete calls that no complete retry supersedes into
    ``rollouts.incomplete_calls`` (a migration step, after ``calls.retry_of`` is filled)."""
    rollouts = db.execute(
        d.sql(
            "SELECT DISTINCT rollout_id FROM calls WHERE {not_late} "
            "AND (status = 'incomplete' OR retry_of IS NOT NULL)"
        )
    ).fetchall()
    for (rollout_id,) in rollouts:
        count = len(unsuperseded_incomplete(retry_links(d, db, rollout_id)))
        db.execute(
            d.sql("UPDATE rollouts SET incomplete_calls = ? WHERE rollout_id = ?"),
            (count, rollout_id),
        )


def recount_rollouts(d: Dialect, db: Conn) -> None:
    """Count every rollout's chains into ``rollouts.num_chains`` (``chain_counts.kept_chains``
    over its calls but the late ones; NULL where the figure cannot be kept), its failed,
    incomplete and refused calls (``lifecycle.call_tally``, late ones included) and its calls'
    diagnostic kinds (``rollout_kinds``), a rollout at a time (one in memory): a migration
    step, after ``num_calls`` is counted."""
    rollouts = db.execute(d.sql("SELECT rollout_id FROM rollouts WHERE num_calls > 0")).fetchall()
    for (rollout_id,) in rollouts:
        rows = db.execute(
            d.sql(
                f"SELECT {CALL_COLUMNS}, late FROM calls WHERE rollout_id = ? "
                "ORDER BY created_at, call_id"
            ),
            (rollout_id,),
            **d.read_options,
        ).fetchall()
        blobs = blobs_of(d, db, ROLLOUT_CALLS, (rollout_id,))
        late = {r[0] for r in rows if r[-1]}
        records = decode_records(encoded_row(r[:-1], blobs) for r in rows)
        tally = [sum(t) for t in zip(*(lifecycle.call_tally(r) for r in records), strict=True)]
        chains = kept_chains(rollout_id, (r for r in records if r.call_id not in late))
        db.execute(
            d.sql(
                "UPDATE rollouts SET num_chains = ?, num_failed = ?, num_incomplete = ?, "
                "num_refused = ? WHERE rollout_id = ?"
            ),
            (chains, *(tally or (0, 0, 0)), rollout_id),
        )
        keep_kinds(d, db, rollout_id, (k.kind for r in records for k in r.diagnostics))


def migrate_records(d: Dialect, db: Conn) -> None:
    """Rewrite every record older than the codec's schema in the current one, a rollout at a
    time (one in memory). Records that held whole messages (v1, v2) are re-split against their
    prompt parents' whole messages, so an old store's chains grow linearly from now on."""
    rollouts = db.execute(
        d.sql("SELECT DISTINCT rollout_id FROM calls WHERE schema_version < ?"),
        (SCHEMA_VERSION,),
    ).fetchall()
    sets = ", ".join(f"{c} = ?" for c in COLUMNS[1:])
    for (rollout_id,) in rollouts:
        old = [
            encoded_row(r)
            for r in db.execute(
                d.sql(
                    f"SELECT {CALL_COLUMNS} FROM calls WHERE rollout_id = ? "
                    "AND schema_version < ? ORDER BY created_at, call_id"
                ),
                (rollout_id, SCHEMA_VERSION),
            ).fetchall()
        ]
        # call id -> the whole messages a v1/v2 record holds (its parent's base).
        whole = {e.call_id: json.loads(e.meta).get("request_messages") or [] for e in old}
        for enc in old:
            new = migrate(enc)
            parent = new.prompt_parent_call_id
            if parent is not None and parent in whole:
                new = rebase_messages(new, whole[new.call_id], whole[parent])
            db.execute(
                d.sql(f"UPDATE calls SET {sets} WHERE call_id = ?"),
                (*column_values(new)[1:], new.call_id),
            )
            store_json(d, db, new)


SQLITE = Dialect(
    name="sqlite",
    placeholder="?",
    words={
        "late": "late = 1",
        "not_late": "late = 0",
        "late_ids": "(SELECT json_group_array(call_id) FROM (SELECT call_id FROM calls c "
        "WHERE c.rollout_id = r.rollout_id AND c.late = 1 ORDER BY created_at, call_id))",
        "call_kinds": "(SELECT json_group_array(kind) FROM (SELECT kind FROM rollout_kinds k "
        "WHERE k.rollout_id = r.rollout_id ORDER BY kind))",
        "text_order": "",
    },
    no_limit=-1,
    late_ids_of=json.loads,
    counts_calls=True,
)
POSTGRES = Dialect(
    name="postgresql",
    placeholder="%s",
    words={
        "late": "late",
        "not_late": "NOT late",
        "late_ids": "array(SELECT c.call_id FROM calls c WHERE c.rollout_id = r.rollout_id "
        "AND c.late ORDER BY c.created_at, c.call_id)",
        "call_kinds": "array(SELECT k.kind FROM rollout_kinds k "
        'WHERE k.rollout_id = r.rollout_id ORDER BY k.kind COLLATE "C")',
        "text_order": ' COLLATE "C"',
    },
    no_limit=None,
    late_ids_of=list,
    read_options={"binary": True},
)
