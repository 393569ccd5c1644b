"""Tier 2: the read API's deadline end to end (``rest.deadline``, ``read_api_timeout_s``): a read
held up in the store is answered 503 ``read_timeout`` in time, never hangs, and leaves the
store as it was: the reader thread goes on, a timed-out read it had not started is dropped."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from capture_proxy.store.sqlite import SQLiteStore
from tests.factories import record
from tests.proxy.conftest import MakeStack


class HeldStore(SQLiteStore):
    """A store whose first rollout read waits on ``release`` (on its reader thread)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.release, self.held = threading.Event(), threading.Event()
        self.rollout_reads = 0

    def _get_rollout_with_calls(self, db: Any, rollout_id: str) -> Any:
        self.rollout_reads += 1
        if not self.held.is_set():
            self.held.set()
            assert self.release.wait(timeout=30)
        return super()._get_rollout_with_calls(db, rollout_id)


async def test_a_read_held_in_the_store_is_a_503_and_the_store_goes_on(
    make_stack: MakeStack, tmp_path: Path
):
    store = HeldStore(tmp_path / "store")
    stack = await make_stack(store=store, read_api_timeout_s=0.2)
    await store.put_call(record("c1", [1, 2], [3]))
    await store.put_call(record("c2", [1, 2, 3, 4], [5]))
    try:
        held = await stack.client.get("/captures/rollouts/r1/chains")
        assert store.held.is_set()
        queued = await stack.client.get("/captures/rollouts/r1")  # behind the held read
        for resp in (held, queued):
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "5"
            error = (await resp.json())["error"]
            assert (error["code"], error["type"]) == ("read_timeout", "server_error")
    finally:
        store.release.set()
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [["c1", "c2"]]
    # The held read ran to its end (its answer discarded); the one queued behind it, whose
    # caller had given up, was dropped unrun: no work piles up behind reads that timed out.
    assert store.rollout_reads == 2
    assert store._reader is not None and store._reader.dropped == 1
