"""The viewer's rollout list reads the counts the store keeps per rollout (issue 22): the same
page as when it loaded every rollout's calls, its filters included, loading only the rollouts
whose counts are not kept (no kept number of chains, or late calls)."""

from __future__ import annotations

import random

from capture_proxy.proxy.keys import STORE_KEY
from capture_proxy.viewer import pages
from tests.proxy.conftest import ON_BOTH_STORES, Stack
from tests.store.test_chain_counts import _diagnosed, _session, call

QUERIES = ["", "?status=incomplete", "?status=failed", "?status=complete", "?kind=retry"]


@ON_BOTH_STORES
async def test_the_rollout_list_is_the_page_built_from_every_call(make_stack, monkeypatch):
    stack: Stack = await make_stack()
    store = stack.client.app[STORE_KEY]
    rng = random.Random(3)
    for i in range(12):
        for c in _diagnosed(rng, _session(rng, f"v{i:02d}", rng.randint(1, 12))):
            await store.put_call(c)
    await store.freeze_rollout("v00")
    await store.put_call(call("late", 99, rollout_id="v00"))
    loaded: list[str] = []
    original = store.get_rollout_calls

    async def counting(rollout_id: str):  # type: ignore[no-untyped-def]
        loaded.append(rollout_id)
        return await original(rollout_id)

    monkeypatch.setattr(store, "get_rollout_calls", counting)

    async def page(query: str) -> str:
        resp = await stack.client.get("/captures/ui/" + query)
        assert resp.status == 200
        return await resp.text()

    kept = {q: await page(q) for q in QUERIES}
    infos = await store.list_rollouts()
    needs = sorted(i.rollout_id for i in infos if pages._needs_calls(i))
    assert sorted(set(loaded)) == needs
    assert "v00" in needs and len(needs) < len(infos)  # the frozen one with its late call
    monkeypatch.setattr(pages, "_needs_calls", lambda info: True)
    assert {q: await page(q) for q in QUERIES} == kept
    assert "v11" in kept[""] and "late" not in needs
