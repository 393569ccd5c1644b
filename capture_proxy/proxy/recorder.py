"""Persisting records without ever failing the model call.

Owns the rule "a capture failure never fails the model call": store errors are caught,
logged (sizes, never bodies), counted, and marked on the rollout. When even marking the rollout
fails, the rollout id is remembered in memory and reported by ``/health`` and the REST summary.

A late call to a deleted rollout (its tombstone refuses the write) is not a store failure: it
is what the tombstone is for. It is counted apart (``late_calls_refused``), logged at INFO, and
the rollout is not marked, so an alert on store failures does not fire for it.

Every record passes ``persist``, so the call metrics (``Metrics.observe_call``: API, status,
prompt mode, verdict, diagnostics, upstream latency) and the store-write metrics are taken here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from capture_proxy.core.codec import RequestEncoding
from capture_proxy.core.records import CallRecord, Diagnostic, DiagnosticKind
from capture_proxy.proxy.metrics import Metrics
from capture_proxy.store.base import CaptureStore, RolloutDeleted

log = logging.getLogger("capture_proxy")


@dataclass
class RecorderStats:
    persisted: int = 0
    store_failures: int = 0
    incomplete: int = 0
    failed: int = 0
    #: calls to a deleted (tombstoned) rollout: answered, not stored, not a failure.
    late_calls_refused: int = 0


def _backend_template(model: str | None) -> str:
    return "backend_template"


def _record_bytes(record: CallRecord) -> int:
    """The record's array bytes, for a store that does not say what it wrote."""
    experts = record.routed_experts
    return (
        record.prompt_token_ids.nbytes
        + record.generation_token_ids.nbytes
        + record.generation_log_probs.nbytes
        + (experts.nbytes if experts is not None else 0)
    )


@dataclass
class Recorder:
    store: CaptureStore
    stats: RecorderStats = field(default_factory=RecorderStats)
    #: rollout id -> reason, for rollouts whose incompleteness could not be stored either.
    unstored_incomplete: dict[str, str] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    #: the prompt mode of a request's model (``Settings.prompt_mode_for``), for the metrics.
    prompt_mode_for: Callable[[str | None], str] = _backend_template
    #: the error of the first write that failed since the last one that succeeded (type and
    #: message, no record content), or None while writes succeed: ``/health`` answers 503
    #: ``degraded`` with it, and is ok again after the next successful write.
    write_error: str | None = None

    async def persist(self, record: CallRecord, request: RequestEncoding | None = None) -> bool:
        """Store ``record`` durably (``request``: its ``RequestEncoding``, if computed ahead).
        Returns False (never raises) when it was not stored: storing failed, or the rollout
        was deleted (a late call)."""
        self.metrics.observe_call(record, record.prompt_mode or self.prompt_mode_for(record.model))
        started = time.perf_counter()
        try:
            written = await self.store.put_call(record, request)
        except RolloutDeleted:
            self.metrics.observe_store_write(time.perf_counter() - started, None)
            self.stats.late_calls_refused += 1
            self.metrics.inc_late_calls_refused()
            log.info(
                "rollout %s: deleted (tombstone); late call %s answered, not stored",
                record.rollout_id,
                record.call_id,
            )
            return False
        except Exception as exc:  # any store failure: the harness still gets its answer
            self.metrics.observe_store_write(time.perf_counter() - started, None)
            self.stats.store_failures += 1
            self.metrics.inc_store_failures()
            reason = f"storing call {record.call_id} failed: {type(exc).__name__}: {exc}"
            log.error("rollout %s: %s", record.rollout_id, reason)
            if self.write_error is None:
                self.write_error = f"{type(exc).__name__}: {exc}"
            await self.mark_incomplete(
                record.rollout_id,
                Diagnostic(
                    DiagnosticKind.STORE_FAILED, {"call_id": record.call_id, "reason": reason}
                ),
            )
            return False
        self.metrics.observe_store_write(
            time.perf_counter() - started,
            written if isinstance(written, int) else _record_bytes(record),
        )
        self.write_error = None
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
