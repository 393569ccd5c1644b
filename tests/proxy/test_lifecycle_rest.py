"""Tier 2: the hand-off over REST (freeze, late calls, metadata, retire): the normal path,
retries, a restart of the proxy on the same store, and bad input (4xx naming the field)."""

from __future__ import annotations

import pytest

from tests.proxy.conftest import ON_BOTH_STORES, MakeStack, Stack
from tests.proxy.test_capture import USER, _body
from tests.proxy.test_npz_and_retention import _session


async def _post(stack: Stack, path: str, status: int, json=None) -> dict:
    resp = await stack.client.post(path, json=json)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def _put_meta(stack: Stack, rollout: str, body, status: int = 200) -> dict:
    resp = await stack.client.put(f"/captures/rollouts/{rollout}/metadata", json=body)
    assert resp.status == status, await resp.text()
    return await resp.json()


def _ids(chains: dict) -> list[list[str]]:
    return [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]]


@ON_BOTH_STORES
async def test_freeze_then_a_late_call_answers_and_is_left_out(stack: Stack):
    await _session(stack, "r1", steps=2)
    before = await stack.get_json("/captures/rollouts/r1/chains")
    snap = await _post(stack, "/captures/rollouts/r1/freeze", 200)
    assert snap == {
        "rollout_id": "r1",
        "snapshot_id": snap["snapshot_id"],
        "version": 3,
        "num_calls": 3,
        "frozen_at": snap["frozen_at"],
        "cursor": 1,
    }
    assert await _post(stack, "/captures/rollouts/r1/freeze", 200) == snap  # a retry
    late = await stack.chat("r1", _body(list(USER)))
    assert late.status == 200 and (await late.json())["choices"][0]["message"]
    late_id = late.headers["X-Capture-Call-Id"]
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert _ids(chains) == _ids(before) and chains["late_call_ids"] == [late_id]
    summary = await stack.get_json("/captures/rollouts/r1")
    assert (summary["status"], summary["version"], summary["num_calls"]) == ("frozen", 3, 3)
    assert summary["snapshot"] == {k: snap[k] for k in snap if k != "rollout_id"}
    listing = (await stack.get_json("/captures/rollouts"))["rollouts"]
    assert [(r["status"], r["late_call_ids"], r["num_calls"]) for r in listing] == [
        ("frozen", [late_id], 4)
    ]


@ON_BOTH_STORES
async def test_late_calls_refused_get_a_409_and_never_reach_the_engine(make_stack: MakeStack):
    stack = await make_stack(late_calls="refuse")
    await _session(stack, "r1", steps=1)
    await _post(stack, "/captures/rollouts/r1/freeze", 200)
    sent = len(stack.sent)
    resp = await stack.chat("r1", _body(list(USER)))
    assert resp.status == 409
    error = (await resp.json())["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "rollout_frozen",
        "rollout_id",
        "conflict_error",
    )
    assert len(stack.sent) == sent
    other = await stack.chat("r2", _body(list(USER)))  # an open rollout is not affected
    assert other.status == 200


@ON_BOTH_STORES
async def test_metadata_is_shown_everywhere_and_bumps_the_version_once(stack: Stack):
    await _session(stack, "task7-a1", steps=1)
    body = {"reward": {"pass": 1, "style": 0.25}, "task_id": "task7", "tags": {"split": "train"}}
    got = await _put_meta(stack, "task7-a1", body)
    assert got == {
        "rollout_id": "task7-a1",
        "version": 3,
        "metadata": {
            "reward": {"pass": 1.0, "style": 0.25},
            "task_id": "task7",
            "tags": {"split": "train"},
        },
    }
    assert await _put_meta(stack, "task7-a1", body) == got  # a retry: the same version
    summary = await stack.get_json("/captures/rollouts/task7-a1")
    want = {"reward": {"pass": 1.0, "style": 0.25}, "task_id": "task7", "tags": {"split": "train"}}
    assert {k: summary[k] for k in want} == want
    assert (summary["episode_of"], summary["attempt"]) == ("task7", 1)
    assert summary["episodes"] == {"rollout_ids": ["task7-a1"], "final": "task7-a1"}
    [row] = (await stack.get_json("/captures/rollouts"))["rollouts"]
    assert {k: row[k] for k in want} == want
    chains = await stack.get_json("/captures/rollouts/task7-a1/chains")
    assert (chains["reward"], chains["version"]) == ({"pass": 1.0, "style": 0.25}, 3)
    # A number replaces the named rewards; after the freeze too.
    await _post(stack, "/captures/rollouts/task7-a1/freeze", 200)
    assert (await _put_meta(stack, "task7-a1", {"reward": -0.5}))["version"] == 4
    assert (await stack.get_json("/captures/rollouts/task7-a1"))["reward"] == -0.5


@ON_BOTH_STORES
async def test_retire_deletes_and_a_retry_answers_the_same(stack: Stack):
    await _session(stack, "r1", steps=1)
    snap = await _post(stack, "/captures/rollouts/r1/freeze", 200)
    ids = {"snapshot_id": snap["snapshot_id"], "version": snap["version"]}
    done = await _post(stack, "/captures/rollouts/r1/retire", 200, ids)
    assert done == {
        "rollout_id": "r1",
        **ids,
        "deleted_calls": 2,
        "retired_at": done["retired_at"],
    }
    assert await _post(stack, "/captures/rollouts/r1/retire", 200, ids) == done
    await stack.get_json("/captures/rollouts/r1", status=404)
    late = await stack.chat("r1", _body(list(USER)))  # answered, not stored
    assert late.status == 200
    await stack.get_json("/captures/rollouts/r1", status=404)
    error = (await _post(stack, "/captures/rollouts/r1/freeze", 409))["error"]
    assert (error["code"], error["param"]) == ("rollout_deleted", "rollout_id")


