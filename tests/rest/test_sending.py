"""The read API's send timeout (``rest.sending``): which requests it bounds, and a whole answer
sent as the handler made it (status, headers, cookies, body). The cut itself is tested end to
end, against a client that stops reading (``tests/proxy/test_read_send_timeout.py``)."""

from __future__ import annotations

import pytest
from aiohttp import web

from capture_proxy.proxy.errors import error_middleware
from capture_proxy.rest.sending import SEND_TIMEOUT_KEY, SLICE_BYTES, read_send_middleware

#: A body of several slices, not a multiple of one.
BODY = bytes(range(256)) * (3 * SLICE_BYTES // 256) + b"tail"


@pytest.mark.parametrize("timeout_s", [0, -1.0])
def test_a_send_timeout_must_be_positive(timeout_s: float):
    with pytest.raises(ValueError, match="timeout_s: expected > 0"):
        read_send_middleware(timeout_s)


def _app() -> tuple[web.Application, dict[str, object]]:
    app = web.Application(middlewares=[error_middleware, read_send_middleware(5.0)])
    seen: dict[str, object] = {}

    async def whole(request: web.Request) -> web.Response:
        seen[request.path] = request.get(SEND_TIMEOUT_KEY)
        resp = web.Response(
            body=BODY,
            status=203,
            reason="Kept",
            content_type="application/zip",
            headers={"Content-Disposition": 'attachment; filename="r1.zip"'},
        )
        resp.set_cookie("viewer", "v", httponly=True, samesite="Strict")
        return resp

    app.router.add_get("/captures/whole", whole)
    app.router.add_post("/captures/whole", whole)
    app.router.add_get("/ng-rollout/r1/whole", whole)
    return app, seen


async def test_a_whole_answer_is_sent_as_the_handler_made_it(aiohttp_client):
    app, seen = _app()
    client = await aiohttp_client(app)
    resp = await client.get("/captures/whole")
    assert (resp.status, resp.reason) == (203, "Kept")
    assert resp.headers["Content-Type"] == "application/zip"
    assert resp.headers["Content-Disposition"] == 'attachment; filename="r1.zip"'
    assert resp.headers["Content-Length"] == str(len(BODY))
    assert "Transfer-Encoding" not in resp.headers
    assert resp.cookies["viewer"].value == "v"
    assert resp.cookies["viewer"]["samesite"] == "Strict"
    assert await resp.read() == BODY
    assert seen["/captures/whole"] == 5.0
    head = await client.head("/captures/whole")
    assert (head.status, head.headers["Content-Length"]) == (203, str(len(BODY)))
    assert await head.read() == b""


async def test_only_reads_under_captures_are_bounded(aiohttp_client):
    app, seen = _app()
    client = await aiohttp_client(app)
    for method, path in (("POST", "/captures/whole"), ("GET", "/ng-rollout/r1/whole")):
        resp = await client.request(method, path)
        assert (resp.status, await resp.read()) == (203, BODY)
        assert seen.pop(path) is None, path  # no send timeout: not a read of the read API
