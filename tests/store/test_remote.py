"""The embedded store shared by workers (``store.remote``): a worker's writes travel to the one
writer and come back with their results and their errors; its reads are its own; a lost
writer fails writes, never silently."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import os
import pickle
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from capture_proxy.core.linking.stored import of_record
from capture_proxy.core.records import CallRecord, CallStatus
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.proxy.linker import Linker
from capture_proxy.store.base import ConflictingRecord, RolloutDeleted, StoreError
from capture_proxy.store.remote import (
    READY,
    ChildClaimBoard,
    RolloutStamps,
    WorkerStore,
    WriterLink,
    _WriterServer,
    create_claim_board,
    frame,
    serve_writes,
)
from capture_proxy.store.sqlite import SQLiteStore
from tests.core.test_codec_v2 import assert_same, chain
from tests.factories import record

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def writer_and_worker(tmp_path):
    """The supervisor's store serving writes, and one worker's store over a link to it."""
    writer = SQLiteStore(tmp_path / "store")
    await writer.open()
    ready: list[tuple[int, int]] = []
    server = await serve_writes(writer, tmp_path / "control.sock", lambda *a: ready.append(a))
    link = await WriterLink.connect(tmp_path / "control.sock")
    worker = WorkerStore(tmp_path / "store", lambda: link)
    await worker.open()
    yield writer, worker, link, ready
    link.close()
    await worker.close()
    server.close()
    await writer.close()


async def test_a_workers_puts_are_committed_by_the_writer_and_read_back_here(writer_and_worker):
    writer, worker, link, ready = writer_and_worker
    assert worker.shared and not writer.shared  # a worker's link index refreshes on a miss
    records = chain(5)
    written = await asyncio.gather(*(worker.put_call(r) for r in records))
    assert all(w > 0 for w in written)
    for r in records:
        assert_same(await worker.get_call(r.call_id), r)
    assert (await worker.health())["calls"] == 5
    await link.request(READY, (3, 1234))
    assert ready == [(3, 1234)]


async def test_store_errors_come_back_as_themselves(writer_and_worker):
    _, worker, _, _ = writer_and_worker
    await worker.put_call(record("a", [1, 2], [3], rollout_id="gone"))
    assert await worker.delete_rollout("gone") == 1
    with pytest.raises(RolloutDeleted):
        await worker.put_call(record("b", [1], [2], rollout_id="gone"))
    await worker.put_call(record("c", [1], [2]))
    with pytest.raises(ConflictingRecord):
        await worker.put_call(record("c", [1], [9]))
    snapshot = await worker.freeze_rollout("r1")
    assert snapshot.num_calls == 1
    with pytest.raises(StoreError, match="no store write"):
        await worker._writer_link().request("_get_call", ("c",))  # reads are not sent


async def test_a_records_request_encoding_still_belongs_to_it_after_the_trip():
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    rec = record("c", [1], [2])
    rec.request_messages, rec.request_tools = messages, tools
    encoding = RequestEncoding.of(messages, tools)
    (_, _, (rec2, enc2)) = pickle.loads(frame((1, "_put", (rec, encoding)))[4:])
    assert enc2.belongs_to(rec2)


async def test_a_lost_writer_fails_later_writes(writer_and_worker):
    """After the link is lost a put is looked up in the store (here: the writer, still up,
    committed the put in flight), a later one fails and is not stored; so do other writes."""
    _, worker, link, _ = writer_and_worker
    put = asyncio.ensure_future(worker.put_call(record("x", [1], [2])))
    await asyncio.sleep(0)  # the request is written
    link.close()  # as when the supervisor dies
    assert await asyncio.wait_for(put, 30) is None
    with pytest.raises(StoreError, match="supervisor"):
        await worker.put_call(record("y", [1], [2]))
    assert await worker.get_call("y") is None
    with pytest.raises(StoreError, match="supervisor") as raised:
        await worker.freeze_rollout("r1")
    assert type(raised.value) is StoreError  # a store failure (503), not an answer


def _linked(call_id: str, prompt: list[int], gen: list[int], **fields: Any) -> CallRecord:
    """A record as the proxy stores it: its linking digests and its answer."""
    rec = record(call_id, prompt, gen)
    rec.response_message = {"role": "assistant", "content": f"answer of {call_id}"}
    rec.linking = {"verdict": "root", "child_digest": f"child-{call_id}",
                   "request_digest": f"req-{call_id}"}  # fmt: skip
    rec.model = "m"
    for key, value in fields.items():
        setattr(rec, key, value)
    return rec


async def test_a_rows_index_facts_are_its_records(writer_and_worker):
    """``of_row`` from the stored columns gives what ``of_record`` gives from the decoded
    record, for complete (long and short), failed, incomplete, retried, routed-expert and
    harness-note calls, and one that continued a prefill."""
    _, worker, _, _ = writer_and_worker
    long_prompt = list(range(1, 700))
    experts = np.arange(3 * 2 * 2, dtype=np.uint8).reshape(3, 2, 2)
    records = [
        _linked("a", [1, 2, 3], [4, 5]),
        _linked(
            "b",
            long_prompt,
            [9, 9],
            parent_call_id=None,
            routed_experts=experts,
            routed_experts_start=698,
        ),
        _linked("c", [1, 2, 3], [4], status=CallStatus.FAILED),
        _linked("d", [1, 2, 3, 4, 5, 6], [7], status=CallStatus.INCOMPLETE, retry_of="a"),
        _linked("e", [1, 2, 3, 4, 5, 8], [7]),
    ]
    records[4].linking = {**records[4].linking, "harness_note": "opencode.step_limit"}
    records[4].parent_call_id = "a"
    prefill = {"role": "assistant", "content": "Sure,"}
    prefilled = _linked("f", [1, 2, 3, 4, 5, 8, 7, 9], [6])
    prefilled.request_messages = [*prefilled.request_messages, prefill]
    prefilled.linking = {**prefilled.linking, "prefill": True, "prefill_message": prefill}
    records.append(prefilled)
    # the harness session each request named (core.sessions): Claude Code's, Codex's, none,
    # OpenCode's (its headers; a sub-agent's also names its parent session)
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "sess-a"})
    records[0].request_received = {"model": "m", "metadata": {"user_id": user_id}}
    records[1].request_received = {"model": "m", "prompt_cache_key": "thread-1"}
    records[4].session_headers = {"x-parent-session-id": "ses_p", "x-session-id": "ses_e"}
    for r in records:
        await worker.put_call(r)
    calls, last = await worker.stored_since("r1", 0)
    assert calls is not None and last > 0
    stored = {r.call_id: r for r in await worker.get_rollout_calls("r1")}
    assert [c.call_id for c in calls] == ["a", "b", "c", "d", "e", "f"]  # in the order stored
    for call in calls:
        assert call == of_record(stored[call.call_id]), call.call_id
    assert [c.session for c in calls] == [
        ("claude_code", "sess-a"),
        ("codex", "thread-1"),
        None,
        None,
        ("opencode", "ses_e"),
        None,
    ]
    assert stored["e"].session_headers == records[4].session_headers
    # the prefilled call offers its merged turn, read from the row's metadata alone
    assert calls[-1].response == {
        "role": "assistant", "content": "Sure,answer of f", "tool_calls": []
    }  # fmt: skip
    assert (await worker.stored_since("r1", last)) == ([], last)
    assert await worker.last_rowid("r1") == last


async def test_a_rows_history_key_is_read_from_its_message_chain(writer_and_worker):
    """``of_row``'s history key (``capture.PreparedRequest.history_keys``' own key: the chain
    digest of the request's messages less a rewritten note or a prefill) is the row's
    ``messages_chain`` entry at that position; None where that position is the prompt
    parent's (its messages were not stored again); ``of_record`` tells none."""
    _, worker, _, _ = writer_and_worker
    system = {"role": "system", "content": "You are a coding agent."}
    task = {"role": "user", "content": "Task a."}
    turn = {"role": "assistant", "content": "answer of a"}
    note = {"role": "user", "content": "Step limit reached."}
    prefill = {"role": "assistant", "content": "Sure,"}
    root = _linked("a", [1, 2, 3], [4, 5], request_messages=[system, task])
    child = _linked("b", [1, 2, 3, 4, 5, 6], [7], request_messages=[system, task, turn, task])
    noted = _linked("c", [1, 2, 3, 4, 5, 6, 7, 8], [9],
                    request_messages=[system, task, turn, task, turn, note])  # fmt: skip
    noted.linking = {**noted.linking, "harness_note": "opencode.step_limit"}
    prefilled = _linked("d", [1, 2, 3, 4, 5, 6, 7, 20, 21], [11],  # prompt parent b
                        request_messages=[system, task, turn, task, turn, prefill])  # fmt: skip
    prefilled.linking = {**prefilled.linking, "prefill": True, "prefill_message": prefill}
    # the same messages as its prompt parent ``a``: its position is a's, not stored again
    again = _linked("e", [1, 2, 3, 4, 5, 9], [7], request_messages=[system, task])
    for r in (root, child, noted, prefilled, again):
        await worker.put_call(r)
    calls, _ = await worker.stored_since("r1", 0)
    assert calls is not None
    chain = RequestEncoding.of([system, task, turn, task, turn], None).message_digests.chain
    assert [c.history for c in calls] == [chain[2], chain[4], chain[5], chain[5], None]
    stored = {r.call_id: r for r in await worker.get_rollout_calls("r1")}
    for call in calls:
        assert dataclasses.replace(call, history=None) == of_record(stored[call.call_id])


