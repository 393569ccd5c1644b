"""Stores for captured calls. ``CaptureStore`` is the interface every store implements;
``SQLiteStore`` is the embedded default (one file, WAL mode, arrays as BLOBs)."""

from capture_proxy.store.base import (
    CaptureStore,
    ConflictingRecord,
    RolloutDeleted,
    RolloutInfo,
    StoreError,
)
from capture_proxy.store.sqlite import SQLiteStore

__all__ = [
    "CaptureStore",
    "ConflictingRecord",
    "RolloutDeleted",
    "RolloutInfo",
    "SQLiteStore",
    "StoreError",
]
