"""A worker's catch-up that reads the rollout whole (``Linker._current_index``: a row stored
since that cannot tell its index facts, ``of_row``) keeps the index's calls in flight: they
are not in the store, so an index made again from it would not know them. A retry of a call
still in flight whose harness left would then find no call to retry, and with twin sessions
take the twin's candidate (the retried call's candidate is claimed by it): the retry in the
twin's chain, the twin's next call left to branch."""

from __future__ import annotations

from typing import Any

import numpy as np

from capture_proxy.core.capture import prepare_request
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.linking.index import IN_FLIGHT
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.records import CallRecord
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

TASK = [{"role": "user", "content": "Count the files."}]
ANSWER = "There are 2 files."
NEXT = [*TASK, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Go on."}]
KNOWN = KnownMessages()


def _record(call_id: str, at: float, messages: list[dict[str, Any]]) -> CallRecord:
    first = messages is TASK
    prompt, gen = ([1, 2], [3, 4]) if first else ([1, 2, 3, 4, 5], [6])
    return CallRecord(
        call_id=call_id,
        rollout_id="r1",
        created_at=at,
        model="m",
        request_messages=messages,
        request_received={"model": "m"},
        response_message={"role": "assistant", "content": ANSWER if first else "ok"},
        prompt_token_ids=np.asarray(prompt, np.uint32),
        generation_token_ids=np.asarray(gen, np.uint32),
        generation_log_probs=np.full(len(gen), -0.5, np.float32),
    )


async def _resolve(linker: Linker, call_id: str, at: float, messages, *, left: bool = False):
    prepared = prepare_request({"model": "m", "messages": messages}, None, KNOWN.facts(messages))
    resolution = await linker.resolve(
        "r1",
        prepared.linking_messages,
        prepared.body,
        call_id=call_id,
        created_at=at,
        linking_facts=prepared.linking_facts,
        history_keys=prepared.history_keys,
        ends_incomplete=(lambda: True) if left else None,
    )
    return prepared, resolution


async def _finish(linker: Linker, store: WorkerStore, call_id, at, messages, flight) -> str | None:
    prepared, resolution = flight
    record = await linker.verify(
        _record(call_id, at, messages),
        resolution,
        prepared.linking_messages,
        harness_note=None,
        retry_count=None,
        decode=None,
    )
    await store.put_call(record)
    await linker.remember(record)
    linker.release("r1", call_id)
    return record.parent_call_id


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
            flight = await _resolve(linker, call_id, at, TASK)
            assert await _finish(linker, store, call_id, at, TASK, flight) is None
        # twin x's continuation is in flight (x1 claimed); its harness left
        x2 = await _resolve(linker, "x2", 3.0, NEXT, left=True)
        assert x2[1].parent_call_id == "x1"
        # a row of the rollout that cannot tell its index facts (no child digest: written
        # unverified, as by an older version) is stored meanwhile
        await store.put_call(_record("old", 0.5, [{"role": "user", "content": "Other."}]))
        rows, _ = await store.stored_since("r1", 0)
        assert rows is None
        # x2's retry: the catch-up reads the rollout whole and must still know x2 in flight
        x2r = await _resolve(linker, "x2r", 4.0, NEXT)
        entry = linker.indexes.peek("r1").entries.get("x2")
        assert entry is not None and entry.status == IN_FLIGHT
        assert isinstance(x2r[1], Resolution)
        assert x2r[1].retry_of == "x2", "the retry of x2 (in flight, its harness gone) was missed"
        assert x2r[1].parent_call_id == "x1", "x2's retry took the twin's call"
        assert linker._is_current("r1")
        assert await _finish(linker, store, "x2r", 4.0, NEXT, x2r) == "x1"
        assert await _finish(linker, store, "x2", 3.0, NEXT, x2) == "x1"
        y2 = await _resolve(linker, "y2", 5.0, NEXT)
        assert await _finish(linker, store, "y2", 5.0, NEXT, y2) == "y1"
        assert linker.indexes.in_flight == {} and linker.indexes.in_flight_calls == {}
    finally:
        board.close()
        await store.close()
        link.close()
        server.close()
        await writer.close()
        stamps.close()
