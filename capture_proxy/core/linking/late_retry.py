"""A retry that comes before the attempt it retries is known: looked for again before it is
stored.

Owns the second look of a request that says it is a retry (an SDK's ``x-stainless-retry-count``
> 0) and names its harness session, but found no call to retry when it arrived
(``Resolution.retry_session``). With ``serve --workers`` the attempt it retries may still be
in flight on another worker, its harness gone (a harness that timed out re-sends at once; the
other worker finds it gone within ``CLIENT_CHECK_S`` and stores it incomplete): no worker's
index holds it yet. So before the retry's own call is stored, its index is caught up and the
attempt looked for again (``LinkIndex.late_retry_of``); while an identical request of the same
session is still in flight on another worker (``AttemptsInFlight``: each worker counts its
calls in flight by ``attempt_key``), the look waits for it to end, bounded (``AwaitAttempts``).
Without that look the retry was recorded with ``retry_of = None`` and the abandoned attempt left
incomplete and superseded by nobody (or, before a lost call was scoped to its session, by a
sibling sample that came first: trial 13).

Pure: a step of ``commands`` (``CatchUp``, ``AwaitAttempts``); ``proxy.linker.Linker`` drives it
before ``verification.verify_step``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from capture_proxy.core.linking.commands import AwaitAttempts, CatchUp, Step, ask
from capture_proxy.core.linking.resolution import Resolution


class AttemptsInFlight(Protocol):
    """The calls in flight of every process (``serve --workers``), counted by ``attempt_key``."""

    def claim(self, call_id: str, key: str) -> None:
        """``call_id`` (in flight here) has ``key``, until ``release(call_id)``."""
        ...

    def release(self, call_id: str) -> None:
        """``call_id`` ended: it no longer counts."""
        ...

    def claimed_elsewhere(self, key: str) -> bool:
        """True when a call in flight in another process has ``key``."""
        ...


def attempt_key(rollout_id: str, request_digest: str, session: tuple[str, str]) -> str:
    """What identical requests of one harness session in one rollout share (the attempts of
    one request: a retry's and the call it retries)."""
    return "\x1f".join((rollout_id, request_digest, *session))


def late_retry_step(
    resolution: Resolution,
    *,
    rollout_id: str,
    call_id: str,
    ends_incomplete: Callable[[str], bool] | None = None,
) -> Step[Resolution]:
    """``resolution`` with ``retry_of`` set when ``call_id`` (in flight, resolved to
    ``resolution``) is a retry whose attempt was not known when it arrived
    (``Resolution.retry_session``) and is known now: the rollout's index caught up, and again
    after the identical requests of its session in flight in other processes ended. Any other
    resolution is returned as it is, with no command asked."""
    session = resolution.retry_session
    if session is None or resolution.retry_of is not None:
        return resolution
    digest = resolution.request_digest
    index = yield from ask(CatchUp(rollout_id))
    target = index.late_retry_of(call_id, digest, session, ends_incomplete)
    if target is None and (yield from ask(AwaitAttempts(attempt_key(rollout_id, digest, session)))):
        index = yield from ask(CatchUp(rollout_id))
        target = index.late_retry_of(call_id, digest, session, ends_incomplete)
    if target is None:
        return resolution
    return dataclasses.replace(resolution, retry_of=target)
