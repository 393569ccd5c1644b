"""The request-time answer of parent resolution: the verdict so far and its candidates.

Owns ``Resolution`` (what the index answers for a request, before the call is forwarded) and
``Candidate`` (a digest-resolved parent, with what verifying a child against it needs). Pure
data: built by ``index.LinkIndex.resolve``, read by the prompt path and by verification.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from capture_proxy.core.linking.verdicts import Reason, Verdict


@dataclass(frozen=True)
class Candidate:
    """A digest-resolved parent candidate: its id, the routed-expert rows it holds (one past
    the last; None: none) and its prompt + generation length and ``codec.token_digest`` (None:
    no complete token data), so a child is verified without reading the candidate's arrays."""

    call_id: str
    rows_end: int | None = None
    num_tokens: int | None = None
    tokens_sha256: bytes | None = None


@dataclass(frozen=True)
class Resolution:
    """Request-time answer: the verdict so far, the parent candidates and the retry target.

    ``candidates``: every captured call of the same model whose child digest is the request's
    parent digest, the preferred first (see ``LinkIndex.resolve``); verification takes the
    first whose tokens the child extends. ``parent_call_id`` and the ``parent_*`` fields are
    the preferred candidate's. ``mismatch``: for an unresolved history whose last turn is a
    captured output under another history (a turn dropped or edited), the diagnostic details
    (``parent_digest_mismatch``, class ``history_edited``)."""

    verdict: Verdict
    parent_digest: str | None
    request_digest: str
    parent_call_id: str | None = None
    retry_of: str | None = None
    #: why the verdict is what it is (a plain text only from an adapter whose resolution
    #: failed: ``verdicts.adapter_reason``)
    reason: Reason | str | None = None
    #: one past the last routed-expert row the parent holds (None: no rows), so only the rows
    #: after it are asked for
    parent_rows_end: int | None = None
    #: the parent's prompt + generation length and their ``codec.token_digest``, so a child is
    #: verified without reading the parent's arrays (None: unknown, read them)
    parent_num_tokens: int | None = None
    parent_tokens_sha256: bytes | None = None
    candidates: tuple[Candidate, ...] = ()
    mismatch: dict[str, Any] | None = None

    def preferring(self, call_id: str) -> Resolution:
        """The same resolution with ``call_id`` (one of the candidates) preferred: the parent
        an exact-token prompt was spliced from."""
        chosen = [c for c in self.candidates if c.call_id == call_id]
        if not chosen:
            return self
        rest = tuple(c for c in self.candidates if c.call_id != call_id)
        first = chosen[0]
        return dataclasses.replace(
            self,
            parent_call_id=first.call_id,
            parent_rows_end=first.rows_end,
            parent_num_tokens=first.num_tokens,
            parent_tokens_sha256=first.tokens_sha256,
            candidates=(first, *rest),
        )
