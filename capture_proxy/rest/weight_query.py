"""The weight-version filter's query parameters on the training reads (``GET .../chains``,
``?format=npz`` too, and ``GET /captures/export``): ``min_weight_version``, ``weight_version``
(repeatable) and ``unknown_weight_version`` (``core.weight_filter``). A malformed value is a
400 naming the parameter."""

from __future__ import annotations

from aiohttp import web

from capture_proxy.core.weight_filter import WeightFilter, WeightFilterError
from capture_proxy.proxy.errors import BadRequest


def weight_filter(request: web.Request) -> WeightFilter | None:
    """The filter the request names, None when it names none. Raises BadRequest (400)."""
    query = request.query
    try:
        return WeightFilter.from_query(
            query.get("min_weight_version"),
            query.getall("weight_version", []),
            query.get("unknown_weight_version"),
        )
    except WeightFilterError as exc:
        raise BadRequest(str(exc), param=exc.param, code="invalid_weight_version") from exc
