"""What the call flow's protocol costs per streamed piece, alone (microseconds, best of N).

The pure core drives a call as a generator of commands (``core.flow``); the executor performs
each and sends the reply back (``proxy.drive.drive``). A streamed piece is two round trips:
``ReadEngine`` -> ``EnginePiece``, ``WriteClient`` -> ``ClientState``, through the flow's
nested ``yield from`` (call -> relay -> pump). This times that protocol with the core's own
command and event classes and an executor whose handlers answer at once (no I/O, no capture
work), against the same reads and writes made by a direct loop: the difference is what moving
the per-piece loop out of the flow (into the executor) could save.

Run: ``.venv/bin/python benchmarks/flow_roundtrip.py [--pieces 200000] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Generator
from typing import Any

from capture_proxy.core.flow.commands import READ_ENGINE, ReadEngine, WriteClient
from capture_proxy.core.flow.events import CLIENT_THERE, ClientState, EnginePiece

Flow = Generator[Any, Any, bool]


def _pump() -> Flow:
    while True:
        piece = yield READ_ENGINE
        if piece is None:
            return False
        state: ClientState = yield WriteClient(piece.data)
        if state.gone:
            return True


def _relay() -> Flow:
    return (yield from _pump())


def _call() -> Flow:
    return (yield from _relay())


class _Executor:
    """Answers at once: ``pieces`` pieces of one byte, then the end."""

    def __init__(self, pieces: int) -> None:
        self.left = pieces
        self.written = 0

    async def read(self, command: Any) -> EnginePiece | None:
        if self.left == 0:
            return None
        self.left -= 1
        return EnginePiece(b"x", None)

    async def write(self, command: WriteClient) -> ClientState:
        self.written += len(command.data)
        return CLIENT_THERE

    HANDLERS: dict[type, Any] = {ReadEngine: read, WriteClient: write}

    def execute(self, command: Any) -> Any:
        return self.HANDLERS[type(command)](self, command)


async def _drive(flow: Flow, executor: _Executor) -> bool:
    """``proxy.drive.drive``'s loop without its cancellation handling."""
    reply: Any = None
    while True:
        try:
            command = flow.send(reply)
        except StopIteration as stop:
            return bool(stop.value)
        reply = await executor.execute(command)


async def _direct(executor: _Executor) -> bool:
    while True:
        piece = await executor.read(READ_ENGINE)
        if piece is None:
            return False
        state = await executor.write(WriteClient(piece.data))
        if state.gone:
            return True


async def _run(pieces: int, repeat: int) -> dict[str, float]:
    best = {"flow": float("inf"), "direct": float("inf")}
    for _ in range(repeat):
        for name in best:
            executor = _Executor(pieces)
            t0 = time.perf_counter()
            await (_drive(_call(), executor) if name == "flow" else _direct(executor))
            elapsed_us = (time.perf_counter() - t0) / pieces * 1e6
            assert executor.written == pieces
            best[name] = min(best[name], elapsed_us)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pieces", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    try:
        import uvloop

        best = uvloop.run(_run(args.pieces, args.repeat))
    except ImportError:
        best = asyncio.run(_run(args.pieces, args.repeat))
    flow, direct = best["flow"], best["direct"]
    print(f"per piece, best of {args.repeat} x {args.pieces:,}:")
    print(f"  through the flow (2 commands, 3 generators deep): {flow:.2f} us")
    print(f"  a direct loop (the same reads and writes):        {direct:.2f} us")
    print(f"  the protocol's own cost: {flow - direct:.2f} us ({flow / direct:.2f}x)")


if __name__ == "__main__":
    main()