async def test_a_row_whose_session_field_was_stored_apart_tells_no_session(writer_and_worker):
    """A request whose ``metadata`` is at least 512 bytes keeps it as a blob: the row tells
    every fact but the session (a tie-breaker only), rather than make the catch-up read the
    rollout whole."""
    _, worker, _, _ = writer_and_worker
    rec = _linked("a", [1, 2, 3], [4, 5])
    user_id = json.dumps({"session_id": "sess-a", "pad": "x" * 600})
    rec.request_received = {"model": "m", "metadata": {"user_id": user_id}}
    await worker.put_call(rec)
    calls, _ = await worker.stored_since("r1", 0)
    assert calls is not None
    (call,) = calls
    whole = of_record((await worker.get_rollout_calls("r1"))[0])
    assert (call.session, whole.session) == (None, ("claude_code", "sess-a"))
    assert call == dataclasses.replace(whole, session=None)


async def test_the_supervisor_counts_a_put_before_the_worker_hears_of_it(tmp_path):
    """Two workers' linkers on one store: B's cached index of the rollout holds A's call once
    A's put returned (the count moved), without a digest miss; A's own put needs no read."""
    writer = SQLiteStore(tmp_path / "store")
    await writer.open()
    stamps = RolloutStamps(tmp_path / "stamps", writable=True)
    server = await serve_writes(writer, tmp_path / "c.sock", lambda *a: None, stamps)
    links = [await WriterLink.connect(tmp_path / "c.sock") for _ in range(2)]
    stores = [
        WorkerStore(tmp_path / "store", (lambda lk=lk: lk),
                    stamps=RolloutStamps(tmp_path / "stamps", writable=False))
        for lk in links
    ]  # fmt: skip
    try:
        for s in stores:
            await s.open()
        a, b = (Linker(s, refresh_on_miss=True, feed=s) for s in stores)
        first = _linked("first", [1, 2], [3])
        await stores[0].put_call(first)
        await a.remember(first)
        assert stores[0].stamp("r1") == 1 and a._sync["r1"][0] == 1  # no read needed
        await b._current_index("r1")  # loads the rollout: "first"
        second = _linked("second", [1, 2, 3, 4], [5])
        reads = []
        original = stores[1].stored_since

        async def counted(*args: Any) -> Any:
            reads.append(args)
            return await original(*args)

        stores[1].stored_since = counted  # type: ignore[method-assign]
        await stores[0].put_call(second)
        await a.remember(second)
        index = await b._current_index("r1")
        assert index.entries["second"].status == "complete" and len(reads) == 1
        await b._current_index("r1")  # current now: no second read
        assert len(reads) == 1
    finally:
        for s in stores:
            await s.close()
        for lk in links:
            lk.close()
        server.close()
        await writer.close()
        stamps.close()


