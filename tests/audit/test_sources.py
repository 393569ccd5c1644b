"""The audit's samples are the exporters' samples: a store written through the proxy by the
scripted engine (MoE rows on), read in the npz, Arrow and tree forms, from the store directory
and over the read API, against the archive a trainer downloads."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from capture_proxy import readers
from capture_proxy.audit.sources import FORMS, api_samples, store_samples
from capture_proxy.scripted_engine import ScriptedEngineConfig
from tests.proxy.conftest import MakeStack
from tests.proxy.test_npz_and_retention import MOE, _session


def _same(got, want: readers.ChainSample, rollout_id: str, *, spans: bool = True) -> None:
    assert (got.rollout_id, got.chain_id, got.leaf_call_id) == (
        rollout_id,
        want.chain_id,
        want.leaf_call_id,
    )
    assert list(got.call_ids) == want.call_ids
    for name in ("input_ids", "loss_mask", "log_probs"):
        assert np.array_equal(got.__dict__[name], want.arrays[name]), name
    if "routed_experts" in want.arrays:
        assert np.array_equal(got.routed_experts, want.arrays["routed_experts"])
        assert np.array_equal(got.routed_experts_mask, want.arrays["routed_experts_mask"])
    else:
        assert got.routed_experts is None and got.routed_experts_mask is None
    if spans:
        assert got.generation_spans.tolist() == want.arrays["generation_spans"].tolist()
        (start, _), *_ = want.arrays["generation_spans"].tolist()
        assert got.call_at(start) == want.call_ids[0] and got.call_at(0) is None
    else:
        assert got.generation_spans is None and got.call_at(0) is None


@pytest.mark.parametrize("form", FORMS)
async def test_store_samples_in_every_form_are_the_archives(make_stack: MakeStack, form):
    stack = await make_stack(engine_config=ScriptedEngineConfig(moe=MOE))
    await _session(stack, "moe-1", steps=3)
    await _session(stack, "moe-2", steps=1)
    want = {}
    for rid in ("moe-1", "moe-2"):
        resp = await stack.client.get(f"/captures/rollouts/{rid}/chains?format=npz")
        want[rid] = readers.load_chains(await resp.read()).samples
    assert [len(v) for v in want.values()] == [2, 2]  # the title call and the agent chain
    assert "routed_experts" in want["moe-1"][1].arrays
    got, missing = await store_samples(stack.store_dir, None, form)
    assert missing == []
    expected = [(rid, s) for rid in ("moe-1", "moe-2") for s in want[rid]]
    if form == "tree":  # the tree orders its leaves as the samples; it holds no spans
        assert len(got) == len(expected)
    for g, (rid, w) in zip(got, expected, strict=True):
        _same(g, w, rid, spans=form != "tree")
    only, missing = await store_samples(stack.store_dir, ["moe-2", "nope"], form)
    assert missing == ["nope"] and [s.rollout_id for s in only] == ["moe-2", "moe-2"]


@pytest.mark.parametrize("form", FORMS)
async def test_api_samples_are_the_same_as_the_stores(make_stack: MakeStack, form):
    stack = await make_stack(engine_config=ScriptedEngineConfig(moe=MOE), captures_token="t0k")
    await _session(stack, "moe-1", steps=2)
    await _session(stack, "moe-2", steps=1)
    for rid in ("moe-1", "moe-2"):
        auth = {"Authorization": "Bearer t0k"}
        resp = await stack.client.post(f"/captures/rollouts/{rid}/freeze", headers=auth)
        assert resp.status == 200
    base = str(stack.client.make_url("")).rstrip("/")
    # urllib blocks: off the loop that serves the proxy.
    got, missing = await asyncio.to_thread(api_samples, base, "t0k", None, form)
    assert missing == []
    want, _ = await store_samples(stack.store_dir, None, form)
    assert [(s.rollout_id, s.leaf_call_id) for s in got] == [
        (s.rollout_id, s.leaf_call_id) for s in want
    ]
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.input_ids, w.input_ids)
        assert np.array_equal(g.log_probs, w.log_probs)
        assert np.array_equal(g.routed_experts_mask, w.routed_experts_mask)
    one, _ = await asyncio.to_thread(api_samples, base, "t0k", ["moe-2"], form)
    assert {s.rollout_id for s in one} == {"moe-2"}
