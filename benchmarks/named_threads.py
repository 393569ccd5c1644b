"""Run ``capture-proxy`` with each Python thread's name given to the OS thread too, so the
benchmarks can read each thread's CPU by role (``/proc/<pid>/task/<tid>/comm``; Python 3.11
does not name OS threads).

``python benchmarks/named_threads.py serve ...`` is ``capture-proxy serve ...`` with
``threading.Thread`` patched once at start-up to call ``prctl(PR_SET_NAME)`` as each thread
starts (the kernel keeps the first 15 bytes). Must not: change anything else in the process.
The source tree is whatever ``capture_proxy`` resolves to (``PYTHONPATH`` for a baseline).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

PR_SET_NAME = 15


def _name_os_threads() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def named(self: threading.Thread, *args: Any) -> Any:
        libc.prctl(PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
        return bootstrap(self, *args)

    threading.Thread._bootstrap_inner = named  # type: ignore[attr-defined]


if __name__ == "__main__":
    _name_os_threads()
    sys.path.pop(0)  # this script's folder: not a package root
    from capture_proxy.cli import main

    sys.exit(main())
