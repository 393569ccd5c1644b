"""The embedded store: one SQLite database in WAL mode, arrays as BLOBs.

Owns the table layout and the durability settings. ``synchronous=FULL`` in WAL mode makes every
committed transaction survive a crash or power loss, so a ``put_call`` that returned is
durable. Record encoding is the core codec's; this module only moves bytes. All SQL runs on
aiosqlite's worker thread so the event loop never blocks on disk.

Layout (``<store dir>/captures.sqlite3``):
- ``calls``: one row per call; JSON metadata beside four BLOB arrays.
- ``rollouts``: first-seen time, incomplete flag and rollout-level diagnostics.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiosqlite

from capture_proxy.core.codec import EncodedRecord, decode_record, encode_record
from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic
from capture_proxy.store.base import ConflictingRecord, RolloutInfo, StoreError

DB_FILE_NAME = "captures.sqlite3"

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
    routed_experts BLOB
);
CREATE INDEX IF NOT EXISTS calls_by_rollout ON calls (rollout_id, created_at);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0,
    diagnostics TEXT NOT NULL DEFAULT '[]'
);
"""

_CALL_COLUMNS = (
    "call_id, rollout_id, created_at, status, schema_version, meta, prompt_token_ids, "
    "generation_token_ids, generation_log_probs, routed_experts"
)


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
            await self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open store at {self.db_path}: {exc}") from exc

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    async def put_call(self, record: CallRecord) -> None:
        enc = encode_record(record)
        incomplete = 1 if record.status is CallStatus.INCOMPLETE else 0
        try:
            async with self._write_lock:
                await self._put(enc, incomplete)
        except sqlite3.Error as exc:
            raise StoreError(f"storing call {record.call_id} failed: {exc}") from exc

    async def _put(self, enc: EncodedRecord, incomplete: int) -> None:
        await self.db.execute("BEGIN IMMEDIATE")
        try:
            cur = await self.db.execute(
                f"INSERT OR IGNORE INTO calls ({_CALL_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    enc.call_id,
                    enc.rollout_id,
                    enc.created_at,
                    enc.status,
                    enc.schema_version,
                    enc.meta,
                    enc.prompt_token_ids,
                    enc.generation_token_ids,
                    enc.generation_log_probs,
                    enc.routed_experts,
                ),
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
        if row is not None and _row_to_encoded(tuple(row)) != enc:
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

    async def get_call(self, call_id: str) -> CallRecord | None:
        async with self.db.execute(
            f"SELECT {_CALL_COLUMNS} FROM calls WHERE call_id = ?", (call_id,)
        ) as cur:
            row = await cur.fetchone()
        return decode_record(_row_to_encoded(tuple(row))) if row else None

    async def get_rollout_calls(self, rollout_id: str) -> list[CallRecord]:
        async with self.db.execute(
            f"SELECT {_CALL_COLUMNS} FROM calls WHERE rollout_id = ? ORDER BY created_at, call_id",
            (rollout_id,),
        ) as cur:
            rows = await cur.fetchall()
        return [decode_record(_row_to_encoded(tuple(r))) for r in rows]

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
