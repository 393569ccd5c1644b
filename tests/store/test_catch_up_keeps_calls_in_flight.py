"""A worker's catch-up that reads the rollout whole (``Linker._current_index``: a row stored
since that cannot tell its index facts, ``of_row``) keeps the index's calls in flight: they
are not in the store, so an index made again from it would not know them. A retry of a call
still in flight whose harness left would then find no call to retry, and with twin sessions
take the twin's candidate (the retried call's candidate is claimed by it): the retry in the
twin's chain, the twin's next call left to branch."""

from __future__ import annotations

from capture_proxy.core.linking.index import IN_FLIGHT
from capture_proxy.proxy.linker import Linker
from capture_proxy.store.remote import (
    ChildClaimBoard,
    RolloutStamps,
    WorkerStore,
    WriterLink,
    create_claim_board,
    serve_writes,
)
from capture_proxy.store.sqlite import SQLiteStore
from tests.support.twin_calls import NEXT, TASK, resolve_call, twin_call, twin_record


async def test_a_catch_up_that_reads_the_rollout_whole_keeps_its_calls_in_flight(tmp_path):
    writer = SQLiteStore(tmp_path / "store")
    await writer.open()
    stamps = RolloutStamps(tmp_path / "stamps", writable=True)
    server = await serve_writes(writer, tmp_path / "c.sock", lambda *a: None, stamps)
    link = await WriterLink.connect(tmp_path / "c.sock")
    create_claim_board(tmp_path / "claims", 1)
    store = WorkerStore(
        tmp_path / "store", lambda: link, stamps=RolloutStamps(tmp_path / "stamps", writable=False)
    )
    board = ChildClaimBoard(tmp_path / "claims", index=0, workers=1)
    try:
        await store.open()
        linker = Linker(store, refresh_on_miss=True, feed=store, claims=board)
        for call_id, at in (("x1", 1.0), ("y1", 2.0)):
            assert await twin_call(linker, store, "r1", call_id, at, TASK) is None
        # twin x's continuation is in flight (x1 claimed); its harness left
        x2 = await resolve_call(linker, "r1", "x2", 3.0, NEXT, left=True)
        assert x2.resolution.parent_call_id == "x1"
        # a row of the rollout that cannot tell its index facts (no child digest: written
        # unverified, as by an older version) is stored meanwhile
        await store.put_call(twin_record("old", "r1", 0.5, [{"role": "user", "content": "Other."}]))
        rows, _ = await store.stored_since("r1", 0)
        assert rows is None
        # x2's retry: the catch-up reads the rollout whole and must still know x2 in flight
        x2r = await resolve_call(linker, "r1", "x2r", 4.0, NEXT)
        entry = linker.indexes.peek("r1").entries.get("x2")
        assert entry is not None and entry.status == IN_FLIGHT
        assert x2r.resolution.retry_of == "x2", "the retry of x2 (in flight, harness gone) missed"
        assert x2r.resolution.parent_call_id == "x1", "x2's retry took the twin's call"
        assert linker._is_current("r1")
        assert await x2r.finish(linker, store) == "x1"
        assert await x2.finish(linker, store) == "x1"
        assert await twin_call(linker, store, "r1", "y2", 5.0, NEXT) == "y1"
        assert linker.indexes.in_flight == {} and linker.indexes.in_flight_calls == {}
    finally:
        board.close()
        await store.close()
        link.close()
        server.close()
        await writer.close()
        stamps.close()
