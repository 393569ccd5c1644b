"""The request-time answer of parent resolution: the verdict so far and its candidates.

Owns ``Resolution`` (what the index answers for a request, before the call is forwarded) and
``Candidate`` (a digest-resolved parent, with what verifying a child against it needs). Pure
data: built by ``index.LinkIndex.resolve``, read by the prompt path and by verification.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

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


class Candidates(Sequence[Candidate]):
    """Parent candidates in preference order: the first ones (``head``) made at once, the rest
    (``rest``: a function that makes them) only when a reader goes past the head. A digest
    shared by many calls (the same first answer in every session of a rollout) would make
    every resolution cost O(those calls); verification almost always takes the first
    candidate, so the rest is built only for the call whose first candidates all fail.
    Equal to any sequence of the same candidates (a tuple included)."""

    __slots__ = ("_head", "_rest", "_all")

    def __init__(
        self, head: tuple[Candidate, ...], rest: Callable[[], tuple[Candidate, ...]] | None
    ) -> None:
        self._head = head
        self._rest = rest
        self._all: tuple[Candidate, ...] | None = head if rest is None else None

    def whole(self) -> tuple[Candidate, ...]:
        """Every candidate (the rest made now, once)."""
        if self._all is None:
            assert self._rest is not None
            self._all, self._rest = (*self._head, *self._rest()), None
        return self._all

    def __iter__(self) -> Iterator[Candidate]:
        if self._all is not None:
            return iter(self._all)
        return self._iterate()

    def _iterate(self) -> Iterator[Candidate]:
        yield from self._head
        yield from self.whole()[len(self._head) :]

    def __len__(self) -> int:
        return len(self.whole())

    def head_is(self, first: Sequence[Candidate]) -> bool:
        """True when the candidates made at once begin with ``first`` (the rest not made)."""
        return self._head[: len(first)] == tuple(first)

    def __bool__(self) -> bool:
        return bool(self._head) or bool(self.whole())

    @overload
    def __getitem__(self, i: int) -> Candidate: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Candidate, ...]: ...
    def __getitem__(self, i: int | slice) -> Candidate | tuple[Candidate, ...]:
        if isinstance(i, int) and 0 <= i < len(self._head):
            return self._head[i]
        return self.whole()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return self.whole() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.whole())

    def __repr__(self) -> str:
        return f"Candidates({self.whole()!r})"


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
    candidates: Sequence[Candidate] = ()
    mismatch: dict[str, Any] | None = None
    #: the harness session of a request with the retry header that found no call to retry
    #: when it arrived: the call is looked for again before the request's call is stored
    #: (``late_retry.late_retry_step``); None otherwise
    retry_session: tuple[str, str] | None = None

    def preferring(self, call_id: str) -> Resolution:
        """The same resolution with ``call_id`` (one of the candidates) preferred: the parent
        an exact-token prompt was spliced from."""
        if self.parent_call_id == call_id:
            return self  # already the first (the rest is left unmade)
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
