"""The read API's query parameters: which an endpoint takes, and those that take one value.

Owns two refusals, each a 400 naming the parameter, so that a client never gets data filtered
otherwise than it asked: a parameter the endpoint does not take (``takes``: a misspelt
``min_weight_versoin=5`` would otherwise turn the staleness filter off and answer 200 with
every sample), and a single-valued one given more than once (``one_value``: ``limit=1&limit=2``
is not the first value taken silently; a client that appends to a URL it was handed must not
get a filter it did not mean). Must not: check a value itself (each handler does, naming the
parameter) nor read a repeatable parameter (``weight_version``: ``query.getall``).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

from aiohttp import web

from capture_proxy.proxy.errors import BadRequest

R = TypeVar("R", bound=web.StreamResponse)
Handler = Callable[[web.Request], Awaitable[R]]

#: The weight-version filter's parameters (``rest.weight_query``), on the training reads.
WEIGHT_FILTER_PARAMS = ("min_weight_version", "weight_version", "unknown_weight_version")


def takes(*names: str) -> Callable[[Handler[R]], Handler[R]]:
    """Declare the query parameters a read handler takes. Any other parameter in a request is a
    400 (``unknown_parameter``) naming it and the ones taken, before the handler runs.
    (``token`` is not a read API parameter: the read API's token goes in a header.)"""
    allowed = frozenset(names)
    listed = ", ".join(names) if names else "none"

    def wrap(handler: Handler[R]) -> Handler[R]:
        @functools.wraps(handler)
        async def checked(request: web.Request) -> R:
            for name in request.query:
                if name not in allowed:
                    raise BadRequest(
                        f"{name}: not a parameter of this endpoint (it takes: {listed})",
                        param=name,
                        code="unknown_parameter",
                    )
            return await handler(request)

        return checked

    return wrap


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
