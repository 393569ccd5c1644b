"""The one loop that runs a call's flow on an executor (``proxy.executor``).

Cancellation (the harness left, the server cancelled the handler): a command the flow can act
on is answered ``ClientLeft`` (or a gone ``ClientState``), the commands after it run shielded
so the record is written, then the cancellation goes on; during any other command it goes
through at once, as the flow cannot act on it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from capture_proxy.core.flow.call import Flow, Outcome
from capture_proxy.proxy.executor import CallExecutor


async def drive(flow: Flow[Outcome], executor: CallExecutor) -> Outcome:
    """Run ``flow`` on ``executor`` to its end: each command performed, its reply sent back.
    Raises what the flow raises (the core's errors), and the handler's cancellation once the
    flow has recorded the call."""
    reply: Any = None
    cancelled = False
    try:
        while True:
            try:
                command = flow.send(reply)
            except StopIteration as stop:
                outcome: Outcome = stop.value
                break
            if cancelled:
                reply = await asyncio.shield(executor.execute(command))
                continue
            try:
                reply = await executor.execute(command)
            except asyncio.CancelledError:
                if not command.client_left_reply:
                    raise
                cancelled = True
                reply = executor.client_left(command)
    finally:
        await executor.close()
    if cancelled:
        raise asyncio.CancelledError
    return outcome
