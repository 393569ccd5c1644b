"""A writer that dies in the middle of a commit, for ``test_remote``: it stores ``first``, then
``orphan``, puts the wal-index header back as it was before ``orphan``'s commit (as when the
writer is killed after the commit's frames reached the WAL, during their fsync, and before the
header said so) and SIGKILLs itself.

Usage: ``python -m tests.store.dying_writer STORE_DIR``
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from capture_proxy.store.sqlite import SQLiteStore
from tests.factories import record


async def main(store_dir: Path) -> None:
    store = SQLiteStore(store_dir)
    await store.open()
    await store.put_call(record("first", [1, 2], [3]))
    shm = os.open(f"{store.db_path}-shm", os.O_RDWR)
    before = os.pread(shm, 96, 0)  # both copies of the wal-index header
    await store.put_call(record("orphan", [1, 2, 3, 4], [5]))
    assert os.pread(shm, 96, 0) != before
    os.pwrite(shm, before, 0)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
