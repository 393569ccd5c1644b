"""Tier 2: routed experts through the proxy, the npz read form against the JSON form, and
deleting a rollout (tombstone) over REST, and the periodic sweep of old tombstones."""

from __future__ import annotations

import logging
import math

import numpy as np

from capture_proxy.app import (
    MAX_SWEEP_INTERVAL_S,
    SWEEPER_KEY,
    sweep_interval_s,
    sweep_tombstones,
)
from capture_proxy.proxy.keys import STORE_KEY
from capture_proxy.readers import load_chains
from capture_proxy.scripted_engine import Faults, ScriptedEngineConfig
from capture_proxy.scripted_engine.moe import expert_rows
from tests.proxy.conftest import MakeStack
from tests.proxy.test_capture import USER, _body
from tests.proxy.test_chains_rest import TITLE_REQUEST, _echo

MOE = (4, 2, 64)


async def _session(stack, rollout: str, steps: int = 3) -> list[str]:
    title = await stack.chat(rollout, {**TITLE_REQUEST, "stream": False})
    await title.read()
    messages = list(USER)
    ids = []
    for step in range(steps):
        resp = await stack.chat(rollout, _body(messages))
        assert resp.status == 200
        ids.append(resp.headers["X-Capture-Call-Id"])
        body = await resp.json()
        assert "routed_experts" not in body["choices"][0]  # stripped: the harness did not ask
        message = body["choices"][0]["message"]
        messages.append(_echo(message))
        for tc in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": f"out {step}"})
    return ids


async def test_npz_agrees_with_json_exactly(make_stack: MakeStack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(moe=MOE))
    agent_ids = await _session(stack, "moe-1")
    chains = await stack.get_json("/captures/rollouts/moe-1/chains")
    resp = await stack.client.get("/captures/rollouts/moe-1/chains?format=npz")
    assert resp.status == 200 and resp.content_type == "application/zip"
    samples = load_chains(await resp.read())
    assert [(s.chain_id, s.call_ids) for s in samples] == [
        (ch["chain_id"], [c["call_id"] for c in ch["calls"]]) for ch in chains["chains"]
    ]
    assert samples[1].call_ids == agent_ids
    # Only the title and the first agent call (roots) asked for every row.
    starts = [s.request_body.get("routed_experts_prompt_start") for s in stack.sent]
    assert starts[:2] == [None, None] and all(isinstance(x, int) and x > 0 for x in starts[2:])
    for sample, chain in zip(samples, chains["chains"], strict=True):
        calls = chain["calls"]
        leaf = calls[-1]
        a = sample.arrays
        assert a["input_ids"].dtype == np.uint32
        assert a["input_ids"].tolist() == leaf["prompt_token_ids"] + leaf["generation_token_ids"]
        mask = np.zeros(len(a["input_ids"]), np.uint8)
        log_probs = np.zeros(len(a["input_ids"]), np.float32)
        for c in calls:
            start = c["num_prompt_tokens"]
            end = start + c["num_generation_tokens"]
            mask[start:end] = 1
            log_probs[start:end] = [math.nan if v is None else v for v in c["generation_log_probs"]]
            # Each call holds only the rows its parent does not: the proxy asked the engine
            # to start at the parent's end (routed_experts_prompt_start).
            rows = np.asarray(c["routed_experts"])
            full = c["prompt_token_ids"] + c["generation_token_ids"]
            parent = next((p for p in calls if p["call_id"] == c["parent_call_id"]), None)
            start = (
                0
                if parent is None
                else parent["num_prompt_tokens"] + parent["num_generation_tokens"] - 1
            )
            assert c["routed_experts_start"] == start
            assert np.array_equal(rows, expert_rows(full, MOE)[start:])
        assert a["loss_mask"].tolist() == mask.tolist()
        assert a["log_probs"].tobytes() == log_probs.tobytes()
        # Aligned rows: the first call covering a position; the engine's rows agree anyway.
        seq = leaf["prompt_token_ids"] + leaf["generation_token_ids"]
        want = expert_rows(seq, MOE)
        assert a["routed_experts"].dtype == np.uint8
        assert np.array_equal(a["routed_experts"][:-1], want)
        assert a["routed_experts_mask"].tolist() == [1] * (len(seq) - 1) + [0]


