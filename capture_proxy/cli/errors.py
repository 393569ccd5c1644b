"""``CommandError``: a command that cannot do what it was asked, said in one line; and
``ServeExit``, ``serve``'s start-up failure (raised by ``cli.serve`` and the supervisor of its
workers, ``cli.workers``).

Owns the exception only; ``cli.main`` is the one place that turns it into a line on stderr
(``capture-proxy <command>: <message>``) and the exit code, so that no command prints a
traceback for a bad argument, an unreadable file or an unreachable proxy.
"""

from __future__ import annotations


class CommandError(Exception):
    """The command stops: ``message`` names the problem (the flag or file, and why).

    ``exit_code``: 2 when the command cannot run on this input or in this environment (as
    ``serve``'s invalid settings and ``show``'s missing store), 1 when it ran and failed (as
    ``show`` of a rollout the store does not hold).
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ServeExit(Exception):
    """Start-up failed: the message to print (after ``capture-proxy: ``); exit status 2."""
