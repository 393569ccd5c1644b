"""Persisting records without ever failing the model call.

Owns the rule "a capture failure never fails the model call": store errors are caught,
logged (sizes, never bodies), counted, and marked on the rollout. When even marking the rollout
fails, the rollout id is remembered in memory and reported by ``/health`` and the REST summary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from capture_proxy.core.codec import RequestEncoding
from capture_proxy.core.records import CallRecord, Diagnostic, DiagnosticKind
from capture_proxy.store.base import CaptureStore

log = logging.getLogger("capture_proxy")


@dataclass
class RecorderStats:
    persisted: int = 0
    store_failures: int = 0
    incomplete: int = 0
    failed: int = 0


@dataclass
class Recorder:
    store: CaptureStore
    stats: RecorderStats = field(default_factory=RecorderStats)
    #: rollout id -> reason, for rollouts whose incompleteness could not be stored either.
    unstored_incomplete: dict[str, str] = field(default_factory=dict)

    async def persist(self, record: CallRecord, request: RequestEncoding | None = None) -> bool:
        """Store ``record`` durably (``request``: its ``RequestEncoding``, if computed ahead).
        Returns False (never raises) when storing failed."""
        try:
            await self.store.put_call(record, request)
        except Exception as exc:  # any store failure: the harness still gets its answer
            self.stats.store_failures += 1
            reason = f"storing call {record.call_id} failed: {type(exc).__name__}: {exc}"
            log.error("rollout %s: %s", record.rollout_id, reason)
            await self.mark_incomplete(
                record.rollout_id,
                Diagnostic(
                    DiagnosticKind.STORE_FAILED, {"call_id": record.call_id, "reason": reason}
                ),
            )
            return False
        self.stats.persisted += 1
        if record.status == "incomplete":
            self.stats.incomplete += 1
        elif record.status == "failed":
            self.stats.failed += 1
        return True

    async def mark_incomplete(self, rollout_id: str, diagnostic: Diagnostic) -> None:
        try:
            await self.store.mark_rollout_incomplete(rollout_id, diagnostic)
        except Exception as exc:
            log.error("rollout %s: cannot mark incomplete: %s", rollout_id, exc)
            self.unstored_incomplete[rollout_id] = str(diagnostic.details.get("reason", ""))
