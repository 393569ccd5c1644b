"""The number of chains a listing reads is kept by every put (``core.chain_counts``, issue 22):
on both stores it is exactly ``len(build_chains(...).chains)`` over the calls a training read
holds, or None where it cannot be kept; and the count of incomplete calls, recounted from the
call's retry family alone, is what a recount of the whole rollout gives."""

from __future__ import annotations

import random
from typing import Any

import pytest

from capture_proxy.core.chain_counts import kept_chains
from capture_proxy.core.chains import build_chains
from capture_proxy.core.completeness import RetryLink, unsuperseded_incomplete
from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic
from capture_proxy.rest.reads import snapshot_records
from tests.factories import record
from tests.store.conftest import rows

COMPLETE, INCOMPLETE, FAILED = CallStatus.COMPLETE, CallStatus.INCOMPLETE, CallStatus.FAILED


def call(
    call_id: str,
    n: int,
    *,
    parent: str | None = None,
    retry_of: str | None = None,
    status: CallStatus = COMPLETE,
    linking: bool = True,
    rollout_id: str = "r1",
) -> CallRecord:
    """A call at time ``n`` with a verdict (as the proxy stores it) unless not ``linking``."""
    rec = record(call_id, [1, 2, n], [3] if status is COMPLETE else [], rollout_id=rollout_id)
    verdict = {"verdict": "resolved" if parent else "root", "child_digest": f"d-{call_id}"}
    return rec.replace(
        created_at=float(n),
        status=status,
        parent_call_id=parent,
        retry_of=retry_of,
        linking=verdict if linking else None,
    )


# name -> (calls in put order, the number of chains build_chains gives, kept?)
ROLLOUTS: dict[str, tuple[list[CallRecord], int, bool]] = {
    "chain": ([call("a", 0), call("b", 1, parent="a"), call("c", 2, parent="b")], 1, True),
    "branches": ([call("a", 0), call("b", 1, parent="a"), call("c", 2, parent="a")], 1, True),
    "two roots": ([call("a", 0), call("b", 1), call("c", 2, parent="b")], 2, True),
    "failed and incomplete": (
        [call("a", 0), call("b", 1, status=INCOMPLETE), call("c", 2, status=FAILED)],
        1,
        True,
    ),
    "child of a cut-off call": (
        [call("a", 0, status=INCOMPLETE), call("b", 1, parent="a")],
        1,
        True,
    ),
    "retry of a cut-off root": (
        [call("a", 0, status=INCOMPLETE), call("b", 1, retry_of="a"), call("c", 2, parent="b")],
        1,
        True,
    ),
    "retries of retries": (
        [
            call("a", 0, status=INCOMPLETE),
            call("b", 1, retry_of="a", status=FAILED),
            call("c", 2, retry_of="b"),
            call("d", 3, parent="c"),
        ],
        1,
        True,
    ),
    "retried child": (
        [
            call("a", 0),
            call("b", 1, parent="a", status=INCOMPLETE),
            call("c", 2, parent="a", retry_of="b"),
        ],
        1,
        True,
    ),
    "retry of a complete root": ([call("a", 0), call("b", 1, retry_of="a")], 1, False),
    "retry stored first": ([call("b", 1, retry_of="a"), call("a", 0, status=INCOMPLETE)], 1, False),
    "child stored first": ([call("b", 1, parent="a"), call("a", 0)], 1, False),
    "no verdict": ([call("a", 0, linking=False), call("b", 1)], 2, False),
    "failed without verdict": ([call("a", 0), call("b", 1, status=FAILED, linking=False)], 1, True),
}


def moved(rec: CallRecord, rid: str) -> CallRecord:
    """``rec`` in rollout ``rid``, its ids (and those it names) prefixed with ``rid``."""

    def named(call_id: str | None) -> str | None:
        return None if call_id is None else f"{rid}.{call_id}"

    return rec.replace(
        call_id=named(rec.call_id),
        rollout_id=rid,
        parent_call_id=named(rec.parent_call_id),
        retry_of=named(rec.retry_of),
    )


async def _info(store: Any, rollout_id: str) -> Any:
    info = await store.get_rollout(rollout_id)
    assert info is not None
    return info


async def _built(store: Any, rollout_id: str) -> int:
    info = await _info(store, rollout_id)
    records = snapshot_records(info, await store.get_rollout_calls(rollout_id))
    return len(build_chains(rollout_id, records).chains)


