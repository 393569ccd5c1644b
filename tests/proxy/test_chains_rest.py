"""Tier 2: a multi-step session builds one agent chain plus a title root; REST shapes."""

from __future__ import annotations

from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.conftest import Stack
from tests.proxy.test_capture import USER, _body

TITLE_REQUEST = {
    "model": "scripted-qwen",
    "messages": [
        {"role": "system", "content": "You are a title generator."},
        {"role": "user", "content": "List the files."},
    ],
    "stream": True,
}


def _echo(message: dict) -> dict:
    """The assistant message as OpenCode sends it back: content "" rather than null."""
    out = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


async def run_session(stack: Stack, rollout: str) -> list[str]:
    """Title request + three agent steps (bash, read, answer). Returns the agent call ids."""
    title = await stack.chat(rollout, TITLE_REQUEST)
    await title.read()
    messages = list(USER)
    call_ids = []
    for step in range(3):
        resp = await stack.chat(rollout, _body(messages))
        assert resp.status == 200
        call_ids.append(resp.headers["X-Capture-Call-Id"])
        message = (await resp.json())["choices"][0]["message"]
        messages.append(_echo(message))
        for tc in message.get("tool_calls") or []:
            messages.append(
                {"role": "tool", "tool_call_id": tc["id"], "content": f"output of step {step}"}
            )
    return call_ids


async def test_session_forms_one_agent_chain_and_a_title_root(stack: Stack):
    agent_ids = await run_session(stack, "task-1-a0")
    chains = await stack.get_json("/captures/rollouts/task-1-a0/chains")
    assert chains["rollout_id"] == "task-1-a0"
    assert chains["incomplete"] is False
    assert chains["unlinked_calls"] == []
    shapes = [[(c["call_id"], c["parent_call_id"]) for c in ch["calls"]] for ch in chains["chains"]]
    title_id = chains["chains"][0]["calls"][0]["call_id"]
    assert shapes == [
        [(title_id, None)],
        [(agent_ids[0], None), (agent_ids[1], agent_ids[0]), (agent_ids[2], agent_ids[1])],
    ]
    assert chains["chains"][1]["chain_id"] == agent_ids[0]
    calls = chains["chains"][1]["calls"]
    for parent, child in zip(calls, calls[1:], strict=False):
        prefix = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert child["prompt_token_ids"][: len(prefix)] == prefix
    # Token ids are exactly what the engine sent, in order (title first).
    assert [c["generation_token_ids"] for c in calls] == [
        s.generation_token_ids for s in stack.sent[1:]
    ]
    assert chains["chains"][0]["calls"][0]["prompt_token_ids"] == stack.sent[0].prompt_token_ids

    summary = await stack.get_json("/captures/rollouts/task-1-a0")
    assert {
        k: summary[k]
        for k in (
            "num_calls",
            "num_complete",
            "num_incomplete",
            "num_failed",
            "num_chains",
            "num_roots",
            "num_branches",
            "incomplete",
        )
    } == {
        "num_calls": 4,
        "num_complete": 4,
        "num_incomplete": 0,
        "num_failed": 0,
        "num_chains": 2,
        "num_roots": 2,
        "num_branches": 0,
        "incomplete": False,
    }
    assert [c["num_calls"] for c in summary["chains"]] == [1, 3]

    listing = await stack.get_json("/captures/rollouts")
    assert listing["rollouts"] == [
        {
            "rollout_id": "task-1-a0",
            "created_at": summary["created_at"],
            "num_calls": 4,
            "num_chains": 2,
            "incomplete": False,
            "status": "open",
            "version": 4,
            "snapshot_id": None,
            "episode_of": "task-1",
            "attempt": 0,
            "reward": None,
            "task_id": None,
            "tags": {},
            "late_call_ids": [],
        }
    ]


async def test_rollouts_are_kept_apart(stack: Stack):
    a = await run_session(stack, "ra")
    b = await run_session(stack, "rb")
    chains_a = await stack.get_json("/captures/rollouts/ra/chains")
    chains_b = await stack.get_json("/captures/rollouts/rb/chains")
    assert [c["call_id"] for c in chains_a["chains"][1]["calls"]] == a
    assert [c["call_id"] for c in chains_b["chains"][1]["calls"]] == b


async def test_chains_survive_a_restart_of_the_store(stack: Stack):
    agent_ids = await run_session(stack, "r1")
    await stack.client.close()
    store = SQLiteStore(stack.store_dir)
    await store.open()
    try:
        records = await store.get_rollout_calls("r1")
        assert [r.call_id for r in records][1:] == agent_ids
        assert [r.generation_token_ids.tolist() for r in records] == [
            s.generation_token_ids for s in stack.sent
        ]
    finally:
        await store.close()


async def test_unknown_ids_are_json_404s(stack: Stack):
    for path in (
        "/captures/rollouts/nope",
        "/captures/rollouts/nope/chains",
        "/captures/calls/call-x",
        "/captures/whatever",
    ):
        body = await stack.get_json(path, status=404)
        assert body["error"]["type"] == "not_found_error"
        assert body["error"]["message"]


async def test_invalid_rollout_id_is_a_400_and_nothing_is_forwarded(stack: Stack):
    resp = await stack.client.post(
        "/ng-rollout/..%2Fetc/training-token-capture/v1/chat/completions", json=_body(USER)
    )
    assert resp.status == 400
    body = await resp.json()
    assert (
        body["error"]["param"] == "rollout_id" and body["error"]["type"] == "invalid_request_error"
    )
    assert stack.sent == []
    body = await stack.get_json("/captures/rollouts/-bad", status=400)
    assert body["error"]["code"] == "invalid_rollout_id"


async def test_a_control_character_in_a_rollout_id_is_the_same_400(stack: Stack):
    """A newline (``%0A``) in the id matched no route (aiohttp's ``.*`` stops at it): a bare
    404 "Not Found", where every other bad id gets ``invalid_rollout_id``."""
    for rid in ("a%0Ab", "a%0A", "%0Aa", "a%09b", "a%0Db", "a%0D%0Ab", "a%7Fb"):
        for path in (
            f"/ng-rollout/{rid}/training-token-capture/v1/chat/completions",
            f"/ng-rollout/{rid}/v1/chat/completions",
        ):
            resp = await stack.client.post(path, json=_body(USER))
            body = await resp.json()
            assert (resp.status, body["error"]["code"], body["error"]["param"]) == (
                400,
                "invalid_rollout_id",
                "rollout_id",
            ), path
        body = await stack.get_json(f"/captures/rollouts/{rid}/chains", status=400)
        assert body["error"]["code"] == "invalid_rollout_id"
    # Under /captures, a path no route takes is the read API's JSON 404, newline or not.
    body = await stack.get_json("/captures/what%0Aever", status=404)
    assert body["error"]["type"] == "not_found_error"
    assert stack.sent == []
