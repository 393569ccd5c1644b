"""The viewer over HTTP (no browser): auth for browsers, read-only serving, the terminal view."""

from __future__ import annotations

import hashlib
import hmac
import re

from rich.console import Console

from capture_proxy.app import build_read_only_app
from capture_proxy.cli.show import show
from capture_proxy.config import Settings
from capture_proxy.proxy.auth import VIEWER_COOKIE
from capture_proxy.proxy.keys import STORE_KEY
from capture_proxy.store.sqlite import SQLiteStore
from capture_proxy.viewer.detokenize import LocalDetokenizer
from capture_proxy.viewer.pages import VIEWER_KEY
from tests.core.test_weight_versions import weighted_calls
from tests.viewer.session import capture_session

TOKEN = "s3cret-viewer"
COOKIE = hmac.new(TOKEN.encode(), b"capture-proxy viewer session", hashlib.sha256).hexdigest()


async def test_pages_need_the_captures_token(make_stack):
    session = await capture_session(make_stack, captures_token=TOKEN)
    client = session.stack.client
    resp = await client.get("/captures/ui/rollouts/refused", allow_redirects=False)
    assert resp.status == 303
    assert (
        resp.headers["Location"] == "/captures/ui/login?next=%2Fcaptures%2Fui%2Frollouts%2Frefused"
    )
    # Static files and the login form are open; the JSON API still wants the bearer header.
    assert (await client.get("/captures/ui/static/viewer.css")).status == 200
    assert (await client.get("/captures/ui/login")).status == 200
    assert (await client.get("/captures/rollouts")).status == 401

    wrong = await client.get("/captures/ui/?token=nope", allow_redirects=False)
    assert wrong.status == 303 and wrong.headers["Location"].endswith("&failed=1")
    assert VIEWER_COOKIE not in wrong.cookies

    right = await client.get(
        "/captures/ui/?token=" + TOKEN + "&status=complete", allow_redirects=False
    )
    assert right.status == 303
    assert right.headers["Location"] == "/captures/ui/?status=complete"  # token not kept
    morsel = right.cookies[VIEWER_COOKIE]
    assert morsel.value == COOKIE
    assert morsel["httponly"] is True and morsel["samesite"] == "Strict"
    assert morsel["path"] == "/captures/ui"
    page = await client.get("/captures/ui/rollouts/refused", cookies={VIEWER_COOKIE: COOKIE})
    assert page.status == 200 and "refused: retokenized" in await page.text()
    # The cookie opens the pages only, never the JSON API.
    api = await client.get("/captures/rollouts", cookies={VIEWER_COOKIE: COOKIE})
    assert api.status == 401
    client.session.cookie_jar.clear()
    bearer = await client.get("/captures/ui/", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bearer.status == 200


async def test_login_form_sets_the_cookie_and_refuses_open_redirects(make_stack):
    session = await capture_session(make_stack, captures_token=TOKEN)
    client = session.stack.client
    bad = await client.post(
        "/captures/ui/login",
        data={"token": "nope", "next": "/captures/ui/"},
        allow_redirects=False,
    )
    assert bad.status == 401 and "That token is not valid." in await bad.text()
    good = await client.post(
        "/captures/ui/login",
        data={"token": TOKEN, "next": "//evil.example/"},
        allow_redirects=False,
    )
    assert good.status == 303 and good.headers["Location"] == "/captures/ui/"
    assert good.cookies[VIEWER_COOKIE].value == COOKIE


async def test_unknown_pages_are_html_404s(make_stack):
    session = await capture_session(make_stack)
    client = session.stack.client
    resp = await client.get("/captures/ui/calls/call-nope")
    assert resp.status == 404 and resp.content_type == "text/html"
    assert "call call-nope not found" in await resp.text()
    resp = await client.get("/captures/ui/?status=bogus")
    assert resp.status == 400 and "unknown status &#39;bogus&#39;" in await resp.text()


async def test_read_only_app_browses_a_store_without_an_engine(make_stack, aiohttp_client):
    session = await capture_session(make_stack)
    await session.stack.client.close()  # the proxy is gone; its store stays
    settings = Settings(backend="http://no-backend.invalid", store=session.stack.store_dir)
    client = await aiohttp_client(
        build_read_only_app(settings, SQLiteStore(session.stack.store_dir))
    )
    listing = await client.get("/captures/ui/")
    text = await listing.text()
    assert listing.status == 200 and "read-only store" in text
    assert 'data-rollout="refused"' in text and 'data-rollout="linked"' in text
    call = await client.get(f"/captures/ui/calls/{session.refused[1]}")
    body = await call.text()
    assert call.status == 200 and "text: token ids (no tokenizer, no engine)" in body
    assert (await client.get("/captures/rollouts/refused")).status == 200
    deleted = await client.delete("/captures/rollouts/refused")
    assert deleted.status == 405 and "DELETE" not in deleted.headers["Allow"]  # read-only
    refused = await client.post("/ng-rollout/r/v1/chat/completions", json={})
    assert refused.status == 403  # a rollout path on a read-only server says it is read-only
    assert (await refused.json())["error"]["code"] == "read_only"


async def test_a_local_tokenizer_gives_the_tokens_text_loaded_on_the_first_page(
    make_stack, aiohttp_client, qwen_tokenizer_dir, tmp_path, caplog
):
    """The ``tokenizer`` setting: the viewer loads it when a page first asks for token text
    (not at start-up), and shows each token's text; one that cannot be loaded leaves ids."""
    session = await capture_session(make_stack)
    await session.stack.client.close()
    store_dir = session.stack.store_dir

    async def call_page(tokenizer_dir):
        settings = Settings(backend="http://no.invalid", store=store_dir, tokenizer=tokenizer_dir)
        app = build_read_only_app(settings, SQLiteStore(store_dir))
        client = await aiohttp_client(app)
        detokenizer = app[VIEWER_KEY].detokenizer
        assert isinstance(detokenizer, LocalDetokenizer)
        assert detokenizer._tokenizer is None  # not at start-up
        resp = await client.get(f"/captures/ui/calls/{session.linked[0]}")
        assert resp.status == 200
        text = await resp.text()
        await client.close()
        return text

    body = await call_page(qwen_tokenizer_dir)
    assert "text: local tokenizer" in body
    assert re.search(r'data-p="0" data-i="151644"[^>]*>&lt;\|im_start\|&gt;</span>', body)
    empty = tmp_path / "empty"
    empty.mkdir()
    body = await call_page(empty)
    assert "text: token ids (no tokenizer, no engine)" in body
    assert "viewer: cannot load the tokenizer at" in caplog.text


async def test_show_prints_the_listing_and_a_tree(make_stack):
    session = await capture_session(make_stack)
    await session.stack.client.close()
    console = Console(record=True, width=200, color_system=None)
    assert await show(session.stack.store_dir, None, console) == 0
    listing = console.export_text()
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in listing.splitlines()]
    assert [c[:7] for c in cells if c and c[0] in ("linked", "refused")] == [
        ["linked", "complete", "3", "1", "", "no", "–"],
        ["refused", "failed", "4", "2", "1", "no", "–"],
    ]
    console = Console(record=True, width=200, color_system=None)
    assert await show(session.stack.store_dir, "refused", console) == 0
    text = console.export_text()
    assert "calls 4 · chains 2 · branches 0 · resolved 1 · refused 1 (retokenized 1)" in text
    assert "refused: retokenized from #1 at 147" in text
    assert "superseded by #4" in text and "retry of #3" in text
    assert await show(session.stack.store_dir, "nope", Console(record=True)) == 1


