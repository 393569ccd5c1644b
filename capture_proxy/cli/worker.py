"""One worker of ``serve --workers N``: a whole proxy app on the supervisor's listening socket.

Started by the supervisor (``cli.workers``) as ``python -m capture_proxy.cli.worker RUNTIME
INDEX FD``: reads the plan from its stdin (a pipe from the supervisor: the tokens never touch
the disk), finds the shared files in the supervisor's private ``RUNTIME`` directory, serves on the
inherited socket ``FD``, connects to the supervisor (``store.remote.WriterLink``: its store
writes, and the word that it listens) and ends with it: the kernel sends it SIGTERM when the
supervisor dies (``PR_SET_PDEATHSIG``), and a lost link stops it too. Must not: be run by
hand.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import pickle
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from capture_proxy.cli.workers import (
    ATTEMPTS_FILE,
    CLAIMS_FILE,
    CONTROL_SOCKET,
    METRICS_DIR,
    PINS_FILE,
    STAMPS_FILE,
    WorkerPlan,
)

if TYPE_CHECKING:
    from aiohttp import web

    from capture_proxy.store.remote import WriterLink

log = logging.getLogger("capture_proxy")

PR_SET_PDEATHSIG = 1


def _end_with_supervisor(supervisor_pid: int) -> None:
    """SIGTERM when the supervisor dies (Linux); exit now when it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != supervisor_pid:
        sys.exit(1)


def _app(plan: WorkerPlan, index: int, runtime: Path, link: WriterLink) -> web.Application:
    """The worker's app over its store (not opened yet)."""
    from capture_proxy.app import build_proxy_app, build_read_only_app
    from capture_proxy.proxy.keys import WorkerRole
    from capture_proxy.store import open_store
    from capture_proxy.store.postgres import is_postgres_url
    from capture_proxy.store.remote import ChildClaimBoard, RolloutStamps, WorkerStore

    settings = plan.settings
    if plan.read_only:
        store = open_store(settings.store, read_only=True)
        return build_read_only_app(settings, store, backend=plan.viewer_backend)
    role = WorkerRole(index, plan.count, str(runtime / METRICS_DIR), str(runtime / PINS_FILE))
    if is_postgres_url(str(settings.store)):
        store = open_store(settings.store, pool_size=settings.store_pool_size)
        return build_proxy_app(settings, store, worker=role)
    worker_store = WorkerStore(
        Path(settings.store),
        lambda: link,
        stamps=RolloutStamps(runtime / STAMPS_FILE, writable=False),
        synchronous=settings.store_synchronous,
    )
    claims = ChildClaimBoard(runtime / CLAIMS_FILE, index=index, workers=plan.count)
    attempts = ChildClaimBoard(runtime / ATTEMPTS_FILE, index=index, workers=plan.count)
    return build_proxy_app(
        settings,
        worker_store,
        worker=role,
        index_feed=worker_store,
        child_claims=claims,
        attempts=attempts,
    )


def main(argv: list[str]) -> int:
    runtime, index, fd = Path(argv[0]), int(argv[1]), int(argv[2])
    plan: WorkerPlan = pickle.loads(sys.stdin.buffer.read())
    _end_with_supervisor(plan.supervisor_pid)
    from capture_proxy.cli.serve import _configure_logging, new_event_loop
    from capture_proxy.proxy import server
    from capture_proxy.store.remote import READY, WriterLink

    settings = plan.settings
    _configure_logging(settings)
    sock = socket.socket(fileno=fd)
    loop = new_event_loop(settings.event_loop)
    asyncio.set_event_loop(loop)
    link = loop.run_until_complete(WriterLink.connect(runtime / CONTROL_SOCKET))
    app = _app(plan, index, runtime, link)

    def listening() -> None:
        gc.freeze()  # as ``serve``: start-up's objects out of the collector's way
        loop.create_task(link.request(READY, (index, os.getpid())))
        # The supervisor is gone: stop as on SIGTERM (calls in flight end first).
        link.lost.add_done_callback(lambda _: os.kill(os.getpid(), signal.SIGTERM))

    try:
        server.run(
            app,
            sock,
            backlog=settings.listen_backlog,
            on_listening=listening,
            server_kwargs=settings.server_kwargs,
            loop=loop,
        )
    except Exception as exc:
        log.error("worker %d: %s: %s", index, type(exc).__name__, exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
