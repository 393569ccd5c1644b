"""The embedded store: one SQLite database in WAL mode, arrays as BLOBs.

Owns the table layout and the durability settings. ``synchronous=FULL`` in WAL mode makes every
committed transaction survive a crash or power loss, so a ``put_call`` that returned is
durable. Record encoding is the core codec's; this module only moves bytes. All SQL runs on
aiosqlite's worker thread so the event loop never blocks on disk.

Layout (``<store dir>/captures.sqlite3``, ``PRAGMA user_version`` = ``LAYOUT_VERSION``):
- ``calls``: one row per call in the codec's stored form (schema v2): JSON metadata beside four
  BLOB arrays; ``prompt_token_ids`` holds only the ids after the call's prompt parent
  (``prompt_parent_call_id``, ``prompt_prefix_len``), chosen inside the write transaction by
  the core's prefix rule (``core.prefixes``) from the digests kept per row (``tokens_sha256``,
  ``num_prompt_tokens``, ``num_generation_tokens``). A prompt parent is always an earlier row
  of the same rollout, so deleting a rollout never orphans a prompt.
- ``rollouts``: first-seen time, incomplete flag and rollout-level diagnostics.
- ``tombstones``: deleted rollouts and when (Unix s); writes to them are refused.

Opening an older store migrates it in one transaction: missing columns are added and every
record older than the codec's schema version is rewritten through ``codec.migrate``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiosqlite

from capture_proxy.core.codec import (
    EncodedRecord,
    decode_records,
    encode_record,
    migrate,
    same_content,
)
from capture_proxy.core.prefixes import StoredPrefix, choose_prompt_parent
from capture_proxy.core.records import SCHEMA_VERSION, CallRecord, CallStatus, Diagnostic
from capture_proxy.store.base import ConflictingRecord, RolloutDeleted, RolloutInfo, StoreError

DB_FILE_NAME = "captures.sqlite3"
#: Table layout version (``PRAGMA user_version``); 0 is the layout of schema v1 records.
LAYOUT_VERSION = 2

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
    tokens_sha256 BLOB NOT NULL DEFAULT x''
);
CREATE INDEX IF NOT EXISTS calls_by_rollout ON calls (rollout_id, created_at);
CREATE TABLE IF NOT EXISTS tombstones (
    rollout_id TEXT PRIMARY KEY,
    deleted_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0,
    diagnostics TEXT NOT NULL DEFAULT '[]'
);
"""

# In ``EncodedRecord`` field order.
_CALL_COLUMNS = (
    "call_id, rollout_id, created_at, status, schema_version, meta, prompt_token_ids, "
    "generation_token_ids, generation_log_probs, routed_experts, prompt_parent_call_id, "
    "prompt_prefix_len, num_prompt_tokens, num_generation_tokens, tokens_sha256"
)
_V2_COLUMNS = {
    "prompt_parent_call_id": "TEXT",
    "prompt_prefix_len": "INTEGER NOT NULL DEFAULT 0",
    "num_prompt_tokens": "INTEGER NOT NULL DEFAULT 0",
    "num_generation_tokens": "INTEGER NOT NULL DEFAULT 0",
    "tokens_sha256": "BLOB NOT NULL DEFAULT x''",
}


def _row_to_encoded(row: sqlite3.Row | tuple[Any, ...]) -> EncodedRecord:
    return EncodedRecord(*row)


