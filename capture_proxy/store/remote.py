"""The embedded store shared by the workers of one proxy (``serve --workers N``): one writer,
many readers.

Owns the hand-off of writes between processes. The supervisor opens the ``SQLiteStore`` (its
writer lock, its writer thread with group commit, its caches: they stay true, as it is the
only writer) and serves ``serve_writes`` on a Unix socket in its private runtime directory.
Each worker opens a ``WorkerStore``: its own read-only connection and reader thread (WAL
readers neither block the writer nor wait for it; each read sees every commit before it), and
one connection to the supervisor (``WriterLink``) that carries every write: ``put_call`` and
the lifecycle steps, as the name of the store's synchronous function and its arguments. The
supervisor runs each as its own store would (``_put_hop``: grouped with the puts of every
worker that arrived during the previous commit) and answers its result or its exception; a
worker answers its harness only after that reply, so an acknowledged call is committed.

A lost link (the supervisor died) fails the writes in flight with ``WriterLost``: the link
cannot say whether they were committed. A put then asks the store: once the dead writer's
WAL is settled (``sqlite_wal``: a commit no reader sees is cut off, so it cannot come back at
the next start), a call the store holds is a success like any other, one it does not hold a
StoreError saying the supervisor died before the commit (the harness's 503). Other writes
(freeze, retire, ...) are idempotent under the retry their 503 asks for.

Frames: a 4-byte big-endian length, then a pickle (protocol 5) of ``(id, name, args)`` or
``(id, ok, value)``. A call's record and its ``RequestEncoding`` travel in one pickle, so the
encoding still belongs to the record on the other side (``RequestEncoding.belongs_to`` is by
identity). The socket is in a directory only this user can enter, and both ends are this
program.

Linking across workers: a worker's link index must hold every call of the rollout stored
before the request came, as one process's does, whichever worker stored it. The supervisor
counts each rollout's committed writes in ``RolloutStamps`` (a file every worker maps: one
counter per hash slot of the rollout id) and bumps the count BEFORE it answers the worker that
wrote: a harness sends its next call only after that answer, so the worker that gets it reads
the new count (a memory read, no system call). A count the worker's index does not reflect
(``WorkerStore`` is the linker's ``IndexFeed``) makes it read the rollout's rows stored since
its last read (``SQLiteStore._stored_since``: a few columns per call, no arrays decoded) before
it resolves; the worker's own puts advance its count without a read when no other write came
between. A rollout served by one worker (a harness on one keep-alive connection) costs no read
at all; a hash collision costs one needless read. ``WorkerStore.shared`` is also True (a
digest miss reads the store, as on PostgreSQL). Must not: decide what a write does
(``sqlite_puts``, ``lifecycle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import pickle
import sqlite3
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.stored import StoredCall
from capture_proxy.core.records import CallRecord
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.store.base import StoreError
from capture_proxy.store.sqlite import WRITER_LOCK_NAME, SQLiteStore
from capture_proxy.store.sqlite_wal import settle_wal
from capture_proxy.store.worker import WorkerThread

log = logging.getLogger("capture_proxy")

T = TypeVar("T")
_LENGTH = struct.Struct("!I")
#: The store functions a worker may ask the writer to run (``ThreadedStore``'s writes).
WRITES = frozenset({"_put", "_mark", "_delete", "_freeze", "_set_metadata", "_retire", "_sweep"})
#: Whether a call is stored (``WorkerStore._stored_after_writer_died``).
_STORED = "SELECT 1 FROM calls WHERE call_id = ?"
#: A worker tells the supervisor it listens: ``(index, pid)``.
READY = "ready"


#: Hash slots of ``RolloutStamps`` (8 bytes each: a 512 KiB file).
STAMP_SLOTS = 1 << 16
#: The calls whose put count (``own_put_stamp``) a worker keeps until its linker asks.
_OWN_PUTS_MAX = 4096


class RolloutStamps:
    """Counts of committed writes per rollout (hashed into ``STAMP_SLOTS`` slots) in a file
    mapped by the supervisor (``writable``: it counts) and every worker (they read)."""

    def __init__(self, path: Path, *, writable: bool) -> None:
        if writable:
            with open(path, "wb") as f:
                f.truncate(STAMP_SLOTS * 8)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(fd, STAMP_SLOTS * 8, prot=prot)
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("Q")

    @staticmethod
    def _slot(rollout_id: str) -> int:
        return zlib.crc32(rollout_id.encode()) & (STAMP_SLOTS - 1)

    def read(self, rollout_id: str) -> int:
        return int(self._slots[self._slot(rollout_id)])

    def bump(self, rollout_id: str) -> int:
        """Count one committed write of the rollout (the supervisor's one thread); the count."""
        i = self._slot(rollout_id)
        value = self._slots[i] + 1
        self._slots[i] = value
        return int(value)

    def close(self) -> None:
        self._slots.release()
        self._map.close()


#: Hash slots of ``ChildClaimBoard`` per worker (4 bytes each: 256 KiB a worker).
CLAIM_SLOTS = 1 << 16


def create_claim_board(path: Path, workers: int) -> None:
    """The supervisor's part: the claims file of ``workers`` workers, every count 0."""
    with open(path, "wb") as f:
        f.truncate(workers * CLAIM_SLOTS * 4)


class ChildClaimBoard:
    """The workers' shared ``ChildClaims`` (``core.linking.claims``): per worker a column of
    ``CLAIM_SLOTS`` counts in one mapped file, a parent's slot (a hash of its call id) counted
    up by each call in flight of that worker resolved to it. A worker writes its own column
    only; ``locked`` (``flock`` on the file) makes one worker's choose-and-claim whole
    against the others'. A replaced worker zeroes its column as it starts (claims of a worker
    that died are dropped with it). A hash collision makes a childless candidate look
    claimed: another identical one is preferred, the link still verified by tokens."""

    def __init__(self, path: Path, *, index: int, workers: int) -> None:
        self._fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(self._fd, workers * CLAIM_SLOTS * 4)
        except BaseException:
            os.close(self._fd)
            raise
        self._counts = memoryview(self._map).cast("I")
        self._workers = workers
        self._base = index * CLAIM_SLOTS
        with self.locked():
            self._counts[self._base : self._base + CLAIM_SLOTS] = memoryview(
                bytes(CLAIM_SLOTS * 4)
            ).cast("I")
        #: call id -> the slot it claimed (this worker's calls in flight that claimed)
        self._held: dict[str, int] = {}

    @staticmethod
    def _slot(call_id: str) -> int:
        return zlib.crc32(call_id.encode()) & (CLAIM_SLOTS - 1)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def claimed(self, parent_call_id: str) -> bool:
        slot, counts = self._slot(parent_call_id), self._counts
        return any(counts[w * CLAIM_SLOTS + slot] for w in range(self._workers))

    def claimed_elsewhere(self, key: str) -> bool:
        """True when a call in flight of another worker claims ``key`` (``claimed`` without
        this worker's own: ``core.linking.late_retry.AttemptsInFlight``)."""
        slot, counts, mine = self._slot(key), self._counts, self._base
        return any(
            counts[w * CLAIM_SLOTS + slot] for w in range(self._workers) if w * CLAIM_SLOTS != mine
        )

    def claim(self, call_id: str, parent_call_id: str) -> None:
        self.release(call_id)
        i = self._base + self._slot(parent_call_id)
        self._counts[i] += 1
        self._held[call_id] = i

    def release(self, call_id: str) -> None:
        i = self._held.pop(call_id, None)
        if i is not None and self._counts[i] > 0:
            self._counts[i] -= 1

    def close(self) -> None:
        self._counts.release()
        self._map.close()
        os.close(self._fd)


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=5)
    return _LENGTH.pack(len(data)) + data


