"""Calls answered to the harness whose record the store did not take, until the store says so.

Owns the proxy's memory of lost calls under ``store_failure = answer`` (with the default,
``refuse``, no call whose record is lost is answered as a success, so nothing is kept here):
per rollout, the ids of the calls answered but not stored and the first failed write's reason.
Each loss is marked on its rollout as soon as the store takes the write
(``mark_rollout_incomplete`` with one ``store_failed`` diagnostic, ``{"reason", "call_ids"}``:
the store adds later calls' ids to it), also for a rollout with no call stored yet, which the
mark creates. Until then the loss lives here only, and ``/health``, the rollout's REST view and
the viewer show it, so a trainer never reads that rollout as complete; a freeze of it is
refused (``rest.lifecycle``). Marks are retried after the next write that succeeds
(``Recorder``) and every ``LOSS_RETRY_INTERVAL_S`` (``marker``); what is still unmarked at
shutdown is logged at ERROR, rollout by rollout.

Must not: write a call, or decide which calls are answered (the flow and the recorder do).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.core.records import Diagnostic, DiagnosticKind
from capture_proxy.proxy.periodic import every
from capture_proxy.store.base import CaptureStore

log = logging.getLogger("capture_proxy")

#: Seconds between two attempts to mark the losses still unmarked.
LOSS_RETRY_INTERVAL_S = 5.0
#: Rollouts named in ``/health`` (the count is whole; the list is bounded).
HEALTH_ROLLOUTS_SHOWN = 20


@dataclass
class Loss:
    """One rollout's calls answered but not stored, not yet marked on it; ``reason``: the
    first failed write's error (type and message, never a record's content); ``since``: when
    the first was lost (Unix seconds)."""

    reason: str
    since: float
    call_ids: list[str] = field(default_factory=list)

    def diagnostic(self) -> Diagnostic:
        """The rollout-level ``store_failed`` diagnostic of this loss."""
        return Diagnostic(
            DiagnosticKind.STORE_FAILED, {"reason": self.reason, "call_ids": list(self.call_ids)}
        )


class LossLedger:
    """The unmarked losses of one app (event-loop state: read and changed on the loop)."""

    def __init__(self, store: CaptureStore) -> None:
        self.store = store
        #: rollout id -> its loss not yet marked in the store
        self.pending: dict[str, Loss] = {}

    def add(self, rollout_id: str, call_id: str, reason: str) -> None:
        loss = self.pending.get(rollout_id)
        if loss is None:
            loss = self.pending[rollout_id] = Loss(reason, time.time())
        if call_id not in loss.call_ids:
            loss.call_ids.append(call_id)

    def diagnostic(self, rollout_id: str) -> Diagnostic | None:
        """The ``store_failed`` diagnostic of the rollout's unmarked loss, if it has one."""
        loss = self.pending.get(rollout_id)
        return None if loss is None else loss.diagnostic()

    async def mark(self, rollout_id: str) -> bool:
        """Mark the rollout's loss in the store; True when nothing of it is left unmarked.
        Never raises (a store that still refuses is logged at WARNING)."""
        loss = self.pending.get(rollout_id)
        if loss is None:
            return True
        marked = list(loss.call_ids)
        try:
            await self.store.mark_rollout_incomplete(rollout_id, loss.diagnostic())
        except Exception as exc:
            log.warning(
                "rollout %s: cannot mark %d lost call(s) yet (kept in memory, retried): %s: %s",
                rollout_id,
                len(marked),
                type(exc).__name__,
                exc,
            )
            return False
        # Calls lost while the mark was being written stay for the next one.
        loss.call_ids = [i for i in loss.call_ids if i not in marked]
        if not loss.call_ids and self.pending.get(rollout_id) is loss:
            del self.pending[rollout_id]
        log.info("rollout %s: marked incomplete, %d lost call(s) recorded", rollout_id, len(marked))
        return rollout_id not in self.pending

    async def mark_all(self) -> int:
        """Try to mark every unmarked loss, stopping at the first refusal (the store is still
        failing). Returns how many rollouts are left unmarked."""
        for rollout_id in list(self.pending):
            if not await self.mark(rollout_id):
                break
        return len(self.pending)

    def health(self) -> dict[str, Any]:
        """For ``/health``: the unmarked losses' counts and the first rollouts' ids."""
        return {
            "rollouts": len(self.pending),
            "calls": sum(len(loss.call_ids) for loss in self.pending.values()),
            "rollout_ids": sorted(self.pending)[:HEALTH_ROLLOUTS_SHOWN],
        }

    def log_unmarked(self) -> None:
        """At shutdown: one ERROR line per loss the store never took (the last word on it)."""
        for rollout_id, loss in sorted(self.pending.items()):
            log.error(
                "rollout %s: %d call(s) answered but not stored, and the store never took the "
                "mark: %s (first failure: %s)",
                rollout_id,
                len(loss.call_ids),
                ", ".join(loss.call_ids),
                loss.reason,
            )

    @contextlib.asynccontextmanager
    async def marker(self, interval_s: float = LOSS_RETRY_INTERVAL_S) -> AsyncIterator[None]:
        """While the app runs: retry the unmarked losses every ``interval_s``; on shutdown one
        last attempt, then ``log_unmarked``."""

        try:
            async with every(
                interval_s, self.mark_all, name="capture-loss-marker", first_now=False
            ):
                yield
        finally:
            if self.pending:
                await self.mark_all()
            self.log_unmarked()
