"""The read API's query parameters that take one value.

Owns reading such a parameter: given more than once (``limit=1&limit=2``) it is a 400 naming
it, never the first value taken silently (a client that appends to a URL it was handed must
not get a filter it did not mean). Must not: check the value itself (each handler does, naming
the parameter) nor read a repeatable parameter (``weight_version``: ``query.getall``).
"""

from __future__ import annotations

from typing import overload

from aiohttp import web

from capture_proxy.proxy.errors import BadRequest


@overload
def one_value(request: web.Request, name: str, default: str) -> str: ...


@overload
def one_value(request: web.Request, name: str, default: None = None) -> str | None: ...


def one_value(request: web.Request, name: str, default: str | None = None) -> str | None:
    """The value of the query parameter ``name``, ``default`` when absent. Raises BadRequest
    (400, ``repeated_parameter``) when it is given more than once."""
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise BadRequest(
            f"{name}: given {len(values)} times; it takes one value",
            param=name,
            code="repeated_parameter",
        )
    return values[0] if values else default
