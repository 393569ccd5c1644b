"""The transaction bodies of every store operation but ``put_call``, written once for both SQL
stores (``SQLStore``), over the store's ``Dialect`` and the statements of ``sql.py``.

Owns no connection, no thread and no transaction boundary: a store (``sqlite.py``,
``postgres.py``) subclasses ``SQLStore``, names its dialect and provides ``_transaction`` (one
write transaction: SQLite's ``BEGIN IMMEDIATE``, PostgreSQL's rollout advisory lock) and
``_read_transaction`` (one snapshot), besides the hops of ``ThreadedStore``. What an operation
decides is ``lifecycle``'s. ``put_call`` stays in each store: SQLite's reads one statement at a
time, PostgreSQL's pipelines its reads into one round trip; both use ``sql.py``'s statements.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from capture_proxy.core.codec import decode_records
from capture_proxy.core.images import PromptImage
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.records import CallRecord, Diagnostic
from capture_proxy.store import image_rows, lifecycle
from capture_proxy.store.base import Retirement, RolloutInfo, Snapshot
from capture_proxy.store.sql import (
    ANCESTRY,
    CALL_COLUMNS,
    CHILDREN_ANCESTRY,
    CHILDREN_OF,
    ROLLOUT_CALLS,
    ROLLOUT_SELECT,
    Conn,
    Dialect,
    blobs_of,
    delete_rows,
    encoded_row,
    next_cursor,
    state,
)
from capture_proxy.store.threaded import ThreadedStore

T = TypeVar("T")


class SQLStore(ThreadedStore):
    """The ``ThreadedStore`` functions every SQL store runs the same way (module docstring).
    A subclass sets ``dialect`` and provides ``_transaction``, ``_read_transaction``, ``_put``,
    ``_list_episodes`` and ``_health``."""

    dialect: Dialect

    def _transaction(self, db: Conn, rollout_id: str | None, body: Callable[[], T]) -> T:
        """Run ``body`` in one write transaction (of ``rollout_id``'s, when given: serialised
        with the rollout's other writes); roll back on any exception."""
        raise NotImplementedError

    def _read_transaction(self, db: Conn, body: Callable[[], T]) -> T:
        """Run ``body`` in one read transaction (one snapshot for all its statements)."""
        raise NotImplementedError

    # --- writes --------------------------------------------------------------------------

    def _mark(self, db: Conn, rollout_id: str, diagnostic: Diagnostic) -> None:
        d = self.dialect

        def body() -> None:
            tomb, row = state(d, db, rollout_id)
            if tomb is not None:
                # A deleted rollout stays deleted; the failed write was logged by the caller.
                return
            db.execute(
                d.sql(
                    "INSERT INTO rollouts (rollout_id, created_at, incomplete, diagnostics) "
                    "VALUES (?, ?, TRUE, ?) ON CONFLICT (rollout_id) DO UPDATE SET "
                    "incomplete = TRUE, diagnostics = excluded.diagnostics"
                ),
                (rollout_id, time.time(), lifecycle.with_diagnostic(row, diagnostic)),
            )

        self._transaction(db, rollout_id, body)

    def _delete(self, db: Conn, rollout_id: str, known_elsewhere: bool) -> int | None:
        d = self.dialect

        def body() -> int | None:
            if not known_elsewhere and not any(
                db.execute(d.sql(sql), (rollout_id,)).fetchone()
                for sql in (
                    "SELECT 1 FROM rollouts WHERE rollout_id = ?",
                    "SELECT 1 FROM calls WHERE rollout_id = ? LIMIT 1",
                    "SELECT 1 FROM tombstones WHERE rollout_id = ?",
                )
            ):
                return None
            deleted = delete_rows(d, db, rollout_id)
            db.execute(
                d.sql(
                    "INSERT INTO tombstones (rollout_id, deleted_at) VALUES (?, ?) "
                    "ON CONFLICT DO NOTHING"
                ),
                (rollout_id, time.time()),
            )
            return deleted

        return self._transaction(db, rollout_id, body)

    def _freeze(self, db: Conn, rollout_id: str, known_elsewhere: bool) -> Snapshot:
        d = self.dialect

        def body() -> Snapshot:
            tomb, row = state(d, db, rollout_id)
            earlier = lifecycle.earlier_freeze(
                rollout_id, tomb, row, known_elsewhere=known_elsewhere
            )
            if earlier is not None:
                return earlier
            now = time.time()
            if row is None:  # nothing stored yet, a first call in flight: frozen empty
                db.execute(
                    d.sql("INSERT INTO rollouts (rollout_id, created_at) VALUES (?, ?)"),
                    (rollout_id, now),
                )
            # The kept count, not the rows: before the first freeze no call is late.
            (num_calls,) = db.execute(
                d.sql("SELECT num_calls FROM rollouts WHERE rollout_id = ?"), (rollout_id,)
            ).fetchone()
            # Last: the counter row's lock is held from here to COMMIT (``next_cursor``).
            snapshot = lifecycle.new_snapshot(
                row, num_calls=num_calls, now=now, cursor=next_cursor(d, db)
            )
            db.execute(
                d.sql(
                    "UPDATE rollouts SET snapshot_id = ?, frozen_at = ?, frozen_num_calls = ?, "
                    "export_cursor = ? WHERE rollout_id = ?"
                ),
                (snapshot.snapshot_id, now, snapshot.num_calls, snapshot.cursor, rollout_id),
            )
            return snapshot

        return self._transaction(db, rollout_id, body)

    def _set_metadata(self, db: Conn, rollout_id: str, metadata: RolloutMetadata) -> int:
        d = self.dialect

        def body() -> int:
            after, text = lifecycle.metadata_change(rollout_id, *state(d, db, rollout_id), metadata)
            if text is not None:
                db.execute(
                    d.sql("UPDATE rollouts SET metadata = ?, version = ? WHERE rollout_id = ?"),
                    (text, after, rollout_id),
                )
            return after

        return self._transaction(db, rollout_id, body)

    def _retire(self, db: Conn, rollout_id: str, snapshot_id: str, version: int) -> Retirement:
        d = self.dialect

        def body() -> Retirement:
            tomb, row = state(d, db, rollout_id)
            earlier = lifecycle.earlier_retirement(rollout_id, snapshot_id, version, tomb, row)
            if earlier is not None:  # a retry with the same identifiers: the same answer
                return earlier
            deleted = delete_rows(d, db, rollout_id)
            now = time.time()
            db.execute(
                d.sql(
                    "INSERT INTO tombstones (rollout_id, deleted_at, snapshot_id, version, "
                    "deleted_calls) VALUES (?, ?, ?, ?, ?)"
                ),
                (rollout_id, now, snapshot_id, version, deleted),
            )
            return Retirement(rollout_id, snapshot_id, version, deleted, now)

        return self._transaction(db, rollout_id, body)

    def _sweep(self, db: Conn, older_than_s: float) -> int:
        cur = db.execute(
            self.dialect.sql("DELETE FROM tombstones WHERE deleted_at < ?"),
            (time.time() - older_than_s,),
        )
        return int(cur.rowcount)

    # --- reads ---------------------------------------------------------------------------

    def _get_tombstone(self, db: Conn, rollout_id: str) -> float | None:
        row = db.execute(
            self.dialect.sql("SELECT deleted_at FROM tombstones WHERE rollout_id = ?"),
            (rollout_id,),
        ).fetchone()
        return float(row[0]) if row else None

    def _get_images(self, db: Conn, shas: list[str]) -> dict[str, PromptImage]:
        rows = self._read_transaction(db, lambda: image_rows.get_images(self.dialect, db, shas))
        return {
            sha: PromptImage(sha, media_type, width, height, data)
            for sha, (media_type, width, height, data) in rows.items()
        }

    def _get_call(self, db: Conn, call_id: str) -> CallRecord | None:
        d = self.dialect

        def body() -> tuple[list[Any], dict[str, str]]:
            # The call and its prompt ancestors, in one recursive query; then their JSON.
            rows = db.execute(
                d.sql(
                    ANCESTRY
                    + f"SELECT {CALL_COLUMNS} FROM calls WHERE call_id IN (SELECT id FROM anc)"
                ),
                (call_id,),
                **d.read_options,
            ).fetchall()
            blobs = blobs_of(d, db, ANCESTRY + "SELECT id FROM anc", (call_id,)) if rows else {}
            return rows, blobs

        rows, blobs = self._read_transaction(db, body)
        encoded = [encoded_row(r, blobs) for r in rows]
        if not any(r.call_id == call_id for r in encoded):
            return None
        return next(r for r in decode_records(encoded) if r.call_id == call_id)

    def _rollout_call_rows(self, db: Conn, rollout_id: str) -> tuple[list[Any], dict[str, str]]:
        """The rollout's call rows in stored order and their JSON texts (inside a read
        transaction)."""
        d = self.dialect
        rows = db.execute(
            d.sql(
                f"SELECT {CALL_COLUMNS} FROM calls WHERE rollout_id = ? "
                "ORDER BY created_at, call_id"
            ),
            (rollout_id,),
            **d.read_options,
        ).fetchall()
        return rows, (blobs_of(d, db, ROLLOUT_CALLS, (rollout_id,)) if rows else {})

    def _get_rollout_calls(self, db: Conn, rollout_id: str) -> list[CallRecord]:
        rows, blobs = self._read_transaction(db, lambda: self._rollout_call_rows(db, rollout_id))
        return decode_records(encoded_row(r, blobs) for r in rows)

    def _get_rollout_with_calls(
        self, db: Conn, rollout_id: str
    ) -> tuple[RolloutInfo, list[CallRecord]] | None:
        """The rollout and all its calls from one snapshot (one read transaction)."""
        sql = self.dialect.sql(ROLLOUT_SELECT + " WHERE r.rollout_id = ?")

        def body() -> tuple[Any, list[Any], dict[str, str]]:
            row = db.execute(sql, (rollout_id,)).fetchone()
            return (row, *self._rollout_call_rows(db, rollout_id)) if row else (None, [], {})

        row, rows, blobs = self._read_transaction(db, body)
        if row is None:
            return None
        return self._info(tuple(row)), decode_records(encoded_row(r, blobs) for r in rows)

    def _get_calls_by_child_digest(
        self, db: Conn, rollout_id: str, child_digest: str
    ) -> list[CallRecord]:
        d = self.dialect
        args = (rollout_id, child_digest)

        def body() -> tuple[list[Any], list[Any], dict[str, str]]:
            # The calls (``calls_by_child_digest``), then them and their prompt ancestors.
            found = db.execute(d.sql(CHILDREN_OF), args).fetchall()
            if not found:
                return found, [], {}
            rows = db.execute(
                d.sql(
                    CHILDREN_ANCESTRY
                    + f"SELECT {CALL_COLUMNS} FROM calls WHERE call_id IN (SELECT id FROM anc)"
                ),
                args,
                **d.read_options,
            ).fetchall()
            return found, rows, blobs_of(d, db, CHILDREN_ANCESTRY + "SELECT id FROM anc", args)

        found, rows, blobs = self._read_transaction(db, body)
        wanted = {r[0] for r in found}
        records = decode_records(encoded_row(r, blobs) for r in rows)
        return sorted(
            (r for r in records if r.call_id in wanted), key=lambda r: (r.created_at, r.call_id)
        )

    def _info(self, row: tuple[Any, ...]) -> RolloutInfo:
        """From a row of ``ROLLOUT_SELECT``."""
        read = self.dialect.late_ids_of
        return lifecycle.rollout_info(row[:-2], read(row[-1]), read(row[-2]))

    def _get_rollout(self, db: Conn, rollout_id: str) -> RolloutInfo | None:
        sql = self.dialect.sql(ROLLOUT_SELECT + " WHERE r.rollout_id = ?")
        row = db.execute(sql, (rollout_id,)).fetchone()
        return self._info(tuple(row)) if row else None

    def _list_rollouts(self, db: Conn, limit: int | None, after: str | None) -> list[RolloutInfo]:
        # Byte order (``text_order``): as SQLite compares text, whatever the collation.
        d = self.dialect
        sql = d.sql(
            ROLLOUT_SELECT + " WHERE r.rollout_id > ?{text_order} "
            "ORDER BY r.rollout_id{text_order} LIMIT ?"
        )
        after_id = after if after is not None else ""
        rows = db.execute(sql, (after_id, limit if limit is not None else d.no_limit)).fetchall()
        return [self._info(tuple(r)) for r in rows]

    def _list_frozen(self, db: Conn, after: int, limit: int | None) -> list[RolloutInfo]:
        d = self.dialect
        sql = d.sql(ROLLOUT_SELECT + " WHERE r.export_cursor > ? ORDER BY r.export_cursor LIMIT ?")
        rows = db.execute(sql, (after, limit if limit is not None else d.no_limit)).fetchall()
        return [self._info(tuple(r)) for r in rows]
