"""Rollout metadata attached by the trainer: reward, task id, free tags. Pure.

Owns the accepted shapes and their validation (``PUT /captures/rollouts/<id>/metadata``):

- ``reward``: a finite number, or an object of named finite numbers (``{"pass": 1.0,
  "style": 0.25}``), or null / absent (no reward yet);
- ``task_id``: a string of 1-256 characters, or null / absent;
- ``tags``: an object of free string keys (1-128 characters) to string values (at most 4,096
  characters), at most 64 entries; absent means ``{}``.

Unknown fields are refused, so a typo (``rewards``) is a 400 naming it, never silently dropped.
``MetadataError.field`` names the offending field (dotted for nested ones: ``reward.pass``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_TASK_ID_LENGTH = 256
MAX_TAGS = 64
MAX_TAG_KEY_LENGTH = 128
MAX_TAG_VALUE_LENGTH = 4096
MAX_NAMED_REWARDS = 64

Reward = float | dict[str, float] | None


class MetadataError(ValueError):
    """A metadata body breaks the rules above; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MetadataError(name, f"must be a number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise MetadataError(name, "must be finite")
    return out


@dataclass(frozen=True)
class RolloutMetadata:
    """What the trainer attached to a rollout. ``reward``: one number, named numbers, or None."""

    reward: Reward = None
    task_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def scalar_reward(self) -> float | None:
        """The reward when it is one number, else None."""
        return self.reward if isinstance(self.reward, float) else None

    @property
    def named_rewards(self) -> dict[str, float] | None:
        """The reward when it is an object of named numbers, else None."""
        return self.reward if isinstance(self.reward, dict) else None

    def to_json(self) -> dict[str, Any]:
        return {"reward": self.reward, "task_id": self.task_id, "tags": dict(self.tags)}

    @classmethod
    def from_json(cls, body: Any) -> RolloutMetadata:
        """Validate a metadata body. Raises MetadataError naming the field."""
        if not isinstance(body, dict):
            raise MetadataError("body", "must be a JSON object with reward, task_id, tags")
        unknown = sorted(set(body) - {"reward", "task_id", "tags"})
        if unknown:
            raise MetadataError(unknown[0], "unknown field (expected reward, task_id, tags)")
        return cls(
            reward=_reward(body.get("reward")),
            task_id=_task_id(body.get("task_id")),
            tags=_tags(body.get("tags")),
        )


def _reward(value: Any) -> Reward:
    if value is None:
        return None
    if isinstance(value, dict):
        if not value:
            raise MetadataError("reward", "an object of named rewards must not be empty")
        if len(value) > MAX_NAMED_REWARDS:
            raise MetadataError("reward", f"at most {MAX_NAMED_REWARDS} named rewards")
        out = {}
        for name in sorted(value):
            if not isinstance(name, str) or not name:
                raise MetadataError("reward", "reward names must be non-empty strings")
            out[name] = _number(value[name], f"reward.{name}")
        return out
    return _number(value, "reward")


def _task_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_TASK_ID_LENGTH:
        raise MetadataError("task_id", f"must be a string of 1-{MAX_TASK_ID_LENGTH} characters")
    return value


def _tags(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MetadataError("tags", "must be an object of string keys to string values")
    if len(value) > MAX_TAGS:
        raise MetadataError("tags", f"at most {MAX_TAGS} tags")
    out = {}
    for key in sorted(value):
        if not 1 <= len(key) <= MAX_TAG_KEY_LENGTH:
            raise MetadataError("tags", f"tag keys must have 1-{MAX_TAG_KEY_LENGTH} characters")
        tag = value[key]
        if not isinstance(tag, str) or len(tag) > MAX_TAG_VALUE_LENGTH:
            raise MetadataError(
                f"tags.{key}", f"must be a string of at most {MAX_TAG_VALUE_LENGTH} characters"
            )
        out[key] = tag
    return out
