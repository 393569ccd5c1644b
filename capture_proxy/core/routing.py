"""Path routing: which requests are captured, correlated or passed through.

Owns the URL contract of the proxy (DESIGN.md, "The flow of one call", step 1):
- ``/ng-rollout/<rollout_id>/training-token-capture/<rest>``: captured; forwarded as ``/<rest>``.
- ``/ng-rollout/<rollout_id>/<rest>``: correlation only (no tokens); forwarded as ``/<rest>``.
- anything else: forwarded unchanged, not captured.

Rollout ids are validated here and nowhere else, so no unvalidated id reaches the store, a log
line or a file name.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

ROLLOUT_PREFIX = "/ng-rollout/"
CAPTURE_SEGMENT = "training-token-capture"
MAX_ROLLOUT_ID_LENGTH = 256

# Letters, digits, '.', '_', '-'; the first character a letter or digit (so no '.', '..').
_ROLLOUT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class RouteKind(enum.StrEnum):
    CAPTURE = "capture"
    CORRELATE = "correlate"
    PASSTHROUGH = "passthrough"


class InvalidRolloutId(ValueError):
    """The rollout id in the path breaks the id rules; the client gets a 400."""


@dataclass(frozen=True)
class Route:
    """Where a request goes: ``upstream_path`` is the path sent to the engine."""

    kind: RouteKind
    upstream_path: str
    rollout_id: str | None = None


def validate_rollout_id(rollout_id: str) -> str:
    """Return ``rollout_id`` if valid, else raise InvalidRolloutId with the reason.

    Valid: 1..256 ASCII letters, digits, ``.``, ``_``, ``-``, starting with a letter or digit.
    """
    if not rollout_id:
        raise InvalidRolloutId("rollout id is empty")
    if len(rollout_id) > MAX_ROLLOUT_ID_LENGTH:
        raise InvalidRolloutId(f"rollout id is longer than {MAX_ROLLOUT_ID_LENGTH} characters")
    if not _ROLLOUT_ID_RE.fullmatch(rollout_id):
        raise InvalidRolloutId(
            "rollout id must use only ASCII letters, digits, '.', '_', '-' and start with a "
            "letter or digit"
        )
    return rollout_id


def route(raw_path: str) -> Route:
    """Route a request by its raw (still percent-encoded) path.

    The raw path is used so that an encoded ``%2F`` or ``%2E%2E`` inside a rollout id is
    refused rather than decoded into a path trick. Raises InvalidRolloutId.
    """
    if not raw_path.startswith(ROLLOUT_PREFIX):
        return Route(RouteKind.PASSTHROUGH, raw_path)
    rest = raw_path[len(ROLLOUT_PREFIX) :]
    rollout_id, slash, tail = rest.partition("/")
    validate_rollout_id(rollout_id)
    segment, slash2, after = tail.partition("/")
    if slash and segment == CAPTURE_SEGMENT:
        return Route(RouteKind.CAPTURE, "/" + after if slash2 else "/", rollout_id)
    return Route(RouteKind.CORRELATE, "/" + tail if slash else "/", rollout_id)


#: The capture path's form, for the messages that name it.
CAPTURE_PATH_FORM = f"{ROLLOUT_PREFIX}<rollout_id>/{CAPTURE_SEGMENT}/v1/..."


def api_path_of(raw_path: str) -> str | None:
    """The engine path a capture-path request names, without validating its rollout id (for
    the error shape of a request whose id is refused: an Anthropic client on
    ``/ng-rollout/bad!id/training-token-capture/v1/messages`` reads Anthropic's shape); None
    for any other path."""
    if not raw_path.startswith(ROLLOUT_PREFIX):
        return None
    _, slash, tail = raw_path[len(ROLLOUT_PREFIX) :].partition("/")
    segment, slash2, after = tail.partition("/")
    if not slash or segment != CAPTURE_SEGMENT:
        return None
    return "/" + after if slash2 else "/"