def test_a_workers_claim_is_seen_by_the_other_until_released(tmp_path):
    """``ChildClaimBoard``: one file, a column per worker; a claim counts per call in flight
    and is dropped by its release; a second claim by the same call moves it."""
    path = tmp_path / "claims"
    create_claim_board(path, 2)
    first, second = (ChildClaimBoard(path, index=i, workers=2) for i in (0, 1))
    try:
        assert not second.claimed("parent-a")
        first.claim("child-1", "parent-a")
        first.claim("child-2", "parent-a")
        assert second.claimed("parent-a") and first.claimed("parent-a")
        assert not second.claimed("parent-b")
        first.release("child-1")
        assert second.claimed("parent-a")  # child-2 still holds it
        first.claim("child-2", "parent-b")  # chosen again: the old claim is dropped
        assert not second.claimed("parent-a") and second.claimed("parent-b")
        first.release("child-2")
        first.release("child-2")  # once only
        first.release("never-claimed")
        assert not second.claimed("parent-b")
        assert os.path.getsize(path) == 2 * 4 * (1 << 16)
    finally:
        first.close()
        second.close()


def test_a_workers_own_claims_are_not_claims_elsewhere(tmp_path):
    """``claimed_elsewhere`` (the workers' attempts in flight, ``late_retry``): another
    worker's call in flight counts, this worker's own do not."""
    path = tmp_path / "attempts"
    create_claim_board(path, 2)
    first, second = (ChildClaimBoard(path, index=i, workers=2) for i in (0, 1))
    try:
        first.claim("call-1", "key")
        assert second.claimed_elsewhere("key") and not first.claimed_elsewhere("key")
        second.claim("call-2", "key")
        assert first.claimed_elsewhere("key")
        first.release("call-1")
        assert not second.claimed_elsewhere("key") and first.claimed_elsewhere("key")
    finally:
        first.close()
        second.close()


