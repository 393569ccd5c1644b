"""What the SQLite writer remembers between puts (``sqlite_puts.SQLitePuts``: a rollout's state
and its calls' statuses, the texts it stored, the prompt-parent index) spares statements and
changes nothing read: the same puts give the same rows as a writer that remembers nothing (but
the references to texts a call's prompt ancestors refer to, which every read of it reads
through them); every other write transaction forgets its rollout, and a failed transaction
forgets all."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.records import CallStatus, Diagnostic, DiagnosticKind
from capture_proxy.store.base import RolloutDeleted
from capture_proxy.store.prompt_parents import _LOAD
from capture_proxy.store.sql import ANCESTRY
from capture_proxy.store.sqlite import SQLiteStore
from tests.core.test_codec_v2 import chain
from tests.factories import record
from tests.store.conftest import rows
from tests.store.test_chain_counts import _session
from tests.store.test_group_commit import _hold_writer, _queued

# Every table a put writes, whole, in a fixed order (``call_json``: ``_texts_read``).
_TABLES = (
    "SELECT * FROM calls ORDER BY call_id",
    "SELECT * FROM rollouts ORDER BY rollout_id",
    "SELECT * FROM json_blobs ORDER BY sha256",
    "SELECT * FROM rollout_kinds ORDER BY rollout_id, kind",
    "SELECT * FROM counters ORDER BY name",
)
_TOOLS = [
    [{"type": "function", "function": {"name": name, "description": name * 300}}]
    for name in ("bash", "read")
]


def _texts_read(store: SQLiteStore) -> dict[str, list[tuple[Any, ...]]]:
    """Per call, the texts a read of it finds (``call_json`` of it and its prompt ancestors)."""
    return {
        cid: rows(
            store,
            ANCESTRY.replace("?", f"'{cid}'")
            + "SELECT DISTINCT sha256 FROM call_json WHERE call_id IN (SELECT id FROM anc) "
            "ORDER BY sha256",
        )
        for (cid,) in rows(store, "SELECT call_id FROM calls")
    }


def _read(c: Any) -> tuple[Any, ...]:
    """What a read of a call gives, comparable."""
    return (c.call_id, c.request_tools, c.request_messages, c.prompt_token_ids.tolist())


def _with_tools(calls: list[Any], rng: random.Random) -> list[Any]:
    """``calls`` offering a tools list, the same one mostly, another one now and then."""
    return [c.replace(request_tools=_TOOLS[int(rng.random() < 0.2)]) for c in calls]


async def _open(path: Any) -> SQLiteStore:
    store = SQLiteStore(path)
    await store.open()
    return store


def _forgetful(store: SQLiteStore) -> None:
    """Make the store's writer forget everything before each group (every statement runs)."""
    group = store._puts.group

    def forgetting(db: Any, items: list[tuple[Any, ...]]) -> Any:
        store._puts.forget(None)
        return group(db, items)

    store._puts.group = forgetting  # type: ignore[method-assign]


async def _statements(store: SQLiteStore) -> list[str]:
    """The statements the writer's connection runs from now on."""
    seen: list[str] = []
    await store._write_hop(lambda db: db.set_trace_callback(seen.append))
    return seen


async def test_a_remembering_writer_stores_what_a_forgetful_one_does(tmp_path):
    rng = random.Random(35)
    sessions = [_session(rng, f"v{i:02d}", rng.randint(1, 25)) for i in range(12)]
    sessions.append(chain(6))  # prompt parents and message prefixes
    sessions = [_with_tools(calls, rng) if i % 3 else calls for i, calls in enumerate(sessions)]
    got, texts, reads = [], [], []
    for name, forgetful in (("remembers", False), ("forgets", True)):
        store = await _open(tmp_path / name)
        try:
            if forgetful:
                _forgetful(store)
            for calls in sessions:
                for c in calls:
                    await store.put_call(c)
                await store.put_call(calls[0])  # a re-put: nothing changes
            # a deleted rollout's re-put is refused; a frozen one's is late
            await store.freeze_rollout(sessions[1][0].rollout_id)
            await store.put_call(sessions[1][-1].replace(call_id="late"))
            await store.delete_rollout(sessions[2][0].rollout_id)
            with pytest.raises(RolloutDeleted):
                await store.put_call(sessions[2][0])
            got.append([rows(store, sql) for sql in _TABLES])
            texts.append(_texts_read(store))
            reads.append(
                [_read(c) for s in sessions for c in await store.get_rollout_calls(s[0].rollout_id)]
            )
        finally:
            await store.close()
    # the freeze's random snapshot id and time differ; nothing else
    for table in (0, 2, 3, 4):
        assert got[0][table] == got[1][table]
    assert [r[:12] for r in got[0][1]] == [r[:12] for r in got[1][1]]
    assert texts[0] == texts[1] and len(got[0][2]) == len(_TOOLS)
    assert reads[0] == reads[1]


