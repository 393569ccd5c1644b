"""How the harness sessions of a root and of a call an edge could come from rank that call
(see ``capture_proxy.core.lineage``; the session a request names: ``core.sessions``).

A harness that runs several sessions in one rollout (parallel samples of one task) sends them
the same texts: two sessions' main agents hand out the same sub-agent prompt, two twin
sessions replay the same history. Text alone cannot tell whose call a root continues; the
session each request names can. Pure: no I/O.
"""

from __future__ import annotations

import enum

from capture_proxy.core.sessions import Session


class Rank(enum.IntEnum):
    """How the sessions of a root and a candidate source compare; lower is preferred."""

    #: both name the same session (or the source is of the session that spawned the root,
    #: for an edge kind that comes from there)
    SAME = 0
    #: one of them names none: no evidence either way
    UNKNOWN = 1
    #: they name two sessions, and the edge kind may join two sessions of the root's harness
    OTHER = 2


def rank(kind: str, root: Session | None, source: Session | None) -> Rank | None:
    """How ``source``'s session ranks as the origin of an edge of ``kind`` into a root of
    session ``root``; None when it may not be one: two sessions, and the root's harness sends
    every edge of ``kind`` inside one session (``SessionField.edge_kinds``); or the root names
    the session that spawned it and ``kind`` comes from that session
    (``SessionField.parent_edge_kinds``: an OpenCode sub-agent is ``spawned_by`` a call of its
    parent session), and ``source`` is of another."""
    if root is None or source is None:
        return Rank.UNKNOWN
    if root.parent_key is not None and kind in root.field.parent_edge_kinds:
        return Rank.SAME if source.key == root.parent_key else None
    if root.key == source.key:
        return Rank.SAME
    if kind in root.field.edge_kinds:
        return None
    return Rank.OTHER
