"""Tier 2: the read API's listing pages, its JSON for odd values, and where it does its work
(off the event loop that relays the streams)."""

from __future__ import annotations

import io
import json
import threading
import zipfile

import numpy as np
import pytest

from capture_proxy.core.records import CallStatus, Diagnostic, DiagnosticKind
from capture_proxy.proxy.keys import RECORDER_KEY, STORE_KEY
from capture_proxy.rest import reads
from tests.factories import record
from tests.proxy.conftest import ON_BOTH_STORES, Stack
from tests.store.test_chain_counts import ROLLOUTS, moved


async def _put(stack: Stack, *records) -> None:
    store = stack.client.app[STORE_KEY]
    for r in records:
        await store.put_call(r)


async def test_rollouts_are_listed_in_pages(stack: Stack):
    ids = [f"r{i}" for i in range(7)]
    await _put(stack, *(record(f"c{i}", [1, 2], [3], rollout_id=rid) for i, rid in enumerate(ids)))
    pages, after = [], None
    while True:
        query = "?limit=3" + (f"&after={after}" if after else "")
        page = await stack.get_json("/captures/rollouts" + query)
        pages.append([r["rollout_id"] for r in page["rollouts"]])
        after = page["next_after"]
        if after is None:
            break
    assert pages == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    whole = await stack.get_json("/captures/rollouts")  # default page: 100
    assert [r["rollout_id"] for r in whole["rollouts"]] == ids
    assert whole["next_after"] is None
    assert whole["rollouts"][0] == {
        "rollout_id": "r0",
        "created_at": 0.0,
        "num_calls": 1,
        "num_chains": 1,
        "incomplete": False,
        "status": "open",
        "version": 1,
        "snapshot_id": None,
        "episode_of": "r0",
        "attempt": 0,
        "reward": None,
        "task_id": None,
        "tags": {},
        "late_call_ids": [],
    }


async def test_the_last_full_page_says_it_is_the_last(stack: Stack):
    await _put(stack, *(record(f"c{i}", [1, 2], [3], rollout_id=f"r{i}") for i in range(6)))
    pages, after = [], None
    while True:
        query = "?limit=2" + (f"&after={after}" if after else "")
        page = await stack.get_json("/captures/rollouts" + query)
        pages.append([r["rollout_id"] for r in page["rollouts"]])
        after = page["next_after"]
        if after is None:
            break
    assert pages == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]  # no empty fourth page
    empty = await stack.get_json("/captures/rollouts?after=r5")
    assert empty == {"rollouts": [], "next_after": None}


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("limit=%2B3", "limit"),
        ("limit=1_0", "limit"),
        ("limit=%EF%BC%93", "limit"),
        ("after=..%2Fx", "after"),
        ("after=", "after"),
    ],
)
async def test_bad_page_parameters_are_400s_naming_them(stack: Stack, query, param):
    resp = await stack.client.get(f"/captures/rollouts?{query}")
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param
    assert error["message"].startswith(param)


CHAINS, EXPORT, ATIF = (
    "/captures/rollouts/r1/chains",
    "/captures/export",
    "/captures/rollouts/r1/atif",
)


@pytest.mark.parametrize(
    ("path", "param", "values"),
    [
        ("/captures/rollouts", "limit", ("1", "2")),
        ("/captures/rollouts", "after", ("r1", "r2")),
        (CHAINS, "format", ("json", "npz")),
        (CHAINS, "min_weight_version", ("1", "7")),
        (CHAINS, "unknown_weight_version", ("keep", "drop")),
        (EXPORT, "status", ("frozen", "frozen")),
        (EXPORT, "after", ("1", "2")),
        (EXPORT, "limit", ("5", "5")),
        (EXPORT, "episodes", ("all", "final")),
        (EXPORT, "min_weight_version", ("1", "7")),
        (ATIF, "strict", ("true", "false")),
        (ATIF, "experts", ("true", "true")),
        (ATIF, "agent_name", ("a", "b")),
        (ATIF, "agent_version", ("1", "2")),
    ],
)
async def test_a_single_valued_parameter_given_twice_is_a_400_naming_it(
    stack: Stack, path, param, values
):
    resp = await stack.client.get(f"{path}?{'&'.join(f'{param}={v}' for v in values)}")
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": f"{param}: given 2 times; it takes one value",
        "type": "invalid_request_error",
        "param": param,
        "code": "repeated_parameter",
    }


