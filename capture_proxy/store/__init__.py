"""Stores for captured calls. ``CaptureStore`` is the interface every store implements;
``SQLiteStore`` is the embedded default (one file, WAL mode, arrays as BLOBs);
``PostgresStore`` is the shared store for replicas (``postgresql://`` URL, optional extra
``postgres``). ``open_store`` picks one from the ``store`` setting."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from capture_proxy.store.base import (
    CaptureStore,
    ConflictingRecord,
    RolloutDeleted,
    RolloutInfo,
    StoreError,
)
from capture_proxy.store.postgres import PostgresStore, is_postgres_url
from capture_proxy.store.sqlite import SQLiteStore


def open_store(
    location: Path | str,
    *,
    synchronous: Literal["full", "normal"] = "full",
    pool_size: int = 8,
    read_only: bool = False,
) -> CaptureStore:
    """The store at ``location``: a ``postgresql://`` URL, else an embedded store directory
    (``synchronous`` applies to SQLite, ``pool_size`` to PostgreSQL; ``read_only``: an
    embedded store opened beside the proxy that writes it, without its writer lock). Not
    opened yet."""
    if isinstance(location, str) and is_postgres_url(location):
        return PostgresStore(location, pool_size=pool_size)
    return SQLiteStore(Path(location), synchronous=synchronous, exclusive=not read_only)


__all__ = [
    "CaptureStore",
    "ConflictingRecord",
    "PostgresStore",
    "RolloutDeleted",
    "RolloutInfo",
    "SQLiteStore",
    "StoreError",
    "open_store",
]
