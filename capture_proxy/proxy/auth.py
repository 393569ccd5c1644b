"""Bearer-token checks for the read API and the proxied paths.

Owns who may read captures (``captures_token``) and who may call through the proxy
(``proxy_token``), and which credential goes to the engine: with ``proxy_token`` set the
harness's ``Authorization: Bearer`` or Anthropic's ``x-api-key`` (either may carry the token)
is for the proxy, and both are stripped before forwarding;
``backend_api_key`` (or the backend URL's user info, as Basic auth), when set, is the
engine's and replaces the harness's. Tokens are compared in constant time and never
logged. ``/health`` stays open (container health checks); ``/metrics`` is guarded by
``captures_token`` like the read API.

The viewer's pages (``/captures/ui/``) are opened by a browser, which cannot send a bearer
header: a ``GET`` there also passes with the viewer cookie (HttpOnly, SameSite=Strict, path
``/captures/ui``; its value is an HMAC of ``captures_token``, not the token itself), set by the
login form (``/captures/ui/login``) or by opening a page with ``?token=<captures_token>``
(answered with a redirect to the same page without the token). Without either, a page
redirects to the login form. The cookie opens only the pages, never the JSON read API (no
cross-site request can use it to delete a rollout).
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import quote

from aiohttp import web
from aiohttp.typedefs import Middleware
from multidict import CIMultiDict
from pydantic import SecretStr

from capture_proxy.config import Settings
from capture_proxy.proxy.errors import Handler, Unauthorized

READ_API_PREFIX = "/captures"
#: Behind ``captures_token`` too: Prometheus scrapers send bearer tokens
#: (``authorization: {credentials: ...}``), and the counts tell who runs what.
METRICS_PATH = "/metrics"
UI_PREFIX = "/captures/ui"
#: Open without a token: the login form and the static files (CSS, JS) it needs.
UI_OPEN_PATHS = (UI_PREFIX + "/login", UI_PREFIX + "/static/")
VIEWER_COOKIE = "capture_viewer"


def viewer_cookie_value(token: SecretStr) -> str:
    """The viewer cookie's value for ``token``: an HMAC, so the cookie is not a bearer token."""
    key = token.get_secret_value().encode()
    return hmac.new(key, b"capture-proxy viewer session", hashlib.sha256).hexdigest()


def token_matches(given: str | None, expected: SecretStr) -> bool:
    return given is not None and hmac.compare_digest(
        given.encode(), expected.get_secret_value().encode()
    )


def set_viewer_cookie(response: web.StreamResponse, token: SecretStr) -> None:
    response.set_cookie(
        VIEWER_COOKIE,
        viewer_cookie_value(token),
        path=UI_PREFIX,
        httponly=True,
        samesite="Strict",
    )


def see_other(location: str) -> web.Response:
    """A 303 redirect to ``location`` (a path on this server)."""
    return web.Response(status=303, headers={"Location": location})


def _viewer_page(request: web.Request, expected: SecretStr) -> web.StreamResponse | None:
    """None when the page may be served; else the redirect to serve instead."""
    if carries_token(request, expected):
        return None
    cookie = request.cookies.get(VIEWER_COOKIE)
    if cookie is not None and hmac.compare_digest(
        cookie.encode(), viewer_cookie_value(expected).encode()
    ):
        return None
    if "token" in request.query and token_matches(request.query["token"], expected):
        query = {k: v for k, v in request.query.items() if k != "token"}
        response = see_other(str(request.rel_url.with_query(query)))
        set_viewer_cookie(response, expected)
        return response
    target = quote(
        str(request.rel_url.with_query({k: v for k, v in request.query.items() if k != "token"})),
        safe="",
    )
    failed = "&failed=1" if "token" in request.query else ""
    return see_other(f"{UI_PREFIX}/login?next={target}{failed}")


def _bearer(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or None."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def _api_key(request: web.Request) -> str | None:
    """The token of ``x-api-key: <token>`` (how Anthropic clients send their key), or None."""
    return request.headers.get("x-api-key", "").strip() or None


def carries_token(request: web.Request, expected: SecretStr) -> bool:
    """Whether ``Authorization: Bearer`` or ``x-api-key`` carries ``expected``. Either may:
    Claude Code sends both when ``ANTHROPIC_AUTH_TOKEN`` and ``ANTHROPIC_API_KEY`` are set,
    one of them for the proxy (both are stripped before the engine)."""
    return token_matches(_bearer(request), expected) or token_matches(_api_key(request), expected)


def _check(request: web.Request, expected: SecretStr, what: str) -> None:
    if carries_token(request, expected):
        return
    # Which headers were looked at and which were sent (their names, never their values).
    sent = [name for name in ("Authorization", "x-api-key") if name in request.headers]
    if not sent:
        message = (
            f"no token for {what}: send it as Authorization: Bearer <token> or x-api-key: "
            "<token>"
        )
    else:
        message = (
            f"invalid token for {what}: checked Authorization: Bearer and x-api-key, and "
            f"the {' and '.join(sent)} header{'s' if len(sent) > 1 else ''} sent "
            f"{'do' if len(sent) > 1 else 'does'} not carry it"
        )
    raise Unauthorized(message, code="invalid_api_key")


def auth_middleware(settings: Settings) -> Middleware:
    engine_auth = settings.backend_auth_header  # the settings are frozen: once

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/health":
            return await handler(request)
        path = request.path
        if path == UI_PREFIX or path.startswith(UI_PREFIX + "/"):
            if settings.captures_token is not None and not path.startswith(UI_OPEN_PATHS):
                if request.method not in ("GET", "HEAD"):
                    _check(request, settings.captures_token, "the viewer")
                else:
                    redirect = _viewer_page(request, settings.captures_token)
                    if redirect is not None:
                        return redirect
            return await handler(request)
        if path in (READ_API_PREFIX, METRICS_PATH) or path.startswith(READ_API_PREFIX + "/"):
            if settings.captures_token is not None:
                _check(request, settings.captures_token, "the read API")
            return await handler(request)
        if settings.proxy_token is None and engine_auth is None:
            return await handler(request)
        if settings.proxy_token is not None:
            _check(request, settings.proxy_token, "the proxy")
        headers = CIMultiDict(request.headers)
        headers.popall("Authorization", None)
        headers.popall("x-api-key", None)
        if engine_auth is not None:
            headers["Authorization"] = engine_auth
        return await handler(request.clone(headers=headers))

    return auth
