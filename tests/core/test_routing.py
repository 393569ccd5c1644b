import pytest

from capture_proxy.core.routing import InvalidRolloutId, Route, RouteKind, route


def test_capture_path_is_stripped():
    assert route("/ng-rollout/r-1.a_2/training-token-capture/v1/chat/completions") == Route(
        RouteKind.CAPTURE, "/v1/chat/completions", "r-1.a_2"
    )


def test_correlation_path_is_stripped():
    assert route("/ng-rollout/r1/v1/models") == Route(RouteKind.CORRELATE, "/v1/models", "r1")


def test_other_paths_pass_through_unchanged():
    assert route("/v1/chat/completions") == Route(RouteKind.PASSTHROUGH, "/v1/chat/completions")
    assert route("/tokenize") == Route(RouteKind.PASSTHROUGH, "/tokenize")


def test_attempt_suffix_is_a_valid_id():
    assert route("/ng-rollout/task7-a2/training-token-capture/v1/x").rollout_id == "task7-a2"


@pytest.mark.parametrize(
    "path",
    [
        "/ng-rollout//training-token-capture/v1/chat/completions",
        "/ng-rollout/../training-token-capture/v1/chat/completions",
        "/ng-rollout/.hidden/v1/models",
        "/ng-rollout/a%2Fb/training-token-capture/v1/chat/completions",
        "/ng-rollout/%2E%2E/v1/models",
        "/ng-rollout/r\u00e9/v1/models",
        "/ng-rollout/r%C3%A9/v1/models",
        "/ng-rollout/" + "a" * 257 + "/v1/models",
        "/ng-rollout/-leading-dash/v1/models",
    ],
)
def test_bad_rollout_ids_are_refused(path):
    with pytest.raises(InvalidRolloutId):
        route(path)
