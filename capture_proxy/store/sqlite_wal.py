"""What a store writer that died leaves in SQLite's WAL, made definite for a worker that must
answer whether its put was committed (``store.remote``: the supervisor died with the put in
flight).

Owns that one step. A commit in WAL mode is two steps: the transaction's frames (the last one
marked as a commit) are appended to ``captures.sqlite3-wal`` (and fsynced, synchronous=FULL),
then the wal-index header in ``captures.sqlite3-shm`` is updated (``mxFrame``); readers see the
commit from then on, and every later writer appends after it. A writer killed between the two
(during the fsync, milliseconds) leaves a commit in the WAL that no reader sees while any
connection keeps the wal-index (a restarted writer then appends over it: gone), but that a
recovery takes in (the first connection after every one closed, e.g. the next start after the
workers ended): stored after all. Its worker would have answered "not stored" (a 503), and the
harness's retry would be a second copy. ``settle_wal`` cuts such frames off the WAL before the
worker reads, under the store's writer lock (no writer runs then), so what the worker reads
stays true: a commit readers see is kept, one they do not see is gone for good.

Formats: the WAL header (sqlite.org/fileformat2.html: 32 bytes, big-endian; salt-1 and
salt-2 at bytes 16-23) and the wal-index header (wal.c's ``WalIndexHdr``: the first 48 bytes
of ``-shm``, written twice, native byte order: ``isInit`` at 12, ``szPage`` at 14, ``mxFrame``
at 16, the WAL header's salts as its bytes at 32). Must not: write the database or the
wal-index; close a descriptor of ``-shm`` while the process has a connection open (closing any
descriptor of a file drops every POSIX lock the process holds on it: SQLite's among them).
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from pathlib import Path

WAL_HEADER_BYTES = 32
FRAME_HEADER_BYTES = 24
#: ``WalIndexHdr``: 48 bytes, two copies at the start of ``-shm``
INDEX_HEADER_BYTES = 48
#: How long to wait for the writer lock that a dead writer's process still held a moment ago
#: (the kernel drops it as the process ends); longer means another writer has the store.
WRITER_LOCK_WAIT_S = 2.0
_POLL_S = 0.005


def committed_length(index: bytes, wal_header: bytes) -> int | None:
    """The bytes of the WAL that hold what readers see (header and frames up to ``mxFrame``),
    from the first 96 bytes of ``-shm`` (``index``) and the WAL's header. None when the
    wal-index cannot say: not initialised, its two copies differ (a writer died writing it:
    the next reader recovers from the WAL, taking every commit in it, which is then what
    every reader sees), or the WAL header is of another generation (restarted, nothing
    committed after it yet)."""
    if len(index) < 2 * INDEX_HEADER_BYTES or len(wal_header) < WAL_HEADER_BYTES:
        return None
    first, second = index[:INDEX_HEADER_BYTES], index[INDEX_HEADER_BYTES : 2 * INDEX_HEADER_BYTES]
    if first != second or first[12] != 1:
        return None
    if first[32:40] != wal_header[16:24]:
        return None
    (size,) = struct.unpack_from("=H", first, 14)
    (max_frame,) = struct.unpack_from("=I", first, 16)
    page = 65536 if size == 1 else size
    return WAL_HEADER_BYTES + max_frame * (FRAME_HEADER_BYTES + page)


def settle_wal(db_path: Path, shm_fd: int, writer_lock: Path) -> str:
    """Cut off the WAL of ``db_path`` what no reader sees (module docstring), holding the
    store's ``writer_lock`` (waiting at most ``WRITER_LOCK_WAIT_S`` for it). ``shm_fd``: a
    descriptor of ``-shm`` the caller keeps open while it has a connection (module
    docstring). Returns what it did, for the log."""
    try:
        lock_fd = os.open(writer_lock, os.O_RDONLY)
    except OSError as exc:
        return f"no writer lock ({exc.strerror})"
    try:
        deadline = time.monotonic() + WRITER_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    # Another writer opened the store: it took over this wal-index (it was
                    # not the first connection: ours is open), so it appends over anything
                    # readers do not see.
                    return "another writer holds the store"
                time.sleep(_POLL_S)
        wal = Path(f"{db_path}-wal")
        try:
            wal_fd = os.open(wal, os.O_RDWR)
        except FileNotFoundError:
            return "no WAL"
        try:
            length = committed_length(os.pread(shm_fd, 2 * INDEX_HEADER_BYTES, 0),
                                      os.pread(wal_fd, WAL_HEADER_BYTES, 0))  # fmt: skip
            size = os.fstat(wal_fd).st_size
            if length is None or size <= length:
                return "nothing to cut"
            os.ftruncate(wal_fd, length)
            os.fsync(wal_fd)
            return f"cut {size - length} bytes off the WAL that no reader sees"
        finally:
            os.close(wal_fd)
    finally:
        os.close(lock_fd)  # drops the flock
