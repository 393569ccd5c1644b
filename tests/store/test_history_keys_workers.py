"""Two workers' linkers on one store (``serve --workers``): twin sessions (one task,
token-identical calls, each naming its harness session). A process that loads a rollout's
index after calls of it were stored (a worker's first call of the rollout, an eviction, a
restart) reads their history keys from the rows' message chains (``Linker._load_index``);
an index read from records whole (a row that cannot tell its facts) files them without one,
and the twin's call that has a key must not then be put before the session's own childless
call: a branch under it, the session's own call left without a child."""

from __future__ import annotations

import sqlite3
from typing import Any

import numpy as np

from capture_proxy.core.capture import prepare_request
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.linking.commands import FindPrefixAncestor, ReadParent
from capture_proxy.core.linking.index import LinkIndex, add_record
from capture_proxy.core.linking.parent_lookup import resolve_step
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.verification import verify_step
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
from tests.core.linking.steps import play

TASK = [{"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Count the files."}]  # fmt: skip
ANSWER = {"role": "assistant", "content": "There are 2 files."}
NEXT = [*TASK, ANSWER, {"role": "user", "content": "Continue."}]
KNOWN = KnownMessages()


def _record(call_id: str, at: float, messages: list[dict[str, Any]], session: str) -> CallRecord:
    first = messages is TASK
    prompt, gen = ([1, 2], [3, 4]) if first else ([1, 2, 3, 4, 5], [6])
    return CallRecord(
        call_id=call_id,
        rollout_id="r1",
        created_at=at,
        model="m",
        request_messages=messages,
        request_received={"model": "m", "prompt_cache_key": session},
        response_message={"role": "assistant", "content": ANSWER["content"] if first else "ok"},
        prompt_token_ids=np.asarray(prompt, np.uint32),
        generation_token_ids=np.asarray(gen, np.uint32),
        generation_log_probs=np.full(len(gen), -0.5, np.float32),
    )


async def _call(linker: Linker, store: WorkerStore, call_id: str, at: float, messages, session):
    """One call through the linker as the flow drives it: resolve, verify, put, remember,
    release. Returns (candidates, parent)."""
    body = {"model": "m", "messages": messages}
    prepared = prepare_request(body, None, KNOWN.facts(messages))
    key = ("codex", session)
    resolution = await linker.resolve(
        "r1",
        prepared.linking_messages,
        prepared.body,
        call_id=call_id,
        created_at=at,
        linking_facts=prepared.linking_facts,
        session=key,
        history_keys=prepared.history_keys,
    )
    record = await linker.verify(
        _record(call_id, at, messages, session),
        resolution,
        prepared.linking_messages,
        harness_note=None,
        retry_count=None,
        decode=None,
    )
    await store.put_call(record)
    await linker.remember(record, session=key)
    linker.release("r1", call_id)
    return [c.call_id for c in resolution.candidates or ()], record.parent_call_id


async def test_twins_keep_their_chains_when_a_worker_loads_the_rollout_late(tmp_path):
    writer = SQLiteStore(tmp_path / "store")
    await writer.open()
    stamps = RolloutStamps(tmp_path / "stamps", writable=True)
    server = await serve_writes(writer, tmp_path / "c.sock", lambda *a: None, stamps)
    links = [await WriterLink.connect(tmp_path / "c.sock") for _ in range(2)]
    create_claim_board(tmp_path / "claims", 2)
    stores = [
        WorkerStore(tmp_path / "store", (lambda lk=lk: lk),
                    stamps=RolloutStamps(tmp_path / "stamps", writable=False))
        for lk in links
    ]  # fmt: skip
    boards = [ChildClaimBoard(tmp_path / "claims", index=i, workers=2) for i in range(2)]
    try:
        for s in stores:
            await s.open()
        one, two = (
            Linker(s, refresh_on_miss=True, feed=s, claims=b)
            for s, b in zip(stores, boards, strict=True)
        )
        # session A's first call on worker 1; worker 2's first call of the rollout is B's
        await _call(one, stores[0], "a1", 1.0, TASK, "A")
        await _call(two, stores[1], "b1", 2.0, TASK, "B")
        index = two.indexes.peek("r1")
        loaded, filed = index.entries["a1"].history, index.entries["b1"].history
        assert filed is not None
        # loaded with the rollout from its rows' index facts: a1's key read from its message
        # chain (the twins sent the same task: the same key)
        assert loaded == filed
        assert index.entries["a1"].session == ("codex", "A")
        # both sessions continue on worker 2, B first
        got_b = await _call(two, stores[1], "b2", 3.0, NEXT, "B")
        got_a = await _call(two, stores[1], "a2", 4.0, NEXT, "A")
        assert got_b[1] == "b1"
        assert got_a[1] == "a1", "a2 branched under b1; a1 has no child"
    finally:
        for b in boards:
            b.close()
        for s in stores:
            await s.close()
        for lk in links:
            lk.close()
        server.close()
        await writer.close()
        stamps.close()


def _drive(step: Any, index: LinkIndex, records: dict[str, CallRecord]) -> Any:
    """Run a verification step, answering its reads from ``records`` and ``index``."""
    try:
        command = next(step)
        while True:
            if isinstance(command, ReadParent):
                reply: Any = records.get(command.call_id)
            else:
                assert isinstance(command, FindPrefixAncestor)
                reply = index.prefix_ancestor(
                    command.prompt_token_ids, model=command.model, exclude=command.exclude
                )
            command = step.send(reply)
    except StopIteration as done:
        return done.value


