"""``serve --workers N`` (N > 1): the supervisor of N worker processes on one listening socket.

Owns the processes. The supervisor binds the socket (``serve``), opens the embedded store as
its one writer (``store.remote``: the workers send it their writes, it commits them in
groups), and starts the workers (``cli.worker``), each a whole proxy app with its own event
loop, handed the listening socket (the kernel gives each new connection to one of the
workers waiting on it), the settings (pickled through the worker's stdin, never written to
disk: they hold the tokens), the directory of the shared metric files
(``PROMETHEUS_MULTIPROC_DIR``) and the engines' pins file (``PINS_FILE``: which engine each
rollout goes to, ``proxy.engines``) in a private runtime directory (only this user may enter it),
which it holds a lock on (``SUPERVISOR_LOCK``) while it lives; a supervisor starting sweeps the
runtime directories of supervisors that died (``sweep_dead_runtimes``). It prints the serving
line (and writes ``--port-file``) once every worker listens; a worker that exits during
start-up stops it with status 2 (the worker's own error is in the log above). A worker that
dies later is started again (at most ``MAX_RESTARTS`` a minute, then the supervisor stops with
status 1) and its gauges leave the metrics. SIGINT or SIGTERM closes the supervisor's copy of
the listening socket and stops the workers (each closes its own, then ends its calls in flight
as one proxy does, ``proxy.server``), then the store.

With PostgreSQL the workers are replicas that open the store themselves; with ``--read-only``
each opens the store read-only. The supervisor then only supervises.

Must not: serve a request, or decide anything about a call.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import pickle
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from capture_proxy.cli.errors import ServeExit
from capture_proxy.config import Settings

log = logging.getLogger("capture_proxy")

#: What a runtime directory's name starts with (``tempfile.mkdtemp``'s prefix).
RUNTIME_PREFIX = "capture-proxy-workers-"
#: Held (flock) by the supervisor while it lives: a runtime directory whose lock is free is
#: a dead supervisor's.
SUPERVISOR_LOCK = "supervisor.lock"
#: What older versions left: the pickled settings, tokens included.
LEGACY_PLAN_FILE = "plan.pickle"
CONTROL_SOCKET = "control.sock"
STAMPS_FILE = "stamps"
CLAIMS_FILE = "claims"
#: The workers' calls in flight by request and harness session (``core.linking.late_retry``).
ATTEMPTS_FILE = "attempts"
PINS_FILE = "engine-pins"
METRICS_DIR = "metrics"
#: Restarts of dead workers allowed in a minute before the supervisor gives up.
MAX_RESTARTS = 5
#: How long a stopping worker may take past ``shutdown_timeout_s`` (its calls in flight are
#: cut then, and stored incomplete, which takes a moment) before it is killed.
STOP_MARGIN_S = 15.0


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker is started with."""

    settings: Settings
    count: int
    read_only: bool
    #: ``serve --read-only``'s engine for the viewer's ``/detokenize``
    viewer_backend: str | None
    #: the supervisor's pid: a worker whose parent is another process exits
    supervisor_pid: int


class Supervisor:
    def __init__(self, plan: WorkerPlan, sock: socket.socket, runtime: Path) -> None:
        self.plan = plan
        self.sock = sock
        self.runtime = runtime
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.ready: dict[int, int] = {}
        self.all_ready = asyncio.Event()
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self.restarts: list[float] = []

    def on_ready(self, index: int, pid: int) -> None:
        self.ready[index] = pid
        if len(self.ready) == self.plan.count:
            self.all_ready.set()

    async def start(self, index: int) -> asyncio.subprocess.Process:
        fd = self.sock.fileno()
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.runtime / METRICS_DIR)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "capture_proxy.cli.worker",
            str(self.runtime), str(index), str(fd),
            pass_fds=(fd,), env=env, stdin=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self.procs[index] = proc
        assert proc.stdin is not None
        # The plan through a pipe: its tokens never touch the disk.
        proc.stdin.write(pickle.dumps(self.plan, protocol=5))
        with contextlib.suppress(ConnectionError):  # it died first: ``keep`` sees it exit
            await proc.stdin.drain()
        proc.stdin.close()
        return proc

    async def wait_ready(self) -> None:
        """Until every worker listens. Raises ServeExit when one exits first."""
        ready = asyncio.ensure_future(self.all_ready.wait())
        exits = {asyncio.ensure_future(p.wait()): i for i, p in self.procs.items()}
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            done, _ = await asyncio.wait([ready, stop, *exits], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (ready, stop, *exits):
                task.cancel()
        for task in done:
            if task in exits and ready not in done:
                index, code = exits[task], task.result()
                raise ServeExit(f"worker {index} exited during start-up with status {code}")

    async def keep(self, index: int) -> None:
        """Start worker ``index`` again whenever it dies, until stopping."""
        while not self.stopping.is_set():
            proc = self.procs[index]
            code = await proc.wait()
            if self.stopping.is_set():
                return
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(proc.pid, str(self.runtime / METRICS_DIR))
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < 60] + [now]
            if len(self.restarts) > MAX_RESTARTS:
                log.error(
                    "worker %d (pid %d) exited with status %s: %d restarts in a minute, "
                    "stopping",
                    index, proc.pid, code, len(self.restarts) - 1,
                )  # fmt: skip
                self.exit_code = 1
                self.stopping.set()
                return
            log.error("worker %d (pid %d) exited with status %s; starting it again",
                      index, proc.pid, code)  # fmt: skip
            await self.start(index)

    async def stop_workers(self) -> None:
        # The listening socket is closed once every process has closed its copy: a new
        # connection is then refused (a load balancer or a harness goes elsewhere at once),
        # where the kernel would take it in while any copy stays open and reset it at the end.
        self.sock.close()
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline_s = self.plan.settings.shutdown_timeout_s + STOP_MARGIN_S
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), deadline_s)
            except TimeoutError:
                log.error("worker pid %d did not stop in %.0f s: killed", proc.pid,
                          deadline_s)  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