class SQLiteStore:
    """Embedded store in directory ``path`` (created on first use)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.db_path = self.path / DB_FILE_NAME
        self._db: aiosqlite.Connection | None = None
        # One connection: transactions from concurrent coroutines must not interleave.
        self._write_lock = asyncio.Lock()

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise StoreError("store is not open")
        return self._db

    async def open(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._db = await aiosqlite.connect(self.db_path, isolation_level=None)
            await self._db.execute("PRAGMA journal_mode=WAL")
            await self._db.execute("PRAGMA synchronous=FULL")
            await self._db.execute("PRAGMA busy_timeout=10000")
            await self._migrate_layout()
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open store at {self.db_path}: {exc}") from exc

    async def _migrate_layout(self) -> None:
        """Create the tables, or bring an older store's to ``LAYOUT_VERSION`` (one
        transaction: a crash leaves the old layout, and the next open migrates again)."""
        async with self.db.execute("PRAGMA user_version") as cur:
            row = await cur.fetchone()
        version = int(row[0]) if row else 0
        if version > LAYOUT_VERSION:
            raise StoreError(
                f"store at {self.db_path} has layout {version}; this reader knows up to "
                f"{LAYOUT_VERSION}"
            )
        # CREATE ... IF NOT EXISTS leaves an older ``calls`` table as it is; executescript
        # runs outside the transaction below, which adds the missing columns.
        await self.db.executescript(_SCHEMA)
        await self.db.execute("BEGIN IMMEDIATE")
        try:
            async with self.db.execute("PRAGMA table_info(calls)") as cur:
                existing = {r[1] for r in await cur.fetchall()}
            for name, decl in _V2_COLUMNS.items():
                if name not in existing:
                    await self.db.execute(f"ALTER TABLE calls ADD COLUMN {name} {decl}")
            async with self.db.execute(
                f"SELECT {_CALL_COLUMNS} FROM calls WHERE schema_version < ?", (SCHEMA_VERSION,)
            ) as cur:
                old = [_row_to_encoded(tuple(r)) for r in await cur.fetchall()]
            for enc in old:
                new = migrate(enc)
                await self.db.execute(
                    "UPDATE calls SET schema_version=?, prompt_parent_call_id=?, "
                    "prompt_prefix_len=?, num_prompt_tokens=?, num_generation_tokens=?, "
                    "tokens_sha256=? WHERE call_id=?",
                    (
                        new.schema_version,
                        new.prompt_parent_call_id,
                        new.prompt_prefix_len,
                        new.num_prompt_tokens,
                        new.num_generation_tokens,
                        new.tokens_sha256,
                        new.call_id,
                    ),
                )
            await self.db.execute(f"PRAGMA user_version={LAYOUT_VERSION}")
            await self.db.execute("COMMIT")
        except BaseException:
            await self.db.execute("ROLLBACK")
            raise

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    async def put_call(self, record: CallRecord) -> None:
        """Store ``record`` durably (committed with ``synchronous=FULL`` before returning).

        Raises RolloutDeleted for a tombstoned rollout, ConflictingRecord when the call id is
        stored with other content (the original is kept), StoreError on I/O failure."""
        incomplete = 1 if record.status is CallStatus.INCOMPLETE else 0
        try:
            async with self._write_lock:
                await self._put(record, incomplete)
        except sqlite3.Error as exc:
            raise StoreError(f"storing call {record.call_id} failed: {exc}") from exc

    async def _prompt_parent_candidates(self, record: CallRecord) -> list[StoredPrefix]:
        async with self.db.execute(
            "SELECT call_id, created_at, num_prompt_tokens + num_generation_tokens, "
            "tokens_sha256 FROM calls WHERE rollout_id = ? AND status = ? "
            "AND num_generation_tokens > 0 AND num_prompt_tokens + num_generation_tokens <= ?",
            (record.rollout_id, CallStatus.COMPLETE.value, record.num_prompt_tokens),
        ) as cur:
            rows = await cur.fetchall()
        return [StoredPrefix(r[0], r[1], r[2], r[3]) for r in rows]

    async def _tombstoned(self, rollout_id: str) -> bool:
        async with self.db.execute(
            "SELECT 1 FROM tombstones WHERE rollout_id = ?", (rollout_id,)
        ) as cur:
            return await cur.fetchone() is not None

    async def _put(self, record: CallRecord, incomplete: int) -> None:
        await self.db.execute("BEGIN IMMEDIATE")
        try:
            if await self._tombstoned(record.rollout_id):
                raise RolloutDeleted(
                    f"rollout {record.rollout_id} was deleted; call {record.call_id} refused"
                )
            # Inside the transaction: no candidate can appear or vanish before the insert.
            parent = choose_prompt_parent(
                record.prompt_token_ids,
                await self._prompt_parent_candidates(record),
                exclude=record.call_id,
            )
            enc = encode_record(record, prompt_parent=parent)
            cur = await self.db.execute(
                f"INSERT OR IGNORE INTO calls ({_CALL_COLUMNS}) "
                f"VALUES ({','.join('?' * len(dataclasses.fields(EncodedRecord)))})",
                dataclasses.astuple(enc),
            )
            if cur.rowcount == 0:
                await self._check_same(enc)
            await self.db.execute(
                "INSERT INTO rollouts (rollout_id, created_at, incomplete) VALUES (?,?,?) "
                "ON CONFLICT(rollout_id) DO UPDATE SET "
                "incomplete = max(incomplete, excluded.incomplete)",
                (enc.rollout_id, enc.created_at, incomplete),
            )
            await self.db.execute("COMMIT")
        except BaseException:
            await self.db.execute("ROLLBACK")
            raise

    async def _check_same(self, enc: EncodedRecord) -> None:
        async with self.db.execute(
            f"SELECT {_CALL_COLUMNS} FROM calls WHERE call_id = ?", (enc.call_id,)
        ) as cur:
            row = await cur.fetchone()
        if row is not None and not same_content(_row_to_encoded(tuple(row)), enc):
            raise ConflictingRecord(
                f"call {enc.call_id} is already stored with different content; original kept"
            )

    async def mark_rollout_incomplete(self, rollout_id: str, diagnostic: Diagnostic) -> None:
        try:
            async with self._write_lock:
                await self._mark(rollout_id, diagnostic)
        except sqlite3.Error as exc:
            raise StoreError(f"marking rollout {rollout_id} incomplete failed: {exc}") from exc

    async def _mark(self, rollout_id: str, diagnostic: Diagnostic) -> None:
        await self.db.execute("BEGIN IMMEDIATE")
        try:
            if await self._tombstoned(rollout_id):
                # A deleted rollout stays deleted; the failed write was logged by the caller.
                await self.db.execute("ROLLBACK")
                return
            async with self.db.execute(
                "SELECT diagnostics FROM rollouts WHERE rollout_id = ?", (rollout_id,)
            ) as cur:
                row = await cur.fetchone()
            diags = [Diagnostic.from_json(d) for d in json.loads(row[0])] if row else []
            if all(d.kind != diagnostic.kind for d in diags):
                diags.append(diagnostic)
            text = json.dumps([d.to_json() for d in diags], ensure_ascii=False)
            await self.db.execute(
                "INSERT INTO rollouts (rollout_id, created_at, incomplete, diagnostics) "
                "VALUES (?,?,1,?) ON CONFLICT(rollout_id) DO UPDATE SET incomplete = 1, "
                "diagnostics = excluded.diagnostics",
                (rollout_id, time.time(), text),
            )
            await self.db.execute("COMMIT")
        except BaseException:
            await self.db.execute("ROLLBACK")
            raise

    async def delete_rollout(self, rollout_id: str) -> int:
        try:
            async with self._write_lock:
                await self.db.execute("BEGIN IMMEDIATE")
                try:
                    cur = await self.db.execute(
                        "DELETE FROM calls WHERE rollout_id = ?", (rollout_id,)
                    )
                    deleted = cur.rowcount
                    await self.db.execute(
                        "DELETE FROM rollouts WHERE rollout_id = ?", (rollout_id,)
                    )
                    await self.db.execute(
                        "INSERT OR IGNORE INTO tombstones (rollout_id, deleted_at) VALUES (?, ?)",
                        (rollout_id, time.time()),
                    )
                    await self.db.execute("COMMIT")
                except BaseException:
                    await self.db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            raise StoreError(f"deleting rollout {rollout_id} failed: {exc}") from exc
        return deleted

    async def sweep_tombstones(self, older_than_s: float) -> int:
        try:
            async with self._write_lock:
                cur = await self.db.execute(
                    "DELETE FROM tombstones WHERE deleted_at < ?", (time.time() - older_than_s,)
                )
                return cur.rowcount
        except sqlite3.Error as exc:
            raise StoreError(f"sweeping tombstones failed: {exc}") from exc

    async def get_tombstone(self, rollout_id: str) -> float | None:
        """When the rollout was deleted (Unix s), or None when it has no tombstone."""
        async with self.db.execute(
            "SELECT deleted_at FROM tombstones WHERE rollout_id = ?", (rollout_id,)
        ) as cur:
            row = await cur.fetchone()
        return float(row[0]) if row else None

    async def get_call(self, call_id: str) -> CallRecord | None:
        # The call and its prompt ancestors, in one recursive query.
        async with self.db.execute(
            "WITH RECURSIVE anc(id) AS (SELECT ? UNION ALL SELECT c.prompt_parent_call_id "
            "FROM calls c JOIN anc ON c.call_id = anc.id "
            "WHERE c.prompt_parent_call_id IS NOT NULL) "
            f"SELECT {_CALL_COLUMNS} FROM calls WHERE call_id IN (SELECT id FROM anc)",
            (call_id,),
        ) as cur:
            rows = [_row_to_encoded(tuple(r)) for r in await cur.fetchall()]
        if not any(r.call_id == call_id for r in rows):
            return None
        return next(r for r in decode_records(rows) if r.call_id == call_id)

    async def get_rollout_calls(self, rollout_id: str) -> list[CallRecord]:
        async with self.db.execute(
            f"SELECT {_CALL_COLUMNS} FROM calls WHERE rollout_id = ? ORDER BY created_at, call_id",
            (rollout_id,),
        ) as cur:
            rows = await cur.fetchall()
        return decode_records(_row_to_encoded(tuple(r)) for r in rows)

    def _info(self, row: tuple[Any, ...]) -> RolloutInfo:
        rollout_id, created_at, incomplete, diagnostics, num_calls = row
        return RolloutInfo(
            rollout_id=rollout_id,
            created_at=created_at,
            num_calls=num_calls,
            incomplete=bool(incomplete),
            diagnostics=[Diagnostic.from_json(d) for d in json.loads(diagnostics)],
        )

    _ROLLOUT_SELECT = (
        "SELECT r.rollout_id, r.created_at, r.incomplete, r.diagnostics, "
        "(SELECT count(*) FROM calls c WHERE c.rollout_id = r.rollout_id) FROM rollouts r"
    )

    async def get_rollout(self, rollout_id: str) -> RolloutInfo | None:
        async with self.db.execute(
            self._ROLLOUT_SELECT + " WHERE r.rollout_id = ?", (rollout_id,)
        ) as cur:
            row = await cur.fetchone()
        return self._info(tuple(row)) if row else None

    async def list_rollouts(self) -> list[RolloutInfo]:
        async with self.db.execute(self._ROLLOUT_SELECT + " ORDER BY r.rollout_id") as cur:
            rows = await cur.fetchall()
        return [self._info(tuple(r)) for r in rows]

    async def health(self) -> dict[str, Any]:
        async with self.db.execute("SELECT count(*) FROM calls") as cur:
            row = await cur.fetchone()
        return {"kind": "sqlite", "path": str(self.db_path), "calls": row[0] if row else 0}
