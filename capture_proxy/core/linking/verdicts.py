"""Verdicts of parent resolution and the typed reasons that explain them.

Owns ``Verdict`` (stored on every captured call as ``linking.verdict``) and ``Reason``: a kind
the code decides by (never by comparing text) and the exact text stored as ``linking.reason``
and in diagnostics. The texts are part of the stored format: readers and tests compare them,
so they do not change. Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Verdict(enum.StrEnum):
    """Outcome of parent resolution, stored on every captured call.

    - ``root``: no model-authored turn in the history: a new chain starts.
    - ``resolved``: the digest found a captured call and its tokens were verified.
    - ``refused``: the digest found a call but the tokens do not chain: the link is refused
      (``parent_digest_mismatch``) and the call starts a new chain.
    - ``unresolved``: the history has model-authored turns but no captured call matches.
    - ``prefix``: the digest parent was refused, or none matched, but an earlier call of the
      rollout is a token-exact ancestor: the call is linked to the deepest one (its prompt
      begins with that call's prompt + generation); the refusal is kept as a diagnostic.
    """

    ROOT = "root"
    RESOLVED = "resolved"
    REFUSED = "refused"
    UNRESOLVED = "unresolved"
    PREFIX = "prefix"


class ReasonKind(enum.Enum):
    """What a reason says, for decisions (the text is for people and the stored record)."""

    #: the last model-authored turn matches no captured output (a foreign turn)
    NO_MATCH = "no_match"
    #: the last turn is a captured output, under another history (turns dropped or edited)
    HISTORY_EDITED = "history_edited"
    #: the last turn is a captured output but for its tool-call ids
    TOOL_CALL_IDS = "tool_call_ids"
    #: resolved by the last turn's tool-call ids: the harness rewrote that turn's text
    TURN_REWRITTEN = "turn_rewritten"
    #: the matching turns were produced by a call to another model
    MODEL_SCOPE = "model_scope"
    #: ``parent_resolution = source_history`` refused a parent whose prompt carried a note
    NOTE_PARENT = "note_parent"
    #: the call itself has no complete token data, so its link cannot be verified
    CALL_INCOMPLETE = "call_incomplete"
    #: the digest parent has no complete token data
    PARENT_INCOMPLETE = "parent_incomplete"
    #: the digest parent's tokens are not a prefix of the call's prompt
    TOKENS_DO_NOT_CHAIN = "tokens_do_not_chain"
    #: the digest parent's tokens are a prefix of the call's prompt, its images are not the
    #: call's images at the same places
    IMAGES_DIFFER = "images_differ"
    #: a refusal or miss, then linked to the deepest token-exact ancestor (see ``cause``)
    PREFIX_LINKED = "prefix_linked"
    #: a text an adapter gave (its resolution failed); nothing is decided by it
    ADAPTER = "adapter"


@dataclass(frozen=True)
class Reason:
    """Why a verdict is what it is. ``text``: stored byte for byte as ``linking.reason``;
    ``cause``: for ``PREFIX_LINKED``, the reason the digest link was not taken."""

    kind: ReasonKind
    text: str
    cause: Reason | None = None

    def __str__(self) -> str:
        return self.text


#: The text of ``ReasonKind.MODEL_SCOPE`` reasons begins with this.
MODEL_SCOPE_TEXT = "the matching turns come from a call to another model"

NO_MATCH = Reason(ReasonKind.NO_MATCH, "no captured call produced the last model-authored turn")
HISTORY_EDITED = Reason(
    ReasonKind.HISTORY_EDITED,
    "the last model-authored turn is a captured call's output, but the history before it was "
    "edited",
)
TOOL_CALL_IDS = Reason(
    ReasonKind.TOOL_CALL_IDS,
    "the last model-authored turn equals a captured call's output but for its tool-call ids",
)
TURN_REWRITTEN = Reason(
    ReasonKind.TURN_REWRITTEN,
    "the last model-authored turn was rewritten by the harness; found by its tool-call ids",
)
NOTE_PARENT = Reason(
    ReasonKind.NOTE_PARENT, "parent prompt carried a rewritten harness note (source_history)"
)
CALL_INCOMPLETE = Reason(ReasonKind.CALL_INCOMPLETE, "call has no complete token data to verify")
PARENT_INCOMPLETE = Reason(ReasonKind.PARENT_INCOMPLETE, "parent has no complete token data")
IMAGES_DIFFER = Reason(
    ReasonKind.IMAGES_DIFFER,
    "the parent's tokens chain but its images are not the call's at the same places",
)


def model_scope(models: Iterable[str], model: str | None) -> Reason:
    """The turns were produced by ``models`` (sorted by the caller), this call is to ``model``."""
    return Reason(
        ReasonKind.MODEL_SCOPE,
        f"{MODEL_SCOPE_TEXT}: the turns were produced by model {', '.join(models)}, "
        f"this call is to {model}",
    )


def tokens_do_not_chain(mismatch_class: str) -> Reason:
    """A refused digest parent; ``mismatch_class``: a ``MismatchClass`` value."""
    return Reason(ReasonKind.TOKENS_DO_NOT_CHAIN, f"tokens do not chain ({mismatch_class})")


def prefix_linked(verdict: Verdict, cause: Reason | None) -> Reason:
    """The link ``verdict`` (refused or unresolved, for ``cause``) was replaced by a link to
    the deepest token-exact ancestor."""
    return Reason(
        ReasonKind.PREFIX_LINKED,
        f"{verdict.value}: {cause}; linked to its deepest token-exact ancestor",
        cause,
    )


def adapter_reason(text: str | Reason | None) -> Reason | None:
    """A reason as the core decides by: an adapter's plain text becomes ``ADAPTER``."""
    if text is None or isinstance(text, Reason):
        return text
    return Reason(ReasonKind.ADAPTER, text)
