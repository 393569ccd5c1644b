"""The viewer's pages in a real browser (headless Chromium): they load without console errors
and show the counts, marks and shading of a captured session with a refused link. Each page's
screenshot is saved under the test's tmp dir; with ``CAPTURE_PROXY_VIEWER_DOCS=DIR`` the
rollout page's is also written to ``DIR/viewer-rollout.png`` (scripts/viewer-screenshot)."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest

from capture_proxy.core.view.tokens import shade_bucket
from tests.viewer.browser import chromium_page
from tests.viewer.session import capture_session

pytestmark = pytest.mark.browser


def _keep_for_docs(shot: Path, name: str) -> None:
    docs = os.environ.get("CAPTURE_PROXY_VIEWER_DOCS")
    if docs:
        Path(docs).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, Path(docs) / name)


async def test_pages_show_a_session_with_a_refused_link(make_stack, tmp_path):
    session = await capture_session(make_stack)
    stack = session.stack
    first, refused, superseded, retry = session.refused
    base = str(stack.client.make_url("/captures/ui")).rstrip("/")
    shots = tmp_path / "screenshots"
    async with chromium_page() as (page, console):
        # Rollouts
        await page.goto(base + "/")
        rows = page.locator("#rollouts tbody tr")
        assert await rows.count() == 2
        assert await page.locator("#rollouts tbody tr td:first-child").all_inner_texts() == [
            "linked",
            "refused",
        ]
        row = page.locator('tr[data-rollout="refused"]')
        assert await row.locator('[data-col="calls"]').inner_text() == "4"
        assert await row.locator('[data-col="chains"]').inner_text() == "2"
        assert await row.locator('[data-col="refused"]').inner_text() == "1"
        assert await row.locator('[data-col="reward"]').inner_text() == "–"
        await page.screenshot(path=shots / "rollouts.png", full_page=True)

        # Filter by diagnostic kind: only the rollout with the refused link.
        await page.select_option('select[name="kind"]', "parent_digest_mismatch")
        await page.click("form.filters button")
        await page.wait_for_url("**kind=parent_digest_mismatch**")
        assert await page.locator("#rollouts tbody tr td:first-child").all_inner_texts() == [
            "refused"
        ]

        # A rollout
        await page.click('a[href$="/rollouts/refused"]')
        await page.wait_for_selector("#tree")
        assert await page.inner_text('[data-fact="calls"]') == "4"
        assert await page.inner_text('[data-fact="chains"]') == "2"
        assert (await page.inner_text('[data-fact="refused"]')).split() == [
            "1",
            "retokenized",
            "1",
        ]
        order = await page.locator("#tree tr.call").evaluate_all(
            "rows => rows.map(r => r.dataset.call)"
        )
        # Chain 1: the first call; chain 2: the refused child, then its child's superseded
        # attempt and the retry that superseded it.
        assert order == [first, refused, superseded, retry]
        mark = page.locator(f'tr[data-call="{refused}"] .mark.refused')
        assert await mark.get_attribute("data-class") == "retokenized"
        superseded_row = page.locator(f'tr[data-call="{superseded}"]')
        assert "superseded by #4" in await superseded_row.inner_text()
        assert "retry of #3" in await page.locator(f'tr[data-call="{retry}"]').inner_text()
        await page.screenshot(path=shots / "rollout.png", full_page=True)
        await page.locator("body").screenshot(path=shots / "rollout-body.png")
        _keep_for_docs(shots / "rollout-body.png", "viewer-rollout.png")

        # A call: the refused child, its tokens and the side-by-side view.
        await page.click(f'tr[data-call="{refused}"] td.node a')
        await page.wait_for_selector("#tokens")
        call = await stack.get_json(f"/captures/calls/{refused}")
        assert await page.inner_text('[data-fact="prompt"]') == str(call["num_prompt_tokens"])
        spans = page.locator("#tokens .t")
        seq = call["num_prompt_tokens"] + call["num_generation_tokens"]
        assert await spans.count() == seq
        generated = page.locator("#tokens .r-generation")
        assert await generated.count() == call["num_generation_tokens"]
        classes = await generated.evaluate_all("els => els.map(e => e.className)")
        for cls, lp in zip(classes, call["generation_log_probs"], strict=True):
            bucket = shade_bucket(math.nan if lp is None else lp)
            assert f" b{bucket}" in cls, (cls, lp)
        position = call["diagnostics"][0]["details"]["position"]
        diff = page.locator("#refused-link")
        assert f"first differing position {position}" in await diff.inner_text()
        first_differs = diff.locator('[data-side="1"] .d-differs').first
        assert await first_differs.get_attribute("data-p") == str(position)
        await page.screenshot(path=shots / "call.png", full_page=True)
        await generated.first.hover()
        tip = await page.inner_text("#tip")
        lp = call["generation_log_probs"][0]
        assert tip.splitlines()[:3] == [
            f"position {call['num_prompt_tokens']}",
            f"id {call['generation_token_ids'][0]}",
            f"log prob {lp:.4f}  (p {math.exp(float(f'{lp:.4f}')):.3f})",
        ]
        assert console.errors == []