class _Frames(asyncio.Protocol):
    """Length-prefixed pickles in, ``on_message`` per whole one."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= 4:
            (size,) = _LENGTH.unpack_from(buf)
            if len(buf) < 4 + size:
                return
            message = pickle.loads(buf[4 : 4 + size])
            del buf[: 4 + size]
            self.on_message(message)

    def on_message(self, message: Any) -> None:
        raise NotImplementedError


class WriterLost(StoreError):
    """The link to the store's writer was lost (the supervisor process died, or ended) with
    this write in flight, or before it was sent: whether a write in flight was committed is
    not known from the link (``WorkerStore`` finds out for a put)."""


#: What a write sent after the link was lost says.
_GONE = "the proxy's supervisor process (the store's one writer) is gone"


class WriterLink(_Frames):
    """A worker's connection to the supervisor: ``request`` sends one write and awaits its
    reply. A lost connection fails every write in flight and every later one (WriterLost)."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next = 0
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @classmethod
    async def connect(cls, path: Path) -> WriterLink:
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(cls, str(path))
        return link

    async def request(self, name: str, args: tuple[Any, ...]) -> Any:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise WriterLost(_GONE)
        self._next += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[self._next] = future
        transport.write(frame((self._next, name, args)))
        return await future

    def on_message(self, message: Any) -> None:
        request_id, ok, value = message
        future = self._pending.pop(request_id, None)
        if future is None or future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        gone = WriterLost(
            "the proxy's supervisor process (the store's one writer) died with this write in flight"
        )
        for future in self._pending.values():
            if not future.done():
                future.set_exception(gone)
        self._pending.clear()
        if not self.lost.done():
            self.lost.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class WorkerStore(SQLiteStore):
    """A worker's view of the embedded store: reads here, writes through ``link`` (module
    docstring). ``open`` opens the reader only; the supervisor opened (and migrated) the
    store before any worker started."""

    #: other workers write the same store: a digest miss reads it (``Linker``)
    shared = True

    def __init__(
        self,
        path: Path,
        link: Callable[[], WriterLink | None],
        *,
        stamps: RolloutStamps | None = None,
        synchronous: Literal["full", "normal"] = "full",
    ) -> None:
        super().__init__(path, synchronous=synchronous, exclusive=False)
        self._link = link
        self._stamps = stamps
        #: call id -> its rollout's count once its put was committed (``own_put_stamp``)
        self._own_puts: OrderedDict[str, int] = OrderedDict()
        #: what ``settle_wal`` did once the writer died (reader thread only)
        self._settled: str | None = None
        #: a descriptor of the store's ``-shm``, open while the reader is (``sqlite_wal``)
        self._shm_fd: int | None = None

    # --- the linker's index feed (``proxy.linker.IndexFeed``) -----------------------------

    def stamp(self, rollout_id: str) -> int:
        """The rollout's count of committed writes (0 without stamps)."""
        return self._stamps.read(rollout_id) if self._stamps is not None else 0

    async def last_rowid(self, rollout_id: str) -> int:
        return await self._read(self._last_rowid, rollout_id)

    async def stored_since(
        self, rollout_id: str, after_rowid: int
    ) -> tuple[list[StoredCall] | None, int]:
        return await self._read(self._stored_since, rollout_id, after_rowid)

    def own_put_stamp(self, call_id: str) -> int | None:
        """The rollout's count right after this worker's put of ``call_id`` (once)."""
        return self._own_puts.pop(call_id, None)

    def _stored_after_writer_died(self, db: sqlite3.Connection, call_id: str) -> bool:
        """Whether ``call_id`` is stored, once the writer died (reader thread): the WAL
        settled first (``sqlite_wal``: once; a dead writer writes nothing more), so the
        answer stays true after any restart."""
        if self._settled is None:
            try:
                if self._shm_fd is None:
                    self._shm_fd = os.open(f"{self.db_path}-shm", os.O_RDONLY)
            except FileNotFoundError:  # the last connection closed cleanly: WAL checkpointed
                self._settled = "no wal-index"
            else:
                lock = self.path / WRITER_LOCK_NAME
                self._settled = settle_wal(self.db_path, self._shm_fd, lock)
            log.warning("the store's writer died; its WAL: %s", self._settled)
        return db.execute(_STORED, (call_id,)).fetchone() is not None

    def _close_reader(self) -> None:
        super()._close_reader()
        if self._shm_fd is not None:  # after the connection: its locks are gone with it
            fd, self._shm_fd = self._shm_fd, None
            os.close(fd)

    async def open(self) -> None:
        if self._reader is not None:
            raise StoreError("store is already open")
        self._reader = WorkerThread("capture-store-reader")
        try:
            await self._reader.run(self._open_reader)
        except BaseException as exc:
            await self._shutdown()
            raise StoreError(f"cannot open store at {self.db_path}: {exc}") from exc

    def _writer_link(self) -> WriterLink:
        link = self._link()
        if link is None:
            raise WriterLost(_GONE)
        return link

    async def _write_hop(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            result: T = await self._writer_link().request(fn.__name__, args)
        except WriterLost as exc:  # a store failure as any other (``proxy.errors``)
            raise StoreError(str(exc)) from None
        return result

    async def _put_hop(
        self,
        record: CallRecord,
        request: RequestEncoding | None,
        digests: RecordDigests | None = None,
    ) -> int | None:
        # ``digests`` stay here: SHA-256 states do not pickle (the supervisor hashes)
        try:
            written, stamp = await self._writer_link().request("_put", (record, request))
        except WriterLost:
            # Committed or not, the writer cannot say any more: the store can (module
            # docstring of ``sqlite_wal``). Stored: a success like any other (its bytes not
            # known here); not stored: refused, and it never will be.
            if await self._read(self._stored_after_writer_died, record.call_id):
                log.warning(
                    "call %s: the supervisor (the store's writer) died with its put in flight, "
                    "after committing it: answered as stored",
                    record.call_id,
                )
                return None
            raise StoreError(
                f"the proxy's supervisor process (the store's one writer) died before call "
                f"{record.call_id} was committed: it is not stored"
            ) from None
        if stamp is not None:
            self._own_puts[record.call_id] = stamp
            if len(self._own_puts) > _OWN_PUTS_MAX:
                self._own_puts.popitem(last=False)
        return written  # type: ignore[no-any-return]


class _WriterServer(_Frames):
    """The supervisor's end of one worker's link."""

    def __init__(
        self,
        store: SQLiteStore | None,
        on_ready: Callable[[int, int], None],
        stamps: RolloutStamps | None,
    ) -> None:
        super().__init__()
        self.store = store
        self.on_ready = on_ready
        self.stamps = stamps
        self._tasks: set[asyncio.Task[None]] = set()

    def on_message(self, message: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._run(*message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, request_id: int, name: str, args: tuple[Any, ...]) -> None:
        try:
            value = await self._perform(name, args)
            reply = frame((request_id, True, value))
        except Exception as exc:  # the worker raises it as its own store would
            try:
                reply = frame((request_id, False, exc))
            except Exception:  # not picklable: its text
                reply = frame((request_id, False, StoreError(f"{type(exc).__name__}: {exc}")))
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(reply)

    async def _perform(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == READY:
            self.on_ready(*args)
            return None
        store = self.store
        if store is None or name not in WRITES:
            raise StoreError(f"no store write {name!r} here")
        if name == "_put":
            written = await store._put_hop(*args)
            # Counted before the worker hears of the commit (module docstring).
            stamp = self.stamps.bump(args[0].rollout_id) if self.stamps is not None else None
            return written, stamp
        result = await store._write_hop(getattr(store, name), *args)
        if self.stamps is not None and name in ("_delete", "_retire"):
            self.stamps.bump(args[0])
        return result


async def serve_writes(
    store: SQLiteStore | None,
    path: Path,
    on_ready: Callable[[int, int], None],
    stamps: RolloutStamps | None = None,
) -> asyncio.AbstractServer:
    """Serve the workers' links on the Unix socket ``path``: their writes to ``store`` (None:
    a store the workers write themselves, PostgreSQL, or none: only readiness), each
    committed write counted in ``stamps``."""
    loop = asyncio.get_running_loop()
    return await loop.create_unix_server(lambda: _WriterServer(store, on_ready, stamps), str(path))
