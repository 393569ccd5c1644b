"""Waiting for a listening socket to be closed (the tests of the proxy's stop)."""

from __future__ import annotations

import asyncio


async def until_refused(port: int, deadline_s: float) -> None:
    """Poll 127.0.0.1:``port`` until a new connection is refused (one taken in before the stop
    is closed again; one reset as the socket closes is tried again). Raises TimeoutError after
    ``deadline_s``."""
    async with asyncio.timeout(deadline_s):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                return
            except ConnectionResetError:
                continue
            writer.close()
            await asyncio.sleep(0.01)
