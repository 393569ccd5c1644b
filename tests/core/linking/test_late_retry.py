"""A retry that comes before the attempt it retries is known (``core.linking.late_retry``): the
second look before the retry's call is stored, played command by command."""

from __future__ import annotations

from capture_proxy.core.linking.commands import AwaitAttempts, CatchUp
from capture_proxy.core.linking.digests import request_digest
from capture_proxy.core.linking.index import LinkIndex
from capture_proxy.core.linking.late_retry import attempt_key, late_retry_step
from capture_proxy.core.linking.parent_lookup import resolve_step
from tests.core.linking.steps import play

MINE, SIBLING = ("opencode", "ses_0"), ("opencode", "ses_1")
BODY = {"model": "m", "messages": [{"role": "user", "content": "Name a sea."}]}
DIGEST = request_digest(BODY)


class _Attempts:
    """``AttemptsInFlight`` of one process: every key it claimed."""

    def __init__(self) -> None:
        self.held: dict[str, str] = {}

    def claim(self, call_id: str, key: str) -> None:
        self.held[call_id] = key

    def release(self, call_id: str) -> None:
        self.held.pop(call_id, None)

    def claimed_elsewhere(self, key: str) -> bool:
        return False


def _resolve(index: LinkIndex, call_id: str, at: float, session, retry=False, attempts=None):
    step = resolve_step(
        index, "r1", BODY["messages"], BODY, call_id=call_id, created_at=at, session=session,
        retry_requested=retry, attempts=attempts,
    )  # fmt: skip
    return play(step, [])


def _lost_attempt(index: LinkIndex, at: float = 1.0, session=MINE, call_id: str = "f0") -> None:
    """The attempt stored incomplete (its harness left), as another worker stores it."""
    index.add(call_id, at, child_digest=None, request_digest=DIGEST, status="incomplete",
              session=session)  # fmt: skip


def test_only_a_retry_with_a_session_that_found_nothing_looks_again():
    attempts = _Attempts()
    index = LinkIndex()
    sibling = _resolve(index, "s1", 2.0, SIBLING, attempts=attempts)
    no_session = _resolve(index, "s2", 3.0, None, retry=True, attempts=attempts)
    retry = _resolve(index, "r0", 4.0, MINE, retry=True, attempts=attempts)
    assert (sibling.retry_session, no_session.retry_session) == (None, None)
    assert retry.retry_session == MINE and retry.retry_of is None
    # the calls that name their session are counted in flight, by request and session
    key = attempt_key("r1", DIGEST, MINE)
    assert attempts.held == {"s1": attempt_key("r1", DIGEST, SIBLING), "r0": key}
    for resolution in (sibling, no_session):  # nothing asked
        assert play(late_retry_step(resolution, rollout_id="r1", call_id="x"), []) is resolution
    _lost_attempt(index)  # known now: found at once
    assert _resolve(index, "r1", 5.0, MINE, retry=True).retry_session is None


def test_a_retry_whose_attempt_was_stored_after_it_came_names_it():
    """The attempt was in flight on another worker, its harness gone, when the retry came;
    stored there since: the caught-up index holds it."""
    index = LinkIndex()
    retry = _resolve(index, "r0", 2.0, MINE, retry=True)
    _lost_attempt(index)
    got = play(late_retry_step(retry, rollout_id="r1", call_id="r0"), [(CatchUp("r1"), index)])
    assert got.retry_of == "f0"
    assert got.candidates == retry.candidates and got.verdict is retry.verdict


def test_a_retry_waits_for_its_attempt_in_flight_on_another_worker():
    index = LinkIndex()
    retry = _resolve(index, "r0", 2.0, MINE, retry=True)
    caught_up = LinkIndex()
    _resolve(caught_up, "r0", 2.0, MINE, retry=True)
    _lost_attempt(caught_up)  # stored by the other worker meanwhile
    wait = AwaitAttempts(attempt_key("r1", DIGEST, MINE))
    script = [(CatchUp("r1"), index), (wait, True), (CatchUp("r1"), caught_up)]
    assert play(late_retry_step(retry, rollout_id="r1", call_id="r0"), script).retry_of == "f0"
    # nothing in flight elsewhere: no second catch-up, nothing to retry
    got = play(late_retry_step(retry, rollout_id="r1", call_id="r0"), script[:1] + [(wait, False)])
    assert got is retry


def test_a_late_look_takes_only_an_earlier_lost_attempt_of_its_own_session():
    index = LinkIndex()
    _lost_attempt(index, 1.0, SIBLING, "f1")  # a sibling sample's lost call
    retry = _resolve(index, "r0", 2.0, MINE, retry=True)
    assert retry.retry_of is None and retry.retry_session == MINE
    _lost_attempt(index, 3.0, MINE, "later")  # came after the retry: not what it retries
    assert index.late_retry_of("r0", DIGEST, MINE) is None
    _lost_attempt(index, 1.5, MINE, "f0")
    assert index.late_retry_of("r0", DIGEST, MINE) == "f0"
    index.add("other", 1.8, child_digest=None, request_digest=DIGEST, retry_of="f0",
              session=MINE)  # fmt: skip
    assert index.late_retry_of("r0", DIGEST, MINE) is None  # replaced already
    assert index.late_retry_of("unknown", DIGEST, MINE) is None
