"""What every REST view of a rollout says beside its calls: its lifecycle fields and its
rollout-level diagnostics, the store's and what only this process knows (``RolloutState``:
calls answered but not stored whose loss the store has not taken yet, ``proxy.losses``).

Pure reads of a ``RolloutInfo`` and the recorder's state; no I/O.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from capture_proxy.core.episodes import parse_episode
from capture_proxy.core.records import CallRecord, Diagnostic
from capture_proxy.proxy.recorder import Recorder
from capture_proxy.store.base import RolloutInfo


def lifecycle_json(info: RolloutInfo) -> dict[str, Any]:
    """The lifecycle and metadata fields every rollout view carries."""
    episode = parse_episode(info.rollout_id)
    meta = info.metadata
    return {
        "status": info.status.value,
        "version": info.version,
        "snapshot_id": info.snapshot.snapshot_id if info.snapshot else None,
        "episode_of": episode.base,
        "attempt": episode.attempt,
        "reward": meta.reward,
        "task_id": meta.task_id,
        "tags": meta.tags,
        "late_call_ids": list(info.late_call_ids),
    }


class RolloutState:
    """What the recorder knows of a rollout beyond the store, read on the event loop (the
    recorder's state is the loop's) and handed to the REST thread."""

    def __init__(self, info: RolloutInfo, recorder: Recorder) -> None:
        #: calls answered but not stored, not yet marked in the store (``proxy.losses``)
        self.unmarked_loss = recorder.losses.diagnostic(info.rollout_id)
        self.incomplete = info.incomplete or self.unmarked_loss is not None


def rollout_diagnostics(info: RolloutInfo, state: RolloutState) -> list[Diagnostic]:
    """The rollout-level diagnostics: the store's, and a loss it has not taken yet (its
    ``store_failed`` calls added to the store's one, or one of its own)."""
    diagnostics = list(info.diagnostics)
    loss = state.unmarked_loss
    if loss is None:
        return diagnostics
    for i, d in enumerate(diagnostics):
        if d.kind == loss.kind:
            diagnostics[i] = d.with_call_ids_of(loss)
            return diagnostics
    return [*diagnostics, loss]


def diagnostics_json(
    info: RolloutInfo, records: list[CallRecord], state: RolloutState
) -> dict[str, Any]:
    """The view's ``diagnostics``: ``rollout`` (``rollout_diagnostics``) and ``calls_by_kind``
    (how many of the calls carry each kind)."""
    by_kind = Counter(d.kind for r in records for d in r.diagnostics)
    rollout_level = [d.to_json() for d in rollout_diagnostics(info, state)]
    return {"rollout": rollout_level, "calls_by_kind": dict(sorted(by_kind.items()))}
