"""The harness session a call's request names, and how it ranks the calls an edge could come
from (see ``capture_proxy.core.lineage``).

A harness that runs several sessions in one rollout (parallel samples of one task) sends them
the same texts: two sessions' main agents hand out the same sub-agent prompt, two twin
sessions replay the same history. Text alone cannot tell whose call a root continues; the
session a request names can (``harness_notes.lineage.SessionField``: Claude Code's
``metadata.user_id`` ``session_id``, Codex's ``prompt_cache_key``). Read from the body as the
harness sent it (``CallRecord.request_received``); a call whose harness names none, or a
record from before the body was kept, names none. Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from harness_notes.lineage import SessionField


@dataclass(frozen=True)
class Session:
    """A harness session: the declaration that read it, and its id."""

    field: SessionField
    session_id: str

    @property
    def key(self) -> tuple[str, str]:
        """What two sessions are compared by: harness and id."""
        return self.field.harness, self.session_id


def session_of(
    received: Mapping[str, Any] | None, fields: Sequence[SessionField]
) -> Session | None:
    """The session the first of ``fields`` that names one reads from ``received`` (a request
    body as received), or None."""
    if not received:
        return None
    for field in fields:
        value: Any = received
        for key in field.path:
            value = value.get(key) if isinstance(value, Mapping) else None
        if field.json_key is not None:
            value = _json_member(value, field.json_key)
        if isinstance(value, str) and value:
            return Session(field, value)
    return None


def _json_member(text: Any, key: str) -> Any:
    """``text`` (a JSON object as a string) ``[key]``, or None."""
    if not isinstance(text, str):
        return None
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return obj.get(key) if isinstance(obj, dict) else None


class Rank(enum.IntEnum):
    """How the sessions of a root and a candidate source compare; lower is preferred."""

    #: both name the same session
    SAME = 0
    #: one of them names none: no evidence either way
    UNKNOWN = 1
    #: they name two sessions, and the edge kind may join two sessions of the root's harness
    OTHER = 2


def rank(kind: str, root: Session | None, source: Session | None) -> Rank | None:
    """How ``source``'s session ranks as the origin of an edge of ``kind`` into a root of
    session ``root``; None when it may not be one (two sessions, and the root's harness
    sends every edge of ``kind`` inside one session: ``SessionField.edge_kinds``)."""
    if root is None or source is None:
        return Rank.UNKNOWN
    if root.key == source.key:
        return Rank.SAME
    if kind in root.field.edge_kinds:
        return None
    return Rank.OTHER
