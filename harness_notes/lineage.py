"""What a harness leaves in its requests when one conversation starts from another.

Declarations only (no matching, no I/O): each harness module lists, in a ``LINEAGE`` tuple,
the tools whose input hands a sub-agent its task (``SpawnTool``), the texts that mark a fork's
first new messages (``ForkMarker``), and how a compaction summary is carried into the next
conversation (``SummaryTags``: the summary call's answer wraps it in tags; ``SummaryPrefix``:
the next conversation's message starts with a fixed text and then the summary;
``SummaryRequest``: the summary call's last user message holds a fixed instruction), the
assistant message a harness puts in place of a turn it lost when it resumes a session
(``InterruptedTurn``), and where a request (its body or its headers) names the harness's
session and the session that spawned it, and which edges never leave one (``SessionField``).
The rules that use them live in ``capture_proxy.core.lineage``, which also has generic rules
for harnesses that declare nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpawnTool:
    """A tool call that starts a sub-agent: ``arguments[prompt_field]`` (a string) is the
    sub-agent's first user message."""

    harness: str
    tool_name: str
    prompt_field: str


@dataclass(frozen=True)
class ForkMarker:
    """A text found in a fork's messages after the history it replays."""

    harness: str
    text: str


@dataclass(frozen=True)
class SummaryTags:
    """A summary call's answer holds the summary between ``open_tag`` and ``close_tag``; the
    next conversation's first user message carries that body."""

    harness: str
    open_tag: str
    close_tag: str


@dataclass(frozen=True)
class SummaryPrefix:
    """The next conversation carries the summary in a message that starts with ``prefix``;
    the text after it (stripped) is the summary call's answer."""

    harness: str
    prefix: str


@dataclass(frozen=True)
class SummaryRequest:
    """A call whose last user message contains ``instruction`` asks for a summary: its answer
    text is carried into the next conversation."""

    harness: str
    instruction: str


@dataclass(frozen=True)
class InterruptedTurn:
    """When the harness resumes a session whose last turn was lost (the harness was killed or
    interrupted before the answer arrived), it sends the lost call's request again with an
    assistant message of exactly ``text`` in place of the answer, then the new messages."""

    harness: str
    text: str


@dataclass(frozen=True)
class SessionField:
    """Where a request names the harness's session: in its body (as received:
    ``CallRecord.request_received``), the string at ``path`` (keys from the top; with
    ``json_key`` that string is a JSON object and the session is its string under
    ``json_key``); or in a request header, ``header`` (lowercase; a harness that names its
    session only in headers, as OpenCode does). ``parent_header``: the header a sub-agent's
    requests name the session that spawned it by (that session's ``header`` value). A
    declared header is kept on the call's record (``CallRecord.session_headers``): the only
    headers the proxy keeps, so a declared name may never be one that holds a credential.

    Lineage prefers, among the calls an edge could come from, those of the root's session.
    ``edge_kinds``: the edge kinds (``LineageKind`` values) whose two calls this harness always
    sends under one session, as observed: an edge of such a kind never joins two calls that
    name two sessions. Other kinds may join two sessions (a session forked into a new one), so
    for them another session's call is taken only when no call of the root's session (or of
    none) matches. ``parent_edge_kinds``: the edge kinds that come from the session that
    spawned the root, as observed (a sub-agent that runs in a session of its own): for a root
    whose request names its parent session, an edge of such a kind comes only from a call of
    that session (or of none)."""

    harness: str
    path: tuple[str, ...] = ()
    json_key: str | None = None
    edge_kinds: frozenset[str] = frozenset()
    header: str | None = None
    parent_header: str | None = None
    parent_edge_kinds: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        """Raises ValueError unless exactly one of ``path`` and ``header`` is given, for a
        header name that is not lowercase, and for a ``parent_header`` without ``header``."""
        if bool(self.path) == (self.header is not None):
            raise ValueError(f"{self.harness} session: exactly one of a body path and a header")
        for name in (self.header, self.parent_header):
            if name is not None and (not name or name != name.lower()):
                raise ValueError(f"{self.harness} session: header {name!r} is not lowercase")
        if self.parent_header is not None and self.header is None:
            raise ValueError(f"{self.harness} session: a parent header needs a session header")


LineageDeclaration = (
    SpawnTool
    | ForkMarker
    | SummaryTags
    | SummaryPrefix
    | SummaryRequest
    | InterruptedTurn
    | SessionField
)
