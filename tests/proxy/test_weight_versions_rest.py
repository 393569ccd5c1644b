"""Tier 2: weight versions through the read API and the exports: the rollout summary, the call
and chains JSON, the npz archive, the Arrow export, ATIF, the readers, and the version filter
with its bad values. Records with known spans are stored in the proxy's store (the capture
side fills them from the engine); a session through the proxy checks that every form agrees
with the calls' own spans, whatever they are."""

from __future__ import annotations

import asyncio

import numpy as np

from capture_proxy import readers
from capture_proxy.proxy.keys import STORE_KEY
from tests.core.test_weight_versions import weighted_calls
from tests.factories import record
from tests.proxy.conftest import ON_BOTH_STORES, Stack
from tests.proxy.test_export_rest import _export, _freeze
from tests.proxy.test_npz_and_retention import _session

SPANS = {
    "a": [{"version": "default", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}],
    "b": [{"version": "4", "start": 0, "end": 2}],
    "c": None,
    "t": [{"version": "10", "start": 0, "end": 2}],
    "u": [{"version": "v7", "start": 0, "end": 1}],
}
SOURCES = {
    "a": "engine_spans",
    "b": "engine_reported",
    "c": None,
    "t": "observed",
    "u": "engine_reported",
}


async def _put(stack: Stack) -> None:
    store = stack.client.app[STORE_KEY]
    for r in weighted_calls():
        await store.put_call(r)


def _base(stack: Stack) -> str:
    return str(stack.client.make_url("/")).rstrip("/")


@ON_BOTH_STORES
async def test_summary_call_and_chains_carry_spans_and_source(stack: Stack):
    await _put(stack)
    summary = await stack.get_json("/captures/rollouts/r1")
    assert {k: v for k, v in summary.items() if k.startswith("weight_version")} == {
        "weight_versions": {"default": 1, "v7": 1, "3": 2, "4": 2, "10": 2},
        "weight_version_min": 3,
        "weight_version_max": 10,
        "weight_version_sources": {"engine_reported": 2, "engine_spans": 1, "observed": 1},
        "weight_version_unknown": {"num_calls": 1, "num_generation_tokens": 1},
    }
    call = await stack.get_json("/captures/calls/a")
    assert (call["weight_versions"], call["weight_version_source"]) == (SPANS["a"], SOURCES["a"])
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    got = {
        c["call_id"]: (c["weight_versions"], c["weight_version_source"])
        for ch in chains["chains"]
        for c in ch["calls"]
    }
    assert got == {k: (SPANS[k], SOURCES[k]) for k in SPANS}
    assert chains["weight_filter"] is None


async def test_the_chains_read_keeps_the_paths_that_pass(stack: Stack):
    await _put(stack)

    async def calls(query: str) -> tuple[list[list[str]], dict]:
        body = await stack.get_json(f"/captures/rollouts/r1/chains?{query}")
        return [[c["call_id"] for c in ch["calls"]] for ch in body["chains"]], body

    kept, body = await calls("min_weight_version=4")
    assert kept == [["t"]]
    report = body["weight_filter"]
    assert (report["min_weight_version"], report["num_samples"], report["num_samples_kept"]) == (
        4,
        4,
        1,
    )
    assert [(d["leaf_call_id"], d["call_id"], d["reason"]) for d in report["dropped_samples"]] == [
        ("b", "a", "older_than_min_weight_version"),
        ("c", "a", "older_than_min_weight_version"),
        ("u", "u", "older_than_min_weight_version"),
    ]
    assert body["main_chain_id"] == "a"  # the rollout's, filtered out or not
    kept, body = await calls("weight_version=default&weight_version=3&weight_version=4")
    assert kept == [["a", "b"]]  # c's tokens have no known version: its path is dropped
    assert body["weight_filter"]["weight_versions"] == ["3", "4", "default"]
    kept, _ = await calls("weight_version=default&weight_version=3&unknown_weight_version=keep")
    assert kept == [["a", "c"]]
    kept, _ = await calls("unknown_weight_version=keep")  # no filter named: everything
    assert kept == [["a", "b", "c"], ["t"], ["u"]]


async def test_a_version_past_64_bits_reads_and_filters_as_the_summary_reports_it(stack: Stack):
    # The trial's case (#7): 10**18 and up were refused as "not an integer version".
    big = 99999999999999999999999
    store = stack.client.app[STORE_KEY]
    await store.put_call(record("x", [1], [2, 3], weight_versions=[("10", 0, 2)]))
    await store.put_call(record("y", [9], [8], created_at=1, weight_versions=[(str(big), 0, 1)]))
    summary = await stack.get_json("/captures/rollouts/r1")
    assert (summary["weight_version_min"], summary["weight_version_max"]) == (10, big)
    for n in (10**18, big):
        body = await stack.get_json(f"/captures/rollouts/r1/chains?min_weight_version={n}")
        assert [[c["call_id"] for c in ch["calls"]] for ch in body["chains"]] == [["y"]]
        assert body["weight_filter"]["min_weight_version"] == n
    resp = await stack.client.get("/captures/rollouts/r1/chains?min_weight_version=" + "9" * 257)
    assert resp.status == 400
    assert "1 to 256 digits" in (await resp.json())["error"]["message"]