@pytest.mark.parametrize(
    ("method", "path", "param", "taken"),
    [
        ("GET", "/captures/rollouts", "limt", "limit, after"),
        ("GET", "/captures/rollouts/r1", "format", "none"),
        (
            "GET",
            CHAINS,
            "min_weight_versoin",
            "format, min_weight_version, weight_version, unknown_weight_version",
        ),
        (
            "GET",
            EXPORT,
            "min-weight-version",
            "status, after, limit, episodes, min_weight_version, weight_version, "
            "unknown_weight_version",
        ),
        ("GET", ATIF, "experts_included", "strict, experts, agent_name, agent_version"),
        ("GET", "/captures/rollouts/r1/tree", "format", "none"),
        ("GET", "/captures/calls/c1", "detail", "none"),
        ("GET", "/captures/images/" + "0" * 64, "size", "none"),
        ("DELETE", "/captures/rollouts/r1", "force", "none"),
        ("POST", "/captures/rollouts/r1/freeze", "force", "none"),
        ("POST", "/captures/rollouts/r1/retire", "reason", "none"),
        ("PUT", "/captures/rollouts/r1/metadata", "merge", "none"),
    ],
)
async def test_a_parameter_the_endpoint_does_not_take_is_a_400_naming_it(
    stack: Stack, method, path, param, taken
):
    """A misspelt filter must not be dropped silently (it would turn the staleness filter off
    and answer 200 with every sample); nothing is read, deleted or frozen."""
    await _put(stack, record("c1", [1, 2], [3], rollout_id="r1"))
    resp = await stack.client.request(method, f"{path}?{param}=5", json={})
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": f"{param}: not a parameter of this endpoint (it takes: {taken})",
        "type": "invalid_request_error",
        "param": param,
        "code": "unknown_parameter",
    }
    assert (await stack.client.get("/captures/rollouts/r1")).status == 200
    summary = await (await stack.client.get("/captures/rollouts/r1")).json()
    assert summary["status"] == "open"


async def test_a_repeatable_weight_version_is_not_refused(stack: Stack):
    resp = await stack.client.get("/captures/export?weight_version=1&weight_version=7")
    assert resp.status == 200


async def test_a_limit_of_thousands_of_digits_is_a_400(stack: Stack):
    for path in ("/captures/rollouts", "/captures/export"):
        resp = await stack.client.get(f"{path}?limit={'9' * 5000}")
        assert resp.status == 400, path
        assert (await resp.json())["error"]["code"] == "invalid_limit"


async def test_odd_values_come_back_exact_as_valid_json(stack: Stack):
    """NaN log probs as null, routed experts as nested lists, an integer past 64 bits (which
    orjson refuses: the stdlib path takes it) exactly."""
    rec = record("c1", [5, 6, 7], [8, 9, 10])
    rec.generation_log_probs[1] = np.nan
    rec.routed_experts = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    rec.routed_experts_start = 4
    rec.usage = {"prompt_tokens": 3, "completion_tokens": 3, "odd": 2**70}
    rec.diagnostics = [Diagnostic(DiagnosticKind.NON_FINITE_LOGPROB, {"positions": [1]})]
    await _put(stack, rec)
    for path in ("/captures/rollouts/r1/chains", "/captures/calls/c1"):
        resp = await stack.client.get(path)
        assert resp.status == 200
        text = await resp.text()
        body = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
        call = body["chains"][0]["calls"][0] if "chains" in body else body
        assert call["prompt_token_ids"] == [5, 6, 7]
        assert call["generation_token_ids"] == [8, 9, 10]
        assert call["generation_log_probs"] == [-0.5, None, -1.5]
        assert call["routed_experts"] == rec.routed_experts.tolist()
        assert call["usage"]["odd"] == 2**70


async def test_log_probs_are_the_float32_values_exactly(stack: Stack):
    rec = record("c1", [1], [2, 3])
    rec.generation_log_probs = np.array([-0.1, -1e-5], dtype=np.float32)
    await _put(stack, rec)
    call = await stack.get_json("/captures/calls/c1")
    assert call["generation_log_probs"] == [float(np.float32(-0.1)), float(np.float32(-1e-5))]
    assert np.array_equal(
        np.array(call["generation_log_probs"], dtype=np.float32), rec.generation_log_probs
    )


async def test_chains_summary_listing_and_archives_are_built_on_the_rest_thread(
    stack: Stack, monkeypatch
):
    await _put(stack, record("c1", [1, 2], [3]), record("c2", [1, 2, 3, 4], [5]))
    threads: dict[str, str] = {}
    for name in ("_chains_json", "_chains_npz", "_summary_json", "_listing_json"):
        original = getattr(reads, name)

        def spy(*args, _name=name, _original=original):
            threads[_name] = threading.current_thread().name
            return _original(*args)

        monkeypatch.setattr(reads, name, spy)
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [["c1", "c2"]]
    assert (await stack.get_json("/captures/rollouts/r1"))["num_chains"] == 1
    assert (await stack.get_json("/captures/rollouts"))["rollouts"][0]["num_chains"] == 1
    resp = await stack.client.get("/captures/rollouts/r1/chains?format=npz")
    assert resp.status == 200
    with zipfile.ZipFile(io.BytesIO(await resp.read())) as archive:
        assert "manifest.json" in archive.namelist()
    assert threads == dict.fromkeys(threads, "capture-rest_0")
    assert set(threads) == {"_chains_json", "_chains_npz", "_summary_json", "_listing_json"}