def _hold_lock(runtime: Path) -> int:
    """Lock ``runtime`` as a live supervisor's; the descriptor that holds it. The lock file
    appears already locked (renamed into place), so a sweeper never sees it free."""
    fd = os.open(runtime / f".{SUPERVISOR_LOCK}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(runtime / f".{SUPERVISOR_LOCK}", runtime / SUPERVISOR_LOCK)
    return fd


def _is_dead_runtime(path: Path) -> bool:
    """``path`` is a runtime directory of this user's whose supervisor is dead: its lock is
    free, or (an older version's, without the lock) its control socket refuses connections
    (the supervisor listens on it from start-up until it has stopped its workers)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    try:
        fd = os.open(path / SUPERVISOR_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        if not (path / LEGACY_PLAN_FILE).exists():
            return False  # a supervisor starting: its lock is not there yet
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path / CONTROL_SOCKET))
            except ConnectionRefusedError:
                return True
            except OSError:
                return False
        return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def sweep_dead_runtimes(tmp: Path) -> list[Path]:
    """Remove the runtime directories in ``tmp`` of this user's supervisors that died (a
    SIGKILL leaves its directory: its metric files, and in older versions the pickled settings
    with their tokens); the ones removed."""
    removed = []
    for path in sorted(tmp.glob(f"{RUNTIME_PREFIX}*")):
        if _is_dead_runtime(path):
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s, the runtime directory of a supervisor that died", path)
            removed.append(path)
    return removed


async def _supervise(plan: WorkerPlan, sock: socket.socket, runtime: Path,
                     on_listening: Callable[[], None]) -> int:  # fmt: skip
    from capture_proxy.proxy.engines import create_pin_board
    from capture_proxy.store.base import StoreError
    from capture_proxy.store.postgres import is_postgres_url
    from capture_proxy.store.remote import RolloutStamps, create_claim_board, serve_writes
    from capture_proxy.store.sqlite import SQLiteStore

    settings = plan.settings
    store = stamps = None
    if not plan.read_only and not is_postgres_url(str(settings.store)):
        store = SQLiteStore(Path(settings.store), synchronous=settings.store_synchronous)
        try:
            await store.open()
        except StoreError as exc:
            raise ServeExit(str(exc)) from exc
        stamps = RolloutStamps(runtime / STAMPS_FILE, writable=True)
        create_claim_board(runtime / CLAIMS_FILE, plan.count)
        create_claim_board(runtime / ATTEMPTS_FILE, plan.count)
    create_pin_board(runtime / PINS_FILE, len(settings.backend_bases), plan.count)
    sup = Supervisor(plan, sock, runtime)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.stopping.set)
    server = await serve_writes(store, runtime / CONTROL_SOCKET, sup.on_ready, stamps)
    try:
        for index in range(plan.count):
            await sup.start(index)
        await sup.wait_ready()
        if not sup.stopping.is_set():
            on_listening()
        keepers = [asyncio.ensure_future(sup.keep(i)) for i in range(plan.count)]
        await sup.stopping.wait()
        for task in keepers:
            task.cancel()
        return sup.exit_code
    finally:
        sup.stopping.set()
        await sup.stop_workers()
        server.close()
        if store is not None:
            await store.close()
        if stamps is not None:
            stamps.close()


def run_workers(
    plan: WorkerPlan,
    sock: socket.socket,
    loop: asyncio.AbstractEventLoop,
    on_listening: Callable[[], None],
) -> int:
    """Serve with ``plan.count`` workers until SIGINT or SIGTERM; the exit status. Raises
    ServeExit when start-up fails (the store, a worker)."""
    sweep_dead_runtimes(Path(tempfile.gettempdir()))
    runtime = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX))  # mode 0700
    lock = _hold_lock(runtime)
    try:
        (runtime / METRICS_DIR).mkdir()
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(_supervise(plan, sock, runtime, on_listening))
    finally:
        loop.close()
        asyncio.set_event_loop(None)
        shutil.rmtree(runtime, ignore_errors=True)
        os.close(lock)