@ON_BOTH_STORES
async def test_every_step_survives_a_restart(make_stack: MakeStack):
    stack = await make_stack()
    await _session(stack, "r1", steps=1)
    snap = await _post(stack, "/captures/rollouts/r1/freeze", 200)
    await _put_meta(stack, "r1", {"reward": 1})
    await stack.client.close()
    stack = await make_stack()  # a new proxy on the same store
    again = await _post(stack, "/captures/rollouts/r1/freeze", 200)
    assert again == {**snap, "version": 3}  # the same snapshot; the reward bumped the version
    late = await stack.chat("r1", _body(list(USER)))
    assert late.status == 200
    summary = await stack.get_json("/captures/rollouts/r1")
    assert summary["late_call_ids"] == [late.headers["X-Capture-Call-Id"]]
    assert summary["reward"] == 1.0
    ids = {"snapshot_id": snap["snapshot_id"], "version": 3}
    done = await _post(stack, "/captures/rollouts/r1/retire", 200, ids)
    assert done["deleted_calls"] == 3  # the late call goes with it
    await stack.client.close()
    stack = await make_stack()
    assert await _post(stack, "/captures/rollouts/r1/retire", 200, ids) == done


@ON_BOTH_STORES
async def test_retire_refuses_what_was_not_read(stack: Stack):
    await _session(stack, "r1", steps=1)
    some = {"snapshot_id": "0" * 32, "version": 2}
    error = (await _post(stack, "/captures/rollouts/r1/retire", 409, some))["error"]
    assert (error["code"], error["param"]) == ("rollout_not_frozen", None)
    snap = await _post(stack, "/captures/rollouts/r1/freeze", 200)
    error = (await _post(stack, "/captures/rollouts/r1/retire", 409, some))["error"]
    assert (error["code"], error["param"]) == ("snapshot_mismatch", "snapshot_id")
    await _put_meta(stack, "r1", {"reward": 0})  # changed after the trainer read version 2
    stale = {"snapshot_id": snap["snapshot_id"], "version": 2}
    error = (await _post(stack, "/captures/rollouts/r1/retire", 409, stale))["error"]
    assert (error["code"], error["param"]) == ("snapshot_mismatch", "version")
    assert (await stack.get_json("/captures/rollouts/r1"))["num_calls"] == 2  # nothing deleted


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("post", "/captures/rollouts/..x/freeze", None, 400, "rollout_id"),
        ("post", "/captures/rollouts/typo/freeze", None, 404, "rollout_id"),
        ("put", "/captures/rollouts/r1/metadata", {"reward": "high"}, 400, "reward"),
        ("put", "/captures/rollouts/r1/metadata", {"reward": True}, 400, "reward"),
        ("put", "/captures/rollouts/r1/metadata", {"reward": {"a": None}}, 400, "reward.a"),
        ("put", "/captures/rollouts/r1/metadata", {"reward": {}}, 400, "reward"),
        ("put", "/captures/rollouts/r1/metadata", {"task_id": 7}, 400, "task_id"),
        ("put", "/captures/rollouts/r1/metadata", {"tags": ["a"]}, 400, "tags"),
        ("put", "/captures/rollouts/r1/metadata", {"tags": {"k": 1}}, 400, "tags.k"),
        ("put", "/captures/rollouts/r1/metadata", {"rewards": 1}, 400, "rewards"),
        ("put", "/captures/rollouts/r1/metadata", [1], 400, "body"),
        ("put", "/captures/rollouts/typo/metadata", {"reward": 1}, 404, "rollout_id"),
        ("post", "/captures/rollouts/r1/retire", {"version": 1}, 400, "snapshot_id"),
        ("post", "/captures/rollouts/r1/retire", {"snapshot_id": "A" * 32}, 400, "snapshot_id"),
        ("post", "/captures/rollouts/r1/retire", {"snapshot_id": "a" * 32}, 400, "version"),
        (
            "post",
            "/captures/rollouts/r1/retire",
            {"snapshot_id": "a" * 32, "version": "1"},
            400,
            "version",
        ),
        (
            "post",
            "/captures/rollouts/typo/retire",
            {"snapshot_id": "a" * 32, "version": 1},
            404,
            "rollout_id",
        ),
    ],
)
async def test_bad_input_is_a_4xx_naming_the_field(stack: Stack, method, path, body, status, param):
    await _session(stack, "r1", steps=1)
    resp = await getattr(stack.client, method)(path, json=body)
    assert resp.status == status, await resp.text()
    assert (await resp.json())["error"]["param"] == param


async def test_a_body_that_is_not_json_is_a_400_naming_it(stack: Stack):
    await _session(stack, "r1", steps=1)
    for method, path in (("put", "metadata"), ("post", "retire")):
        resp = await getattr(stack.client, method)(
            f"/captures/rollouts/r1/{path}",
            data=b"{",
            headers={"Content-Type": "application/json"},
        )
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "body"