async def test_a_known_rollout_deleted_or_frozen_since_is_read_again(tmp_path):
    store = await _open(tmp_path / "s")
    try:
        await store.put_call(record("a", [1, 2], [3], rollout_id="gone"))
        await store.put_call(record("b", [1, 2], [3], rollout_id="sealed"))
        assert set(store._puts.rollouts) == {"gone", "sealed"}
        await store.delete_rollout("gone")
        await store.freeze_rollout("sealed")
        assert set(store._puts.rollouts) == set()  # each write forgot its rollout
        with pytest.raises(RolloutDeleted):
            await store.put_call(record("c", [1, 2, 3, 4], [5], rollout_id="gone"))
        await store.put_call(record("d", [1, 2, 3, 4], [5], rollout_id="sealed"))
        await store.put_call(record("e", [1, 2, 3, 4, 5], [6], rollout_id="sealed"))
        info = await store.get_rollout("sealed")
        assert info is not None
        assert info.late_call_ids == ("d", "e") and info.version == 1
        assert store._puts.rollouts["sealed"].frozen
        assert await store.get_call("c") is None
    finally:
        await store.close()


async def test_a_refused_put_alone_rolls_back_and_keeps_the_writers_memory(tmp_path):
    store = await _open(tmp_path / "s")
    try:
        first, second = chain(2)
        first = first.replace(linking={"verdict": "root", "child_digest": "d1"})
        second = second.replace(
            parent_call_id=first.call_id, linking={"verdict": "resolved", "child_digest": "d2"}
        )
        await store.put_call(first)
        await store.put_call(record("x", [1], [2], rollout_id="gone"))
        await store.delete_rollout("gone")
        with pytest.raises(RolloutDeleted):
            await store.put_call(record("y", [1], [2], rollout_id="gone"))
        assert list(store._puts.rollouts) == [first.rollout_id]  # kept
        assert rows(store, "SELECT value FROM counters WHERE name = 'calls'") == [(1,)]
        seen = await _statements(store)
        await store.put_call(second)
        # the rollout's state, its parent's status and messages, its prompt parents came
        # from memory
        assert [s for s in seen if s.startswith("SELECT")] == []
        assert "SAVEPOINT put" not in seen  # one put: no savepoint
        row = rows(
            store, f"SELECT prompt_parent_call_id FROM calls WHERE call_id = '{second.call_id}'"
        )
        assert row == [(first.call_id,)]
        info = await store.get_rollout(first.rollout_id)
        assert info is not None and info.num_chains == 1 and info.num_calls == 2
    finally:
        await store.close()


async def test_a_call_refers_to_no_text_its_prompt_ancestors_refer_to(tmp_path):
    # A session's calls offer the same tools list: its first call refers to the text, the
    # others read it through their prompt ancestors; a call that offers another list refers to
    # that one. Every read finds its call's texts; a delete keeps those another rollout uses.
    store = await _open(tmp_path / "s")
    try:
        calls = [
            c.replace(
                request_tools=_TOOLS[int(i == 3)],
                linking={"verdict": "root", "child_digest": f"d{i}"},
            )
            for i, c in enumerate(chain(6))
        ]
        other = record("o", [7], [8], rollout_id="r2").replace(request_tools=_TOOLS[0])
        seen = await _statements(store)
        for c in [*calls, other]:
            await store.put_call(c)
        tools, read = (rows(store, f"SELECT sha256 FROM json_blobs WHERE json LIKE '%{n}%'")
                       for n in ("bash", "read"))  # fmt: skip
        assert rows(store, "SELECT call_id, sha256 FROM call_json ORDER BY call_id") == [
            ("c000", tools[0][0]),
            ("c003", read[0][0]),
            ("o", tools[0][0]),
        ]
        assert len([q for q in seen if q.startswith("INSERT INTO call_json")]) == 3
        for c in calls:
            assert (await store.get_call(c.call_id)).request_tools == c.request_tools
            (child,) = await store.get_calls_by_child_digest("r1", c.linking["child_digest"])
            assert child.request_tools == c.request_tools
        assert [c.request_tools for c in await store.get_rollout_calls("r1")] == [
            c.request_tools for c in calls
        ]
        # forgotten (another write of the rollout): the next call refers to its texts again
        await store.set_metadata("r1", RolloutMetadata(task_id="x"))
        late = record("c006", calls[-1].full_token_ids().tolist() + [5], [6], created_at=6.0)
        await store.put_call(late.replace(request_tools=_TOOLS[0]))
        assert rows(store, "SELECT count(*) FROM call_json WHERE call_id = 'c006'") == [(1,)]
        assert await store.delete_rollout("r1") == 7
        assert rows(store, "SELECT sha256 FROM json_blobs") == tools
        assert (await store.get_call("o")).request_tools == _TOOLS[0]
    finally:
        await store.close()


