"""Episode ids (attempt suffix) and the metadata rules."""

from __future__ import annotations

import pytest

from capture_proxy.core.episodes import Episode, final_episodes, is_final, parse_episode
from capture_proxy.core.metadata import MetadataError, RolloutMetadata


def test_attempt_suffixes():
    assert parse_episode("t7") == Episode("t7", 0, "t7")
    assert parse_episode("t7-a12") == Episode("t7", 12, "t7-a12")
    assert parse_episode("t7-a0") == Episode("t7", 0, "t7-a0")
    assert parse_episode("t7-a01") == Episode("t7-a01", 0, "t7-a01")  # not a suffix
    assert parse_episode("-a1").base == "-a1"
    assert final_episodes(["t7", "t7-a2", "t7-a10", "u-a1"]) == {"t7": "t7-a10", "u": "u-a1"}
    assert final_episodes(["t7", "t7-a0"]) == {"t7": "t7-a0"}
    assert is_final("t7-a2", ["t7", "t7-a1", "x-a9"]) and not is_final("t7", ["t7-a1"])


def test_metadata_shapes():
    meta = RolloutMetadata.from_json({"reward": {"b": 1, "a": 0.5}, "task_id": "t", "tags": {}})
    assert meta.named_rewards == {"a": 0.5, "b": 1.0} and meta.scalar_reward is None
    assert RolloutMetadata.from_json({"reward": 2}).scalar_reward == 2.0
    assert RolloutMetadata.from_json({}) == RolloutMetadata()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"reward": float("nan")}, "reward"),
        ({"reward": {"x": "1"}}, "reward.x"),
        ({"task_id": ""}, "task_id"),
        ({"tags": {"k": ["v"]}}, "tags.k"),
        ({"tags": {"": "v"}}, "tags"),
        ({"extra": 1}, "extra"),
        ("reward", "body"),
    ],
)
def test_bad_metadata_names_the_field(body, field):
    with pytest.raises(MetadataError) as err:
        RolloutMetadata.from_json(body)
    assert err.value.field == field
