"""Persisting records, and what a record the store does not take does to its call.

Owns the rule of a failed write (DESIGN.md, flow step 8): store errors are caught, logged
(sizes, never bodies), counted (``store_failures``), and make ``/health`` degraded until a
write succeeds (``write_error``). What the call becomes is the setting ``store_failure``'s:
``refuse`` (default): ``StoreWrite.REFUSED``, and the flow answers the harness a retryable
error instead of a success nobody can train on; ``answer``: ``StoreWrite.LOST``, the harness
gets its answer, the loss is counted (``answered_unstored``) and kept in ``losses``
(``proxy.losses``) until it is marked on the rollout.

A late call to a deleted rollout (its tombstone refuses the write) is not a store failure: it
is what the tombstone is for. It is counted apart (``late_calls_refused``), logged at INFO, and
the rollout is not marked, so an alert on store failures does not fire for it.

Every record passes ``persist``, so the call metrics (``Metrics.observe_call``: API, status,
prompt mode, verdict, diagnostics, upstream latency) and the store-write metrics are taken here.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.records import CallRecord, CallStatus
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.proxy.losses import LossLedger
from capture_proxy.proxy.metrics import Metrics
from capture_proxy.store.base import CaptureStore, RolloutDeleted

log = logging.getLogger("capture_proxy")


class StoreWrite(enum.Enum):
    """What ``Recorder.persist`` did with a record."""

    #: stored durably
    STORED = "stored"
    #: not stored (``store_failure = refuse``): the call must not be answered as a success
    REFUSED = "refused"
    #: not stored (``store_failure = answer``): answered anyway, the loss kept and marked
    LOST = "lost"
    #: not stored: the rollout was deleted (a late call; no failure)
    LATE = "late"


#: What a captured call's access line says when its record was not stored (a store failure,
#: ``REFUSED`` or ``LOST``), or when the call made none (refused before a record).
NOT_STORED = "not stored"
#: ... and when its rollout was deleted (``LATE``).
NOT_STORED_DELETED = "not stored (rollout deleted)"


def stored_as(status: CallStatus, written: StoreWrite) -> str:
    """What became of a call, for its access line: the stored record's status (``complete``,
    ``incomplete``, ``failed``), else ``NOT_STORED`` or ``NOT_STORED_DELETED``. (Constant
    strings: the access line is on every call's path.)"""
    if written is StoreWrite.STORED:
        return status.value
    return NOT_STORED_DELETED if written is StoreWrite.LATE else NOT_STORED


@dataclass
class RecorderStats:
    persisted: int = 0
    #: writes the store failed (refused and lost calls alike)
    store_failures: int = 0
    #: calls answered although their record was not stored (``store_failure = answer``)
    answered_unstored: int = 0
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
    metrics: Metrics = field(default_factory=Metrics)
    #: the prompt mode of a request's model (``Settings.prompt_mode_for``), for the metrics.
    prompt_mode_for: Callable[[str | None], str] = _backend_template
    #: the setting ``store_failure``: ``refuse`` (a call whose record is not stored is not
    #: answered as a success) or ``answer`` (answered; the loss counted and marked)
    store_failure: str = "refuse"
    #: the error of the first write that failed since the last one that succeeded (type and
    #: message, no record content), or None while writes succeed: ``/health`` answers 503
    #: ``degraded`` with it, and is ok again after the next successful write.
    write_error: str | None = None
    #: calls answered but not stored, until their rollouts are marked (``proxy.losses``)
    losses: LossLedger = field(init=False)
    _marking: asyncio.Task[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.losses = LossLedger(self.store)

    async def persist(
        self, record: CallRecord, request: RequestEncoding | None = None
    ) -> StoreWrite:
        """Store ``record`` durably (``request``: its ``RequestEncoding``, if computed ahead).
        Never raises: a write that fails is ``REFUSED`` or ``LOST`` (``store_failure``), a
        deleted rollout's call ``LATE``."""
        return (await self.persist_call(record, request))[0]

    async def persist_call(
        self,
        record: CallRecord,
        request: RequestEncoding | None = None,
        digests: RecordDigests | None = None,
    ) -> tuple[StoreWrite, str | None]:
        """``persist``, and the store's error (its text) when the write failed. ``digests``:
        the record's ``RecordDigests`` (verification's), handed to the store's put."""
        self.metrics.observe_call(record, record.prompt_mode or self.prompt_mode_for(record.model))
        started = time.perf_counter()
        try:
            written = await self.store.put_call(record, request, digests)
        except RolloutDeleted:
            self.metrics.observe_store_write(time.perf_counter() - started, None)
            self.stats.late_calls_refused += 1
            self.metrics.inc_late_calls_refused()
            log.info(
                "rollout %s: deleted (tombstone); late call %s answered, not stored",
                record.rollout_id,
                record.call_id,
            )
            return StoreWrite.LATE, None
        except Exception as exc:  # any store failure: the setting says what the call becomes
            self.metrics.observe_store_write(time.perf_counter() - started, None)
            written_as = self._failed(record, exc)
            if written_as is StoreWrite.LOST:
                # Marked now when the store takes that write (a refused record, a read-only
                # table), else kept in memory and marked once writes succeed.
                await self.losses.mark(record.rollout_id)
            return written_as, str(exc) or type(exc).__name__
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
        if self.losses.pending and (self._marking is None or self._marking.done()):
            # Writes succeed again: mark the losses kept meanwhile, off this call's path.
            self._marking = asyncio.create_task(self.losses.mark_all(), name="capture-mark-losses")
        return StoreWrite.STORED, None

    def _failed(self, record: CallRecord, exc: Exception) -> StoreWrite:
        self.stats.store_failures += 1
        self.metrics.inc_store_failures()
        error = f"{type(exc).__name__}: {exc}"
        if self.write_error is None:
            self.write_error = error
        refuse = self.store_failure == "refuse"
        log.error(
            "rollout %s: storing call %s failed: %s (%s)",
            record.rollout_id,
            record.call_id,
            error,
            "not answered as a success (store_failure = refuse)"
            if refuse
            else "answered anyway, the loss recorded (store_failure = answer)",
        )
        if refuse:
            return StoreWrite.REFUSED
        self.stats.answered_unstored += 1
        self.metrics.inc_answered_unstored()
        self.losses.add(record.rollout_id, record.call_id, error)
        return StoreWrite.LOST

    async def mark_losses(self) -> int:
        """Mark the losses kept in memory now; how many rollouts are left unmarked."""
        return await self.losses.mark_all()

    async def close(self) -> None:
        """Wait for a mark of losses in progress (at shutdown, before the store closes)."""
        if self._marking is not None:
            await self._marking
