"""The lineage edge and its kinds (see ``capture_proxy.core.lineage``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class LineageKind(enum.StrEnum):
    """Why a chain started from another chain's call."""

    #: a sub-agent's root: its first user message is the input of a tool call that handed it
    #: its task
    SPAWNED_BY = "spawned_by"
    #: a root whose history replays another chain's conversation up to a call, then goes on
    #: differently (a fork marker, or a branch the first chain did not take)
    FORKED_FROM = "forked_from"
    #: a root that carries a summary call's generated text in place of the history it replaces
    COMPACTED_FROM = "compacted_from"
    #: a root whose history replays the whole conversation of a chain's last call, then a new
    #: user message (a stored session resumed)
    RESUMED_FROM = "resumed_from"
    #: a root whose history replays the whole request of a call whose answer the harness never
    #: got (killed or interrupted), that answer replaced by the harness's declared placeholder
    #: (``InterruptedTurn``), then new messages (a session resumed after a lost turn)
    RESUMED_AFTER_INTERRUPT = "resumed_after_interrupt"
    #: a root recorded as a retry (``retry_of``) of a call of another chain
    RETRIED_FROM = "retried_from"


@dataclass(frozen=True)
class LineageEdge:
    """An edge into a chain's root: ``kind``, the chain it comes from (``chain_id``, that
    chain's root call id), the call of that chain it starts at (``from_call_id``) and the
    evidence (``rule``: which declaration or generic rule matched, and what it matched:
    ``message_index`` (an index into the root's ``request_messages``), ``text_sha256`` and
    ``num_chars`` of the matched text, ``num_messages`` (how many non-system messages of the
    history were replayed), ``common_prefix_tokens`` (of the root's prompt and the source's
    prompt + generation), ``tool_call_id``, ``marker``, ``replaces_chain_id``, ``session``
    (the harness session both calls name, when the harness declares that this kind of edge
    stays inside one: ``harness_notes.lineage.SessionField``), ...)."""

    kind: LineageKind
    chain_id: str
    from_call_id: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "chain_id": self.chain_id,
            "from_call_id": self.from_call_id,
            "evidence": self.evidence,
        }
