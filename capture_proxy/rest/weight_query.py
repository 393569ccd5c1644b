"""The weight-version filter's query parameters on the training reads (``GET .../chains``,
``?format=npz`` too, and ``GET /captures/export``): ``min_weight_version``, ``weight_version``
(repeatable) and ``unknown_weight_version`` (``core.weight_filter``). A malformed value, or one
of the other two given twice, is a 400 naming the parameter."""

from __future__ import annotations

from aiohttp import web

from capture_proxy.core.weight_filter import WeightFilter, WeightFilterError
from capture_proxy.proxy.errors import BadRequest
from capture_proxy.rest.query import one_value


def weight_filter(request: web.Request) -> WeightFilter | None:
    """The filter the request names, None when it names none. Raises BadRequest (400)."""
    minimum = one_value(request, "min_weight_version")
    unknown = one_value(request, "unknown_weight_version")
    try:
        return WeightFilter.from_query(minimum, request.query.getall("weight_version", []), unknown)
    except WeightFilterError as exc:
        raise BadRequest(str(exc), param=exc.param, code="invalid_weight_version") from exc