async def test_a_group_counts_its_stored_calls_once(tmp_path):
    store = await _open(tmp_path / "s")
    try:
        await store.put_call(record("dup", [1, 2], [3], rollout_id="r0"))
        seen = await _statements(store)
        gate = _hold_writer(store)
        puts = [record(f"c{i}", [1, 2, i], [3], rollout_id=f"r{i}") for i in range(4)]
        puts.append(record("dup", [1, 2], [9], rollout_id="r0"))  # refused: other content
        tasks = [asyncio.ensure_future(store.put_call(r)) for r in puts]
        await _queued(store._writer, len(puts))
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert [s for s in seen if s.startswith("UPDATE counters")] == [
            "UPDATE counters SET value = value + 4 WHERE name = 'calls'"
        ]
        assert rows(store, "SELECT value FROM counters WHERE name = 'calls'") == [(5,)]
        assert (await store.health())["calls"] == 5
    finally:
        await store.close()


async def test_a_new_rollouts_put_reads_no_prompt_parents(tmp_path):
    store = await _open(tmp_path / "s")
    try:
        diagnostic = Diagnostic(DiagnosticKind.STORE_FAILED, {"call_ids": ["z"]})
        await store.mark_rollout_incomplete("marked", diagnostic)  # a row, no call
        seen = await _statements(store)
        await store.put_call(record("a", [1, 2], [3], rollout_id="new"))
        await store.put_call(record("b", [1, 2], [3], rollout_id="marked"))
        await store.put_call(record("c", [1, 2, 3, 4], [5], rollout_id="marked"))
        assert not [s for s in seen if s.startswith(_LOAD[:40])]
        assert rows(store, "SELECT prompt_parent_call_id FROM calls WHERE call_id = 'c'") == [
            ("b",)
        ]
    finally:
        await store.close()
    store = await _open(tmp_path / "s")  # a new process: the rollout's rows are read once
    try:
        seen = await _statements(store)
        await store.put_call(record("d", [1, 2, 3, 4, 5, 6], [7], rollout_id="marked"))
        assert len([s for s in seen if s.startswith(_LOAD[:40])]) == 1
        assert rows(store, "SELECT prompt_parent_call_id FROM calls WHERE call_id = 'd'") == [
            ("c",)
        ]
        assert (await store.get_call("d")).status is CallStatus.COMPLETE
    finally:
        await store.close()


def _prompt(session: int, step: int) -> list[int]:
    """Session ``session``'s prompt at ``step``: the one before, its answer [9, 9], then a new
    turn [step] (each session's calls extend its previous one's tokens)."""
    prompt = [session + 100]
    for k in range(1, step + 1):
        prompt += [9, 9, k]
    return prompt


async def test_sessions_put_at_once_keep_their_prompt_parents(tmp_path):
    # 300 agent sessions, each its rollout, put in turn (as 300 running at once): each
    # rollout's rows are read once at most, never again on its later puts; every prompt parent
    # is the session's previous call.
    store = await _open(tmp_path / "s")
    try:
        seen = await _statements(store)
        for step in range(3):
            for s in range(300):
                prompt = _prompt(s, step)
                await store.put_call(record(f"s{s}-{step}", prompt, [9, 9], rollout_id=f"r{s}"))
        assert not [q for q in seen if q.startswith(_LOAD[:40])]  # new rollouts: nothing read
        assert len(store._puts.prompt_parents) == 300
        assert store._puts.prompt_parents.filed == 900
        parents = dict(rows(store, "SELECT call_id, prompt_parent_call_id FROM calls"))
        assert parents == {
            f"s{s}-{step}": (f"s{s}-{step - 1}" if step else None)
            for s in range(300)
            for step in range(3)
        }
    finally:
        await store.close()


async def test_the_prompt_parent_index_is_bounded_by_its_calls(tmp_path):
    # Past ``max_calls`` filed calls the least recently put rollouts go (read again on their
    # next put, with the same parents).
    store = await _open(tmp_path / "s")
    try:
        kept = store._puts.prompt_parents
        kept.max_calls = 5
        for s in range(4):
            for step in range(2):
                prompt = _prompt(s, step)
                await store.put_call(record(f"s{s}-{step}", prompt, [9, 9], rollout_id=f"r{s}"))
        assert (len(kept), kept.filed) == (2, 4)  # r2 and r3, two calls each
        seen = await _statements(store)
        await store.put_call(record("s0-2", _prompt(0, 2), [9], rollout_id="r0"))
        assert len([q for q in seen if q.startswith(_LOAD[:40])]) == 1  # r0 read again
        assert rows(store, "SELECT prompt_parent_call_id FROM calls WHERE call_id = 's0-2'") == [
            ("s0-1",)
        ]
        assert kept.filed <= 5 and list(kept._rollouts)[-1] == "r0"
    finally:
        await store.close()
