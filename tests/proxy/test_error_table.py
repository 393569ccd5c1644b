"""The one table of core errors -> client errors (``proxy.errors.CORE_ERRORS``): each core
exception becomes its status, error type, code and param; the stored call goes with it."""

from __future__ import annotations

import pytest

from capture_proxy.core.flow.errors import (
    EngineAnswerUnusable,
    EngineTimedOut,
    EngineUnreachable,
    PrefillNotSupported,
    UnknownPreviousResponse,
    engine_unreachable,
)
from capture_proxy.core.fronts.base import InvalidFrontRequest
from capture_proxy.core.json_bodies import InvalidRequest
from capture_proxy.core.sampling import SamplingError
from capture_proxy.families.base import RenderError, RendererUnavailable
from capture_proxy.proxy.errors import BadRequest, client_error, map_core_errors


@pytest.mark.parametrize(
    ("exc", "status", "error_type", "code", "param"),
    [
        (
            InvalidRequest("bad", "messages.0"),
            400,
            "invalid_request_error",
            "invalid_request",
            "messages.0",
        ),
        (
            InvalidFrontRequest("bad", "input"),
            400,
            "invalid_request_error",
            "invalid_request",
            "input",
        ),
        (SamplingError("bad", "stop"), 400, "invalid_request_error", "invalid_request", "stop"),
        (PrefillNotSupported(), 400, "invalid_request_error", "prefill_not_supported", "messages"),
        (
            UnknownPreviousResponse("resp_x"),
            400,
            "invalid_request_error",
            "previous_response_not_found",
            "previous_response_id",
        ),
        (RendererUnavailable("down"), 502, "upstream_error", "engine_unreachable", None),
        (RenderError("no"), 400, "invalid_request_error", "render_failed", "messages"),
        (
            EngineTimedOut("slow", code="engine_timeout"),
            504,
            "upstream_error",
            "engine_timeout",
            None,
        ),
        (
            EngineUnreachable("gone", code="engine_error"),
            502,
            "upstream_error",
            "engine_error",
            None,
        ),
        (EngineAnswerUnusable("junk"), 502, "upstream_error", "engine_bad_response", None),
    ],
)
def test_each_core_error_has_one_client_error(exc, status, error_type, code, param):
    err = client_error(exc)
    assert (err.status, err.error_type, err.code, err.param) == (status, error_type, code, param)
    assert err.message == str(exc)


def test_the_stored_call_goes_with_the_client_error():
    err = client_error(engine_unreachable("slow", "engine_timeout", True, "call-1"))
    assert (err.status, err.call_id) == (504, "call-1")


def test_map_core_errors_raises_the_client_error_and_lets_the_rest_through():
    with pytest.raises(BadRequest) as raised, map_core_errors():
        raise RenderError("no template")
    assert isinstance(raised.value.__cause__, RenderError)
    with pytest.raises(KeyError), map_core_errors():
        raise KeyError("not a core error")
