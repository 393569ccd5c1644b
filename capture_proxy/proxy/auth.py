"""Bearer-token checks for the read API and the proxied paths.

Owns who may read captures (``captures_token``) and who may call through the proxy
(``proxy_token``), and which credential goes to the engine: with ``proxy_token`` set the
harness's ``Authorization`` (or Anthropic's ``x-api-key``) is for the proxy and is stripped
before forwarding;
``backend_api_key``, when set, is the engine's. Tokens are compared in constant time and never
logged. ``/health`` stays open (container health checks); ``/metrics`` is guarded by
``captures_token`` like the read API.
"""

from __future__ import annotations

import hmac

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


def _bearer(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or of ``x-api-key: <token>`` (how
    Anthropic clients such as Claude Code send their key)."""
    value = request.headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip() or None


def _check(request: web.Request, expected: SecretStr, what: str) -> None:
    given = _bearer(request)
    if given is None or not hmac.compare_digest(
        given.encode(), expected.get_secret_value().encode()
    ):
        raise Unauthorized(f"missing or invalid bearer token for {what}", code="invalid_api_key")


def auth_middleware(settings: Settings) -> Middleware:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/health":
            return await handler(request)
        if (
            request.path in (READ_API_PREFIX, METRICS_PATH)
            or request.path.startswith(READ_API_PREFIX + "/")
        ):
            if settings.captures_token is not None:
                _check(request, settings.captures_token, "the read API")
            return await handler(request)
        if settings.proxy_token is None and settings.backend_api_key is None:
            return await handler(request)
        if settings.proxy_token is not None:
            _check(request, settings.proxy_token, "the proxy")
        headers = CIMultiDict(request.headers)
        headers.popall("Authorization", None)
        headers.popall("x-api-key", None)
        if settings.backend_api_key is not None:
            headers["Authorization"] = f"Bearer {settings.backend_api_key.get_secret_value()}"
        return await handler(request.clone(headers=headers))

    return auth