def _ids(messages: list[dict[str, Any]], *, open_last: bool = False) -> list[int]:
    """A toy template over a worker's rows (a token per character): a call's prompt +
    generation begins its continuation's prompt, so the store finds prompt parents."""
    roles = {"system": 1, "user": 2, "assistant": 3}
    ids: list[int] = []
    for i, m in enumerate(messages):
        ids += [roles[m["role"]], *(ord(c) for c in m["content"])]
        if not (open_last and i == len(messages) - 1):
            ids.append(4)
    return ids if open_last else [*ids, 3]


async def test_a_rows_history_key_is_the_key_its_call_was_filed_with_in_flight(tmp_path):
    """``of_row``'s history key of real calls (a plain continuation, one whose trailing
    OpenCode step-limit note was rewritten, a prefill, one after them), each stored after its
    prompt parent (its row keeps the messages past the parent's): the own key its request
    was filed with in flight (``PreparedRequest.history_keys``)."""
    from harness_notes import default_registry
    from harness_notes.opencode import STEP_LIMIT_NOTE_TEXT

    writer = SQLiteStore(tmp_path / "store")
    await writer.open()
    server = await serve_writes(writer, tmp_path / "c.sock", lambda *a: None)
    link = await WriterLink.connect(tmp_path / "c.sock")
    worker = WorkerStore(tmp_path / "store", lambda: link)
    await worker.open()
    notes, index = default_registry(), LinkIndex()
    system = {"role": "system", "content": "You are a coding agent."}
    task = {"role": "user", "content": "Count the files."}

    def turn(text: str) -> dict[str, Any]:
        return {"role": "assistant", "content": text}

    def user(text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}

    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    calls = [
        ("plain-0", [system, task], "a0", {}),
        ("plain-1", [system, task, turn("a0"), user("go on")], "a1", {}),
        (
            "noted",
            [
                system,
                task,
                turn("a0"),
                user("go on"),
                turn("a1"),
                user("r"),
                turn(STEP_LIMIT_NOTE_TEXT),
            ],
            "a2",
            {},
        ),  # fmt: skip
        (
            "prefilled",
            [
                system,
                task,
                turn("a0"),
                user("go on"),
                turn("a1"),
                user("r"),
                turn("a2"),
                user("more"),
                turn("Su"),
            ],
            "re",
            prefill,
        ),  # fmt: skip
        (
            "after",
            [
                system,
                task,
                turn("a0"),
                user("go on"),
                turn("a1"),
                user("r"),
                turn("a2"),
                user("more"),
                turn("Sure"),
                user("end"),
            ],
            "a4",
            {},
        ),  # fmt: skip
    ]
    filed: dict[str, bytes | None] = {}
    records: dict[str, CallRecord] = {}
    try:
        for at, (call_id, messages, answer, extra) in enumerate(calls):
            body = {"model": "m", "messages": messages, **extra}
            prepared = prepare_request(body, notes, KNOWN.facts(messages))
            sent = prepared.body["messages"]
            resolution = play(
                resolve_step(
                    index, "r1", prepared.linking_messages, prepared.body, call_id=call_id,
                    created_at=float(at), linking_facts=prepared.linking_facts,
                    history_keys=prepared.history_keys,
                ),
                [],
            )  # fmt: skip
            gen = [*(ord(c) for c in answer), 4]
            record = CallRecord(
                call_id=call_id,
                rollout_id="r1",
                created_at=float(at),
                model="m",
                request_messages=sent,
                request_received=body,
                response_message=turn(answer),
                prompt_token_ids=np.asarray(_ids(sent, open_last=bool(extra)), np.uint32),
                generation_token_ids=np.asarray(gen, np.uint32),
                generation_log_probs=np.full(len(gen), -0.5, np.float32),
            )
            step = verify_step(
                record, resolution, prepared.linking_messages,
                harness_note=prepared.harness_note, retry_count=None, can_decode=False,
                prefill=prepared.prefill, digests=RecordDigests(record, prepared.prefill),
            )  # fmt: skip
            record = _drive(step, index, records)
            await worker.put_call(record)
            records[call_id] = record
            add_record(index, record)
            filed[call_id] = prepared.history_keys[0]
        assert filed["noted"] is not None and calls[2][1][-1] != calls[2][1][-2]
        rows, _ = await worker.stored_since("r1", 0)
        assert rows is not None
        with sqlite3.connect(writer.db_path) as db:
            prefixes = dict(db.execute("SELECT call_id, messages_prefix_len FROM calls"))
        # each past the first stored after a prompt parent: its chain begins past it
        assert prefixes == {"plain-0": 0, "plain-1": 2, "noted": 4, "prefilled": 4, "after": 8}
        assert {r.call_id: r.history for r in rows} == filed
    finally:
        link.close()
        await worker.close()
        server.close()
        await writer.close()


async def test_a_restarted_process_reads_the_history_keys_from_the_rows(tmp_path):
    """One process (no feed): a rollout's index made after a restart has the history keys its
    calls were filed with in flight, read from their rows."""
    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        first = Linker(store)
        await _call(first, store, "a1", 1.0, TASK, "A")
        await _call(first, store, "a2", 2.0, NEXT, "A")
        filed = {c: e.history for c, e in first.indexes.peek("r1").entries.items()}
        assert None not in filed.values()
        again = Linker(store)  # the next process on the store
        index = await again._index("r1")
        assert {c: e.history for c, e in index.entries.items()} == filed
    finally:
        await store.close()
