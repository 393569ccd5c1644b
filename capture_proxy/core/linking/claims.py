"""Claims on parent candidates by calls in flight in other processes (``serve --workers``).

A call in flight counts as a child of the candidate it was resolved to, so two identical
sub-agents that continue at once each keep their own chain (``candidate_order._preference``). One
process knows its own calls in flight; with several workers on one store, a worker must also
know the others': ``ChildClaims`` is that shared knowledge, used only when a choice exists
(more than one call under the history's parent digest). Pure: the protocol only; the
workers' shared board is ``store.remote.ChildClaimBoard``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol


class ChildClaims(Protocol):
    """Which parent candidates calls in flight (in any process) were resolved to."""

    def locked(self) -> AbstractContextManager[None]:
        """Hold the claims still: no other process claims while this is held (synchronous
        code only, no await inside)."""
        ...

    def claimed(self, parent_call_id: str) -> bool:
        """True when a call in flight claims ``parent_call_id`` (this process's or another's)."""
        ...

    def claim(self, call_id: str, parent_call_id: str) -> None:
        """``call_id`` (in flight) was resolved to ``parent_call_id``: claim it until
        ``release(call_id)``."""
        ...

    def release(self, call_id: str) -> None:
        """``call_id`` is stored (its parent link is in the store) or ended: drop its claim,
        if it holds one."""
        ...