async def test_chains_json_outside_the_calls_that_orjson_refuses_takes_the_stdlib(stack: Stack):
    """An unlinked call's diagnostic with an integer past 64 bits sits in the envelope, not in
    a call: the whole answer is serialised the slow way, with the same values."""
    linked = record("c1", [1, 2], [3])
    odd = record("c2", [9], [8], status=CallStatus.INCOMPLETE)
    odd.diagnostics = [Diagnostic(DiagnosticKind.CAPTURE_INCOMPLETE, {"reasons": [2**70]})]
    await _put(stack, linked, odd)
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [["c1"]]
    assert chains["chains"][0]["calls"][0]["generation_log_probs"] == [-0.5]
    [unlinked] = chains["unlinked_calls"]
    assert unlinked["call_id"] == "c2"
    assert unlinked["diagnostics"][0]["details"] == {"reasons": [2**70]}


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("POST", "/captures/rollouts", "GET, HEAD"),
        ("PUT", "/captures/rollouts/r1", "DELETE, GET, HEAD"),
        ("DELETE", "/captures/calls/c1", "GET, HEAD"),
        ("POST", "/captures/rollouts/r1/chains", "GET, HEAD"),
    ],
)
async def test_a_wrong_method_on_a_read_api_path_is_405_with_allow(
    stack: Stack, method, path, allow
):
    resp = await stack.client.request(method, path)
    assert resp.status == 405
    assert resp.headers["Allow"] == allow
    err = (await resp.json())["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "method_not_allowed")


async def test_an_unknown_read_api_path_is_still_404(stack: Stack):
    resp = await stack.client.post("/captures/nothing")
    assert resp.status == 404
    assert (await resp.json())["error"]["type"] == "not_found_error"


async def test_a_call_reads_back_the_request_as_the_harness_sent_it(stack: Stack):
    base = "/ng-rollout/r-received/training-token-capture"
    chat = {
        "model": "scripted-qwen",
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"task": "t-1", "n": 1.0},
        "user": "u-7",
        "temperature": 0.5,
    }
    resp = await stack.client.post(base + "/v1/chat/completions", json=chat)
    assert resp.status == 200
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["request_received"] == {k: v for k, v in chat.items() if k != "messages"}
    assert isinstance(call["request_received"]["metadata"]["n"], float)
    assert call["request_messages"] == chat["messages"]
    # Anthropic Messages: what the canonical form leaves out (cache_control, server tools)
    messages = {
        "model": "scripted-qwen",
        "max_tokens": 16,
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
    }
    resp = await stack.client.post(
        base + "/v1/messages", json=messages, headers={"anthropic-version": "2023-06-01"}
    )
    assert resp.status == 200
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["request_received"] == {k: v for k, v in messages.items() if k != "messages"}


@ON_BOTH_STORES
async def test_the_listing_answers_as_when_it_built_every_rollouts_chains(stack: Stack):
    store = stack.client.app[STORE_KEY]
    ids = {name: f"k{i:02d}" for i, name in enumerate(ROLLOUTS)}
    for name, (calls, _, _) in ROLLOUTS.items():
        await _put(stack, *(moved(c, ids[name]) for c in calls))
    await store.freeze_rollout(ids["chain"])
    await _put(stack, moved(ROLLOUTS["two roots"][0][0], ids["chain"]).replace(call_id="late"))
    loaded: list[str] = []
    original = store.get_rollout_calls

    async def counting(rollout_id: str):  # type: ignore[no-untyped-def]
        loaded.append(rollout_id)
        return await original(rollout_id)

    store.get_rollout_calls = counting  # type: ignore[method-assign]
    try:
        got = await stack.get_json("/captures/rollouts?limit=5")
        got_all = await stack.get_json("/captures/rollouts")
    finally:
        store.get_rollout_calls = original  # type: ignore[method-assign]
    # Only the rollouts whose number of chains the store does not keep are loaded.
    not_kept = sorted(ids[n] for n, (_, _, kept) in ROLLOUTS.items() if not kept)
    assert sorted(set(loaded)) == not_kept
    infos = await store.list_rollouts()
    recorder = stack.client.app[RECORDER_KEY]
    before = [  # as the listing was: every rollout's calls loaded and its chains built
        (
            i,
            reads.snapshot_records(i, await store.get_rollout_calls(i.rollout_id)),
            reads.RolloutState(i, recorder),
        )
        for i in infos
    ]
    assert got_all == json.loads(reads._listing_json(before, None))
    assert got == json.loads(reads._listing_json(before[:5], "k04"))
    by_id = {r["rollout_id"]: r for r in got_all["rollouts"]}
    chain = by_id[ids["chain"]]
    assert (chain["num_chains"], chain["late_call_ids"]) == (1, ["late"])
    assert [by_id[ids[n]]["num_chains"] for n in ROLLOUTS] == [c for _, c, _ in ROLLOUTS.values()]
