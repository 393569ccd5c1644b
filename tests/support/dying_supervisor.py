"""``capture-proxy`` whose ``serve --workers`` supervisor SIGKILLs itself at a put of a rollout
named ``die-after-commit...`` (once the store committed it, before the worker hears) or
``die-before-commit...`` (before the store sees it): the fault injection point of
``tests/test_workers.py``'s writer-crash test. The workers are the real ones.

Usage: ``python -m tests.support.dying_supervisor serve ...`` (``capture-proxy``'s arguments)
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from capture_proxy.cli import main
from capture_proxy.store import remote

_perform = remote._WriterServer._perform


async def _perform_or_die(self: Any, name: str, args: tuple[Any, ...]) -> Any:
    rollout = args[0].rollout_id if name == "_put" else ""
    if rollout.startswith("die-before-commit"):
        os.kill(os.getpid(), signal.SIGKILL)
    value = await _perform(self, name, args)
    if rollout.startswith("die-after-commit"):
        os.kill(os.getpid(), signal.SIGKILL)
    return value


remote._WriterServer._perform = _perform_or_die  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
