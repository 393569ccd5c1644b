"""End to end, a trainer's hand-off: rollouts captured through the proxy in front of the
scripted engine, rewards attached, frozen, exported in bulk with a crash in the middle and a
proxy restart, resumed from the last committed cursor, retired. No rollout lost or duplicated,
no late call trained on."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from capture_proxy import readers
from tests.proxy.conftest import ON_BOTH_STORES, MakeStack
from tests.proxy.test_capture import USER, _body
from tests.proxy.test_npz_and_retention import _session

ROLLOUTS = ["task0", "task1", "task2", "task3", "task4", "task4-a1"]  # task4 was retried
TOKEN = "trainer-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _retire(base: str, rollout: readers.ExportedRollout) -> dict:
    body = json.dumps({"snapshot_id": rollout.snapshot_id, "version": rollout.version}).encode()
    request = urllib.request.Request(
        f"{base}/captures/rollouts/{rollout.rollout_id}/retire",
        data=body,
        method="POST",
        headers={**AUTH, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:  # noqa: S310
        out: dict = json.loads(resp.read())
        return out


@ON_BOTH_STORES
async def test_a_trainer_takes_every_rollout_exactly_once(make_stack: MakeStack):
    stack = await make_stack(captures_token=TOKEN)
    calls: dict[str, list[str]] = {}
    for i, rid in enumerate(ROLLOUTS):
        agent = await _session(stack, rid, steps=1 + i % 3)
        calls[rid] = agent
        resp = await stack.client.put(
            f"/captures/rollouts/{rid}/metadata",
            json={"reward": i / 4, "task_id": rid.split("-")[0]},
            headers=AUTH,
        )
        assert resp.status == 200
    for rid in reversed(ROLLOUTS):  # frozen in another order than captured
        resp = await stack.client.post(f"/captures/rollouts/{rid}/freeze", headers=AUTH)
        assert resp.status == 200
    late = await stack.chat("task2", _body(list(USER)))  # after the freeze: answered, late
    assert late.status == 200
    late_id = late.headers["X-Capture-Call-Id"]

    base = str(stack.client.make_url("/")).rstrip("/")
    committed: list[readers.ExportedRollout] = []

    def first_run() -> list[str]:
        seen = []
        for rollout in readers.iter_rollouts(base, token=TOKEN, limit=2):
            seen.append(rollout.rollout_id)
            if len(seen) == 3:
                break  # the trainer crashes before committing its third rollout
            committed.append(rollout)
        return seen

    seen = await asyncio.to_thread(first_run)
    assert seen == ["task4-a1", "task4", "task3"]
    cursor = committed[-1].cursor

    # The proxy restarts too; the trainer resumes after its last committed cursor.
    await stack.client.close()
    stack = await make_stack(captures_token=TOKEN)
    base = str(stack.client.make_url("/")).rstrip("/")

    def resume_and_retire() -> list[dict]:
        committed.extend(readers.iter_rollouts(base, token=TOKEN, after=cursor, limit=2))
        done = [_retire(base, r) for r in committed]
        assert [_retire(base, r) for r in committed] == done  # a retried retire: the same
        return done

    retired = await asyncio.to_thread(resume_and_retire)
    taken = [r.rollout_id for r in committed]
    assert taken == list(reversed(ROLLOUTS))  # each exactly once, in freeze order
    assert [r.cursor for r in committed] == [1, 2, 3, 4, 5, 6]
    by_id = {r.rollout_id: r for r in committed}
    assert by_id["task4"].superseded_by == "task4-a1" and by_id["task4"].batch.num_rows == 0
    for i, rid in enumerate(ROLLOUTS):
        rollout = by_id[rid]
        rows = rollout.samples()
        if rid == "task4":
            assert rows == []
            continue
        assert len(rows) == 2  # the title call and the agent chain
        assert [r["reward"] for r in rows] == [i / 4, i / 4]
        assert rows[1]["call_ids"] == calls[rid] and rows[1]["main_chain"] is True
        assert all(late_id not in r["call_ids"] for r in rows)
    assert by_id["task2"].manifest["late_call_ids"] == [late_id]
    assert [d["rollout_id"] for d in retired] == taken
    assert sum(d["deleted_calls"] for d in retired) == sum(len(c) + 1 for c in calls.values()) + 1
    listing = await stack.client.get("/captures/rollouts", headers=AUTH)
    assert (await listing.json())["rollouts"] == []
    again = await stack.chat("task0", _body(list(USER)))  # retired: answered, not stored
    assert again.status == 200
    assert (await (await stack.client.get("/captures/rollouts", headers=AUTH)).json())[
        "rollouts"
    ] == []