@pytest.mark.parametrize("name", list(ROLLOUTS))
async def test_the_kept_number_of_chains_is_build_chains_or_none(store, name):
    calls, chains, kept = ROLLOUTS[name]
    for c in calls:
        await store.put_call(c)
        await store.put_call(c)  # a re-put changes nothing
    assert await _built(store, "r1") == chains
    info = await _info(store, "r1")
    assert info.num_chains == (chains if kept else None)
    if kept:  # what a store that recounts the rollout (a migration) keeps too
        assert kept_chains("r1", await store.get_rollout_calls("r1")) == chains
    assert [i.num_chains for i in await store.list_rollouts()] == [info.num_chains]


async def test_late_calls_and_deletes_leave_the_kept_number_as_a_training_read_counts(store):
    await store.put_call(call("a", 0))
    await store.put_call(call("b", 1, parent="a"))
    snap = await store.freeze_rollout("r1")
    await store.put_call(call("late", 2))  # a late root: not in what a training read holds
    info = await _info(store, "r1")
    assert (info.num_calls, info.late_call_ids, info.num_chains) == (3, ("late",), 1)
    assert await _built(store, "r1") == 1
    await store.put_call(call("x", 0, rollout_id="r2"))
    await store.put_call(call("y", 1, rollout_id="r2"))
    await store.retire_rollout("r1", snap.snapshot_id, snap.version)
    assert await store.delete_rollout("r2") == 2
    await store.put_call(call("z", 0, rollout_id="r3"))
    assert [(i.rollout_id, i.num_chains) for i in await store.list_rollouts()] == [("r3", 1)]
    await store.freeze_rollout("r4", known_elsewhere=True)  # frozen before its first call
    assert (await _info(store, "r4")).num_chains == 0


def _session(rng: random.Random, rollout_id: str, size: int) -> list[CallRecord]:
    """A rollout as the proxy stores it: chains, branches, side roots, cut-off calls and their
    retries, failed calls, retries of complete calls now and then; in arrival order."""
    calls: list[CallRecord] = []
    linkable: list[str] = []
    for n in range(size):
        cid = f"{rollout_id}-{n:03d}"
        roll = rng.random()
        parent = rng.choice(linkable) if linkable and rng.random() < 0.7 else None
        retry_of = None
        status = COMPLETE
        if roll < 0.15:
            status = INCOMPLETE
        elif roll < 0.2:
            status = FAILED
        elif roll < 0.35 and calls:
            target = rng.choice(calls)
            # a retry repeats its target's request: the same parent
            if target.status is not COMPLETE or rng.random() < 0.1:
                retry_of, parent = target.call_id, target.parent_call_id
                status = rng.choice([COMPLETE, COMPLETE, INCOMPLETE])
        c = call(cid, n, parent=parent, retry_of=retry_of, status=status, rollout_id=rollout_id)
        calls.append(c)
        if status is COMPLETE:
            linkable.append(cid)
    return calls


async def test_varied_rollouts_in_any_order_keep_exact_counts(store):
    rng = random.Random(22)
    expected: dict[str, tuple[int, int, bool]] = {}
    for i in range(24):
        rid = f"v{i:02d}"
        calls = _session(rng, rid, rng.randint(1, 30))
        # in arrival order, and no retry of a complete call: the figure is kept
        simple = kept_chains(rid, calls) is not None
        if i % 3 == 2:
            rng.shuffle(calls)  # stored out of order (replicas, slow streams)
            simple = False
        for c in calls:
            await store.put_call(c)
        links = [RetryLink(c.call_id, c.status.value, c.retry_of) for c in calls]
        chains = len(build_chains(rid, calls).chains)
        expected[rid] = (chains, len(unsuperseded_incomplete(links)), simple)
    kept = []
    for info in await store.list_rollouts():
        chains, incomplete, simple = expected[info.rollout_id]
        assert info.incomplete is (incomplete > 0), info.rollout_id
        assert info.num_chains == chains if simple else info.num_chains in (chains, None)
        kept.append((simple, info.num_chains is not None))
    # the incomplete calls counted from each call's retry family are the whole rollout's count
    counted = dict(rows(store, "SELECT rollout_id, incomplete_calls FROM rollouts"))
    assert counted == {rid: e[1] for rid, e in expected.items()}
    # 14 kept as they came; 1 kept though out of order; 9 built on read
    assert (kept.count((True, True)), kept.count((False, True)), kept.count((False, False))) == (
        14,
        1,
        9,
    )


KINDS = ["parent_digest_mismatch", "retry", "harness_note_rewritten"]