async def test_call_and_rollout_pages_show_weight_versions(make_stack):
    stack = await make_stack()
    store = stack.client.app[STORE_KEY]
    for r in weighted_calls():
        await store.put_call(r)
    page = await stack.client.get("/captures/ui/calls/b")
    html = await page.text()
    assert page.status == 200
    fact = re.search(r'data-fact="weight-versions">(.*?)</dd>', html, re.S).group(1)
    assert re.findall(r'data-version="([^"]+)"', fact) == ["4"]  # b's own span
    assert "2 tokens" in fact and ">engine_reported<" in fact
    # Every token b's path generated is labelled with its version: a's then b's.
    labelled = re.findall(
        r'data-p="(\d+)" data-i="\d+"(?: data-lp="[^"]+")? data-wv="([^"]+)"', html
    )
    assert labelled == [("2", "default"), ("3", "3"), ("4", "3"), ("6", "4"), ("7", "4")]
    assert 'class="t wv0" data-version="default">default: 1<' in html  # the legend
    unknown = await (await stack.client.get("/captures/ui/calls/c")).text()
    fact = re.search(r'data-fact="weight-versions">(.*?)</dd>', unknown, re.S).group(1)
    assert "unknown" in fact and "no source" in fact
    rollout = await (await stack.client.get("/captures/ui/rollouts/r1")).text()
    fact = re.search(r'data-fact="weight-versions">(.*?)</dd>', rollout, re.S).group(1)
    assert re.findall(r'data-version="([^"]+)"', fact) == ["default", "v7", "3", "4", "10"]
