"""The harness session a request names, and the session headers a record keeps.

A harness that runs several sessions in one rollout (parallel samples of one task) sends them
the same texts and, from a deterministic engine, the same tokens: two sessions' main agents
hand out the same sub-agent prompt, two twin sessions continue token-identical calls. Text and
tokens cannot tell whose call a request continues; the session a request names can, where the
harness sends one (``harness_notes.lineage.SessionField``: Claude Code's ``metadata.user_id``
``session_id`` and Codex's ``prompt_cache_key`` in the body, read as the harness sent it,
``CallRecord.request_received``; OpenCode's ``x-session-id`` header, and on a sub-agent's
requests ``x-parent-session-id``, the session that spawned it, read from the headers the record
keeps, ``CallRecord.session_headers``). A record from before the body or the headers were kept
names none.

``session_headers`` owns which request headers a record keeps: only the names a declaration
reads (``SESSION_HEADERS``), each value only when it is a plain id (``SESSION_ID_RE``: at most
``MAX_SESSION_ID_CHARS``); anything else a harness sends (``Authorization``, its API key) never
reaches a record. Lineage ranks an edge's possible origins by the session
(``core.lineage.sessions``), linking breaks ties between token-identical parent candidates by
it (``core.linking.index``). Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from capture_proxy.core.redact import secret_name
from harness_notes import ALL_LINEAGE
from harness_notes.lineage import SessionField

#: Every harness's declaration of where its requests name their session.
SESSION_FIELDS: tuple[SessionField, ...] = tuple(
    d for d in ALL_LINEAGE if isinstance(d, SessionField)
)

#: The longest session id a kept header may hold (characters; OpenCode's are 30).
MAX_SESSION_ID_CHARS = 128

#: A session id as a header may carry it: letters, digits and ``._:-``, starting with a letter
#: or digit (OpenCode's ``ses_...``, a UUID), at most ``MAX_SESSION_ID_CHARS``.
SESSION_ID_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:-]{{0,{MAX_SESSION_ID_CHARS - 1}}}")


def declared_headers(fields: Sequence[SessionField]) -> frozenset[str]:
    """The header names ``fields`` read (lowercase). Raises ValueError for a name that says it
    holds a credential (``redact.secret_name``): a record must never keep one."""
    names = frozenset(
        name for f in fields for name in (f.header, f.parent_header) if name is not None
    )
    for name in sorted(names):
        if secret_name(name):
            raise ValueError(f"session header {name!r} names a credential: never kept")
    return names


#: The request headers a record keeps: those a declaration reads (OpenCode's ``x-session-id``
#: and ``x-parent-session-id``). Claude Code's ``X-Claude-Code-Session-Id`` and Codex's
#: ``session-id`` / ``thread-id`` are not kept: they repeat the id their body names.
SESSION_HEADERS: frozenset[str] = declared_headers(SESSION_FIELDS)


def session_headers(
    headers: Iterable[tuple[str, str]], allowed: frozenset[str] = SESSION_HEADERS
) -> dict[str, str] | None:
    """The ``allowed`` headers among a request's ``headers`` (name, value pairs as received,
    in any case), by lowercase name, in ``allowed``'s sorted order; None when none is kept. A
    value that is not a plain id (``SESSION_ID_RE``, after stripping surrounding whitespace),
    or a name sent twice with two values, is left out: a header is evidence, never a
    failure."""
    kept: dict[str, str] = {}
    refused: set[str] = set()
    for name, value in headers:
        key = name.lower()
        if key not in allowed or key in refused:
            continue
        value = value.strip()
        if SESSION_ID_RE.fullmatch(value) is None or kept.get(key, value) != value:
            refused.add(key)
            kept.pop(key, None)
        else:
            kept[key] = value
    return {key: kept[key] for key in sorted(kept)} or None


@dataclass(frozen=True)
class Session:
    """A harness session: the declaration that read it, its id, and the id of the session
    that spawned it where the request names one (``SessionField.parent_header``)."""

    field: SessionField
    session_id: str
    parent_id: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        """What two sessions are compared by: harness and id."""
        return self.field.harness, self.session_id

    @property
    def parent_key(self) -> tuple[str, str] | None:
        """The ``key`` of the session that spawned this one, or None."""
        return None if self.parent_id is None else (self.field.harness, self.parent_id)


def session_of(
    received: Mapping[str, Any] | None,
    fields: Sequence[SessionField] = SESSION_FIELDS,
    *,
    headers: Mapping[str, str] | None = None,
) -> Session | None:
    """The session the first of ``fields`` that names one reads from ``received`` (a request
    body as received) or ``headers`` (the session headers a record keeps, by lowercase name:
    ``session_headers``), or None."""
    for field in fields:
        if field.header is not None:
            value = headers.get(field.header) if headers else None
            if isinstance(value, str) and value:
                parent = None
                if field.parent_header is not None:
                    parent = headers.get(field.parent_header) if headers else None
                return Session(field, value, parent if isinstance(parent, str) and parent else None)
            continue
        if not received:
            continue
        found: Any = received
        for key in field.path:
            # (a dict, as parsed JSON is, or None without the ABC's isinstance: twice per call)
            is_mapping = type(found) is dict or (found is not None and isinstance(found, Mapping))
            found = found.get(key) if is_mapping else None
        if field.json_key is not None:
            found = _json_member(found, field.json_key)
        if isinstance(found, str) and found:
            return Session(field, found)
    return None


def session_key(
    received: Mapping[str, Any] | None, headers: Mapping[str, str] | None = None
) -> tuple[str, str] | None:
    """``session_of(received, headers=headers).key``, or None."""
    session = session_of(received, headers=headers)
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