async def test_bad_filter_values_are_400s_naming_the_parameter(stack: Stack):
    await _put(stack)
    await _freeze(stack, "r1")
    for path, param in [
        ("/captures/rollouts/r1/chains?min_weight_version=abc", "min_weight_version"),
        ("/captures/rollouts/r1/chains?format=npz&min_weight_version=3.5", "min_weight_version"),
        ("/captures/rollouts/r1/chains?weight_version=", "weight_version"),
        ("/captures/export?min_weight_version=default", "min_weight_version"),
        ("/captures/export?weight_version=3&unknown_weight_version=yes", "unknown_weight_version"),
    ]:
        resp = await stack.client.get(path)
        assert resp.status == 400, path
        error = (await resp.json())["error"]
        assert (error["param"], error["code"]) == (param, "invalid_weight_version"), path


@ON_BOTH_STORES
async def test_npz_export_and_readers_agree_on_the_version_arrays(stack: Stack):
    await _put(stack)
    await _freeze(stack, "r1")
    base = _base(stack)

    def read() -> tuple:
        return (
            readers.fetch_chains(base, "r1"),
            readers.fetch_chains(base, "r1", min_weight_version=3),
            list(readers.iter_rollouts(base)),
            list(readers.iter_rollouts(base, weight_versions=["10", "v7"])),
        )

    npz, newer, exported, listed = await asyncio.to_thread(read)
    assert [s.leaf_call_id for s in npz] == ["b", "c", "t", "u"]
    b = npz[0].arrays
    assert b["weight_version_index"].tolist() == [-1, -1, 0, 1, 1, -1, 2, 2]
    assert b["weight_versions"].tolist() == ["default", "3", "4"]
    assert b["weight_version_sources"].tolist() == ["engine_spans", "engine_reported"]
    assert npz.manifest["weight_filter"] is None
    assert [s.leaf_call_id for s in newer] == ["t"]
    assert newer.manifest["weight_filter"]["num_samples_kept"] == 1
    assert [e["leaf_call_id"] for e in newer.manifest["samples"]] == ["t"]
    [rollout] = exported
    rows = rollout.samples()
    assert rollout.manifest["weight_filter"] is None
    for row, sample in zip(rows, npz, strict=True):
        index = sample.arrays["weight_version_index"]
        assert row["weight_version_index"].dtype == np.int16
        assert row["weight_version_index"].tobytes() == index.tobytes()
        assert row["weight_versions"] == sample.arrays["weight_versions"].tolist()
        sources = sample.arrays["weight_version_sources"].tolist()
        assert row["weight_version_sources"] == [s or None for s in sources]
    [filtered] = listed
    assert [r["leaf_call_id"] for r in filtered.samples()] == ["t", "u"]
    report = filtered.manifest["weight_filter"]
    assert report["weight_versions"] == ["10", "v7"] and report["num_samples_kept"] == 2
    assert [d["leaf_call_id"] for d in report["dropped_samples"]] == ["b", "c"]


async def test_an_export_that_drops_every_sample_still_sends_the_rollout(stack: Stack):
    await _put(stack)
    await _freeze(stack, "r1")
    [(manifest, batch)], headers = await _export(stack, "min_weight_version=99")
    assert batch.num_rows == 0 and manifest["num_samples"] == 0
    assert manifest["weight_filter"]["num_samples"] == 4
    assert headers["X-Capture-Next-After"] == "1"  # the cursor passes it: it can be retired


async def test_atif_steps_carry_their_spans_and_source(stack: Stack):
    await _put(stack)
    atif = await stack.get_json("/captures/rollouts/r1/atif")
    assert atif["extra"]["call_ids"] == ["a", "c"]
    assert [
        (s["metrics"]["extra"]["weight_versions"], s["metrics"]["extra"]["weight_version_source"])
        for s in atif["steps"]
    ] == [(SPANS["a"], "engine_spans"), (None, None)]
    assert atif["extra"]["weight_versions"] == {"default": 1, "3": 2}


async def test_a_captured_session_agrees_with_its_calls_spans_in_every_form(stack: Stack):
    """Whatever versions the capture recorded (none, or the engine's), every form says the
    same: the npz index is the calls' spans laid over the sequence, the export's the npz's."""
    await _session(stack, "s1", steps=2)
    chains = await stack.get_json("/captures/rollouts/s1/chains")
    calls = {c["call_id"]: c for ch in chains["chains"] for c in ch["calls"]}
    await _freeze(stack, "s1")
    base = _base(stack)
    npz, [rollout] = await asyncio.to_thread(
        lambda: (readers.fetch_chains(base, "s1"), list(readers.iter_rollouts(base)))
    )
    for sample, row in zip(npz, rollout.samples(), strict=True):
        table = sample.arrays["weight_versions"].tolist()
        want = np.full(len(sample.arrays["input_ids"]), -1, np.int64)
        for call_id in sample.call_ids:
            call = calls[call_id]
            start = call["num_prompt_tokens"]
            for span in call["weight_versions"] or []:
                want[start + span["start"] : start + span["end"]] = table.index(span["version"])
        assert sample.arrays["weight_version_index"].tolist() == want.tolist()
        assert row["weight_version_index"].tolist() == want.tolist()
        assert sample.arrays["weight_version_sources"].tolist() == [
            calls[c]["weight_version_source"] or "" for c in sample.call_ids
        ]