def test_a_replaced_worker_drops_its_dead_predecessors_claims_only(tmp_path):
    path = tmp_path / "claims"
    create_claim_board(path, 2)
    dead, other = (ChildClaimBoard(path, index=i, workers=2) for i in (0, 1))
    dead.claim("child-1", "parent-a")
    other.claim("child-2", "parent-b")
    dead.close()
    replacement = ChildClaimBoard(path, index=0, workers=2)
    try:
        assert not other.claimed("parent-a")
        assert replacement.claimed("parent-b")
    finally:
        replacement.close()
        other.close()


def test_a_workers_choice_and_claim_is_whole_against_the_others(tmp_path):
    """``locked`` holds an exclusive ``flock`` on the file: another worker's (another open
    file) cannot take it meanwhile."""
    path = tmp_path / "claims"
    create_claim_board(path, 2)
    board = ChildClaimBoard(path, index=0, workers=2)
    fd = os.open(path, os.O_RDWR)
    try:
        with board.locked(), pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
        board.close()


@pytest.mark.parametrize("dies", ["after_commit", "before_commit"])
async def test_a_put_whose_writer_dies_is_answered_by_what_the_store_holds(
    tmp_path, monkeypatch, dies
):
    """The supervisor dies with a put in flight, before its reply: committed, the put returns
    (the call is answered as stored, once); not, it fails saying so, and is not stored.
    Before the fix both failed ("the writer is gone"), and the committed one's retry was a
    second copy (TRIAL9 finding 1)."""
    writer = SQLiteStore(tmp_path / "store")
    await writer.open()

    async def perform(self: Any, name: str, args: tuple[Any, ...]) -> None:
        if dies == "after_commit":
            await writer._put_hop(*args)
        await writer.close()  # the process ends: its writer lock with it
        assert self.transport is not None
        self.transport.abort()  # no reply

    monkeypatch.setattr(_WriterServer, "_perform", perform)
    server = await serve_writes(writer, tmp_path / "control.sock", lambda *a: None)
    link = await WriterLink.connect(tmp_path / "control.sock")
    worker = WorkerStore(tmp_path / "store", lambda: link)
    await worker.open()
    try:
        put = worker.put_call(record("x", [1], [2]))
        if dies == "after_commit":
            assert await asyncio.wait_for(put, 30) is None
            assert [r.call_id for r in await worker.get_rollout_calls("r1")] == ["x"]
        else:
            with pytest.raises(StoreError, match=r"died before call x was committed: it is not"):
                await asyncio.wait_for(put, 30)
            assert await worker.get_rollout_calls("r1") == []
    finally:
        await worker.close()
        server.close()


async def test_a_commit_the_dead_writer_left_unseen_in_the_wal_stays_unstored(tmp_path):
    """A writer killed between writing a commit to the WAL and updating the wal-index: no
    reader sees the call, so its worker answers "not stored"; the WAL is settled first, so the
    next start's recovery does not bring the call back (it did before the fix: the refused
    call stored after all, and its retry a second copy)."""
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    await store.close()
    worker = WorkerStore(tmp_path / "store", lambda: None)  # the link is lost
    await worker.open()
    try:
        assert await worker.get_call("first") is None  # the wal-index is mapped here
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.store.dying_writer", str(tmp_path / "store"), cwd=ROOT
        )
        assert await asyncio.wait_for(proc.wait(), 60) == -signal.SIGKILL
        assert await worker.get_call("first") is not None
        with pytest.raises(StoreError, match="died before call orphan was committed"):
            await worker.put_call(record("orphan", [1, 2, 3, 4], [5]))
    finally:
        await worker.close()
    reopened = SQLiteStore(tmp_path / "store")  # the first connection: SQLite recovers the WAL
    await reopened.open()
    try:
        assert await reopened.get_call("first") is not None
        assert await reopened.get_call("orphan") is None
    finally:
        await reopened.close()