def _diagnosed(rng: random.Random, calls: list[CallRecord]) -> list[CallRecord]:
    """``calls`` with 0 to 2 diagnostics each (a kind may repeat: each refusal counts)."""
    return [
        c.replace(diagnostics=[Diagnostic(k) for k in rng.choices(KINDS, k=rng.randint(0, 2))])
        for c in calls
    ]


async def test_the_viewer_counts_are_those_of_the_calls_late_ones_included(store):
    rng = random.Random(7)
    for i in range(8):
        rid = f"w{i}"
        calls = _diagnosed(rng, _session(rng, rid, rng.randint(1, 20)))
        half = len(calls) // 2
        for c in calls[:half]:
            await store.put_call(c)
        if i % 2:
            await store.freeze_rollout(rid, known_elsewhere=True)
        for c in calls[half:]:  # late, after a freeze
            await store.put_call(c)
            await store.put_call(c)  # a re-put counts once
    assert await store.delete_rollout("w0") is not None
    infos = await store.list_rollouts()
    assert [i.rollout_id for i in infos] == [f"w{i}" for i in range(1, 8)]
    late = 0
    for info in infos:
        records = await store.get_rollout_calls(info.rollout_id)
        late += len(info.late_call_ids)
        want = (
            sum(1 for r in records if r.status is FAILED),
            sum(1 for r in records if r.status is INCOMPLETE),
            sum(1 for r in records for d in r.diagnostics if d.kind == "parent_digest_mismatch"),
            tuple(sorted({d.kind for r in records for d in r.diagnostics})),
        )
        got = (info.num_failed, info.num_incomplete, info.num_refused, info.call_diagnostic_kinds)
        assert got == want, info.rollout_id
    assert late > 0
    assert rows(store, "SELECT count(*) FROM rollout_kinds WHERE rollout_id = 'w0'") == [(0,)]


_LAYOUT_7 = (
    "DROP INDEX calls_by_retry_of; DROP INDEX calls_by_child_digest; DROP TABLE rollout_kinds; "
    "ALTER TABLE calls DROP COLUMN child_digest; ALTER TABLE rollouts DROP COLUMN num_chains; "
    "ALTER TABLE rollouts DROP COLUMN num_failed; ALTER TABLE rollouts DROP COLUMN num_incomplete; "
    "ALTER TABLE rollouts DROP COLUMN num_refused; PRAGMA user_version=7;"
)
_PG_LAYOUT_5 = (
    "DROP INDEX calls_by_retry_of, calls_by_child_digest; DROP TABLE rollout_kinds; "
    "ALTER TABLE calls DROP COLUMN child_digest; ALTER TABLE rollouts DROP COLUMN num_chains, "
    "DROP COLUMN num_failed, DROP COLUMN num_incomplete, DROP COLUMN num_refused; "
    "DELETE FROM schema_migrations WHERE version > 5"
)


async def test_an_older_store_is_counted_once_when_it_opens(make_store):
    from capture_proxy.store.postgres import PostgresStore

    store = await make_store()
    for name in ("chain", "retry of a complete root", "child stored first"):
        calls, _, _ = ROLLOUTS[name]
        for c in calls:
            await store.put_call(moved(c, name))
    await store.put_call(
        call("x", 0, rollout_id="frozen").replace(diagnostics=[Diagnostic("retry")])
    )
    await store.freeze_rollout("frozen")
    await store.put_call(call("y", 1, rollout_id="frozen", status=FAILED))  # late
    before = {i.rollout_id: i for i in await store.list_rollouts()}
    assert len(before) == 4
    await store.close()
    if isinstance(store, PostgresStore):
        import psycopg

        with psycopg.connect(store.url, autocommit=True) as conn:
            conn.execute(_PG_LAYOUT_5)
        again: Any = PostgresStore(store.url, pool_size=2)
    else:
        import sqlite3

        with sqlite3.connect(store.db_path) as db:
            db.executescript(_LAYOUT_7)
        again = type(store)(store.path)
    await again.open()
    try:
        after = {i.rollout_id: i for i in await again.list_rollouts()}
        # the same figures, but where the put could not keep one that all the calls settle
        assert before["child stored first"].num_chains is None
        assert after["child stored first"].num_chains == 1
        after["child stored first"] = before["child stored first"]
        assert after == before
        assert [after[r].num_chains for r in sorted(after)] == [1, None, 1, None]
        assert after["frozen"].call_diagnostic_kinds == ("retry",)
        assert (after["frozen"].num_failed, after["frozen"].late_call_ids) == (1, ("y",))
    finally:
        await again.close()