async def test_unknown_format_is_400(stack):
    await _session(stack, "fmt", steps=1)
    resp = await stack.client.get("/captures/rollouts/fmt/chains?format=parquet")
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "format"


async def test_delete_leaves_a_tombstone_and_late_calls_still_answer(stack, caplog):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    await _session(stack, "gone", steps=1)
    resp = await stack.client.delete("/captures/rollouts/gone")
    assert resp.status == 200
    assert await resp.json() == {"rollout_id": "gone", "deleted_calls": 2}
    await stack.get_json("/captures/rollouts/gone", status=404)
    # A late call for the deleted rollout: the harness gets its answer, nothing is stored.
    resp = await stack.chat("gone", _body(list(USER)))
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]
    await stack.get_json("/captures/rollouts/gone", status=404)
    # Refused by the tombstone, as meant: its own counter, INFO, not a store failure.
    health = await stack.get_json("/health")
    assert health["capture"]["store_failures"] == 0
    assert health["capture"]["late_calls_refused"] == 1
    late = [r for r in caplog.records if "late call" in r.getMessage()]
    assert [r.levelname for r in late] == ["INFO"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    resp = await stack.client.delete("/captures/rollouts/gone")
    assert (await resp.json())["deleted_calls"] == 0
    resp = await stack.client.delete("/captures/rollouts/..bad")
    assert resp.status == 400


def test_sweep_interval_is_a_tenth_of_the_retention_at_most_an_hour():
    assert sweep_interval_s(60.0) == 6.0
    assert sweep_interval_s(86_400.0) == MAX_SWEEP_INTERVAL_S == 3600.0


async def test_tombstones_past_their_retention_are_swept_and_the_rollout_may_start_again(
    make_stack: MakeStack,
):
    stack = await make_stack(tombstone_retention_s=3600.0)
    sweeper = stack.client.app[SWEEPER_KEY]
    assert not sweeper.done()  # the periodic sweep runs with the app
    store = stack.client.app[STORE_KEY]
    await _session(stack, "gone", steps=1)
    await stack.client.delete("/captures/rollouts/gone")
    assert await sweep_tombstones(store, 3600.0) == 0  # younger than the retention: kept
    resp = await stack.chat("gone", _body(list(USER)))
    assert resp.status == 200
    await stack.get_json("/captures/rollouts/gone", status=404)  # refused while tombstoned
    assert await sweep_tombstones(store, 1e-9) == 1  # past the retention: swept
    resp = await stack.chat("gone", _body(list(USER)))
    assert resp.status == 200
    assert (await stack.get_json("/captures/rollouts/gone"))["num_calls"] == 1
    await stack.client.close()  # shutting down stops the sweeper
    assert sweeper.done()


async def test_a_failing_sweep_is_logged_not_raised(caplog):
    class Broken:
        async def sweep_tombstones(self, older_than_s):
            raise OSError("disk gone")

    assert await sweep_tombstones(Broken(), 1.0) == 0  # type: ignore[arg-type]
    assert "sweeping tombstones failed: disk gone" in caplog.text


async def test_deleting_an_unknown_rollout_is_a_404_and_blocks_nothing(stack):
    resp = await stack.client.delete("/captures/rollouts/typo")
    assert resp.status == 404
    assert (await resp.json())["error"]["param"] == "rollout_id"
    await _session(stack, "typo", steps=1)  # the id is not blocked
    assert (await stack.get_json("/captures/rollouts/typo"))["num_calls"] == 2


async def test_deleting_a_rollout_whose_first_call_is_in_flight_tombstones_it(make_stack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(faults=Faults(chunk_delay_s=0.02)))
    resp = await stack.chat("early", _body(list(USER), stream=True))
    assert (await resp.content.readline()).startswith(b"data: ")  # the call is in flight
    deleted = await stack.client.delete("/captures/rollouts/early")
    assert (await deleted.json()) == {"rollout_id": "early", "deleted_calls": 0}
    assert (await resp.read()).endswith(b"data: [DONE]\n\n")  # the harness gets its answer
    await stack.get_json("/captures/rollouts/early", status=404)  # ... and nothing is stored
    capture = (await stack.get_json("/health"))["capture"]
    assert (capture["late_calls_refused"], capture["store_failures"]) == (1, 0)
