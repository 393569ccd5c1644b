"""The harness session a request names.

A harness that runs several sessions in one rollout (parallel samples of one task) sends them
the same texts and, from a deterministic engine, the same tokens: two sessions' main agents
hand out the same sub-agent prompt, two twin sessions continue token-identical calls. Text and
tokens cannot tell whose call a request continues; the session a request names can, where the
harness sends one (``harness_notes.lineage.SessionField``: Claude Code's ``metadata.user_id``
``session_id``, Codex's ``prompt_cache_key``). Read from the body as the harness sent it
(``CallRecord.request_received``, ``FrontRequest.received``); a request whose harness names
none (OpenCode's ids are headers), or a record from before the body was kept, names none.
Lineage ranks an edge's possible origins by it (``core.lineage.sessions``), linking breaks
ties between token-identical parent candidates by it (``core.linking.index``). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from harness_notes import ALL_LINEAGE
from harness_notes.lineage import SessionField

#: Every harness's declaration of where its requests name their session.
SESSION_FIELDS: tuple[SessionField, ...] = tuple(
    d for d in ALL_LINEAGE if isinstance(d, SessionField)
)


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
    received: Mapping[str, Any] | None, fields: Sequence[SessionField] = SESSION_FIELDS
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


def session_key(received: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """``session_of(received).key``, or None."""
    session = session_of(received)
    return session.key if session is not None else None


def _json_member(text: Any, key: str) -> Any:
    """``text`` (a JSON object as a string) ``[key]``, or None."""
    if not isinstance(text, str):
        return None
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return obj.get(key) if isinstance(obj, dict) else None
