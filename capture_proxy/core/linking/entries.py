"""What the link index keeps of one captured call (``Entry``), apart from the index itself.

``index`` files entries; ``candidate_order`` orders them and ``retry_target`` finds a retry's
target among them: all import this module, and neither of the last two has to import the
index to name an entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_proxy.core.records import CallStatus

#: Status of an index entry whose call is still in flight.
IN_FLIGHT = "in_flight"

#: Record statuses the index keeps (``CallStatus`` values).
CALL_COMPLETE = CallStatus.COMPLETE.value
CALL_FAILED = CallStatus.FAILED.value
CALL_INCOMPLETE = CallStatus.INCOMPLETE.value

#: A harness session, as ``core.sessions.Session.key`` gives it: (harness, session id).
SessionKey = tuple[str, str]


@dataclass(slots=True)
class Entry:
    call_id: str
    created_at: float
    child_digest: str | None
    request_digest: str | None
    harness_note: bool
    rows_end: int | None = None
    num_tokens: int | None = None
    tokens_sha256: bytes | None = None
    model: str | None = None
    status: str = IN_FLIGHT
    #: digests of the call's own answer, alone (with and without its tool-call ids)
    turn_digest: str | None = None
    turn_digest_without_ids: str | None = None
    #: the tool-call ids of its answer (ids are unique per answer: engine- or proxy-made)
    tool_call_ids: tuple[str, ...] = ()
    #: children so far: stored with this call as their parent, or in flight and resolved to
    #: it (two identical sub-agents in flight at once each continue their own); a later
    #: identical retry that supersedes this call
    children: int = 0
    superseded_by: str | None = None
    #: the parent this call is counted as a child of (in flight: the one it was resolved to)
    counted_parent: str | None = None
    #: the harness session its request named (``core.sessions``), if any
    session: SessionKey | None = None
    #: the chain digest of the history its request sent before the turn it asked for
    #: (``history_keys``): what a call that continues its answer repeats before that answer
    history: bytes | None = None


def age(entry: Entry) -> tuple[float, str]:
    """``entry``'s place in the order of the calls' arrival: its ``created_at``, then (a tie)
    its call id."""
    return entry.created_at, entry.call_id
