"""Uncaptured forwarding: plain pass-through and rollout correlation.

Owns byte-for-byte relaying of any request the proxy does not capture (``/v1/models``,
``/tokenize``, paths outside ``/ng-rollout/``, and correlation-only rollout paths). The body
of the answer is streamed through as it arrives, still encoded as the engine sent it.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from capture_proxy.core.routing import Route
from capture_proxy.proxy.traffic_tap import TAP_KEY
from capture_proxy.proxy.upstream import (
    CLIENT_ERRORS,
    forwardable_headers,
    send_upstream,
    translate_client_error,
)


async def forward_uncaptured(
    request: web.Request,
    route: Route,
    raw_body: bytes,
    session: aiohttp.ClientSession,
    backend: str,
    *,
    first_byte_timeout_s: float | None = None,
    connect_retries: int = 0,
) -> web.StreamResponse:
    """Relay one request to ``backend + route.upstream_path`` (query string kept)."""
    headers = forwardable_headers(request.headers)
    if route.rollout_id is not None:
        headers["X-NG-Rollout-Id"] = route.rollout_id
    url = backend + route.upstream_path
    if request.query_string:
        url += "?" + request.query_string
    try:
        upstream = await send_upstream(
            session,
            request.method,
            url,
            first_byte_timeout_s=first_byte_timeout_s,
            connect_retries=connect_retries,
            headers=headers,
            data=raw_body if raw_body else None,
        )
    except CLIENT_ERRORS as exc:
        raise translate_client_error(exc, backend) from exc
    async with upstream:
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=forwardable_headers(upstream.headers.items()),
        )
        await response.prepare(request)
        tap = request.get(TAP_KEY)  # set when the traffic is being recorded
        try:
            async for data in upstream.content.iter_any():
                if tap is not None:
                    tap.add(data)
                await response.write(data)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            return response  # the client left; closing the upstream response cancels it
        except CLIENT_ERRORS:
            # Headers are sent: the harness sees a truncated body, which is what happened.
            return response
        await response.write_eof()
        return response
