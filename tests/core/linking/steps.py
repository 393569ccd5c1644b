"""Playing a linking step by hand: its commands checked one by one, the replies fed in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capture_proxy.core.linking.commands import Command, Step


def play(step: Step[Any], script: Sequence[tuple[Command[Any], Any]]) -> Any:
    """Run ``step`` to its end; it must ask exactly the commands of ``script`` (``(command,
    reply)`` pairs), in order, each answered with its reply. Returns the step's result."""
    asked: list[Command[Any]] = []
    try:
        command = next(step)
        while True:
            asked.append(command)
            assert len(asked) <= len(script), f"asked more than the script: {asked}"
            expected, reply = script[len(asked) - 1]
            assert command == expected, (command, expected)
            command = step.send(reply)
    except StopIteration as done:
        assert asked == [command for command, _ in script]
        return done.value
