"""Two identical sub-agents in flight at once stay two chains (the "no child yet" tie-break
counts children in flight, not only stored ones)."""

from __future__ import annotations

import contextlib

import numpy as np

from capture_proxy.core.chains import build_chains
from capture_proxy.core.linking.commands import CatchUp
from capture_proxy.core.linking.index import LinkIndex, add_record
from capture_proxy.core.linking.parent_lookup import resolve_step
from capture_proxy.core.linking.verification import verify_step
from capture_proxy.core.records import CallRecord, CallStatus
from tests.core.linking.steps import play

TASK = [{"role": "user", "content": "count the files"}]
ANSWER = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    ],
}
HISTORY = [*TASK, ANSWER, {"role": "tool", "tool_call_id": "call_0", "content": "a b"}]


FIRST_ANSWER = {k: v for k, v in ANSWER.items() if k != "role"}


def _call(call_id: str, created_at: float, prompt: list[int], messages=HISTORY) -> CallRecord:
    """A first call (``messages=TASK``: it answers with the tool call) or a continuation."""
    first = messages is TASK
    generation = [3, 4] if first else [6]
    return CallRecord(
        call_id=call_id,
        rollout_id="r1",
        created_at=created_at,
        model="m",
        request_messages=messages,
        response_message=FIRST_ANSWER if first else {"content": "2 files"},
        prompt_token_ids=np.asarray(prompt, np.uint32),
        generation_token_ids=np.asarray(generation, np.uint32),
        generation_log_probs=np.full(len(generation), -0.5, np.float32),
    )


def _resolve(index: LinkIndex, call_id: str, created_at: float):
    body = {"model": "m", "messages": HISTORY}
    return play(
        resolve_step(index, "r1", HISTORY, body, call_id=call_id, created_at=created_at), []
    )


def _verified(record: CallRecord, resolution) -> CallRecord:
    step = verify_step(
        record, resolution, HISTORY, harness_note=None, retry_count=None, can_decode=False
    )
    return play(step, [])  # both candidates verify by digest: no parent is read


def test_two_identical_sub_agents_in_flight_at_once_are_two_chains():
    index = LinkIndex()
    first_a = _call("a1", 1.0, [1, 2], TASK)
    first_b = _call("b1", 2.0, [1, 2], TASK)
    for record in (first_a, first_b):
        add_record(index, record)
    # Both continuations arrive before either is stored: the second must not take the
    # first's parent although that one has no stored child yet.
    resolution_a = _resolve(index, "a2", 3.0)
    resolution_b = _resolve(index, "b2", 4.0)
    assert [c.call_id for c in resolution_a.candidates] == ["a1", "b1"]
    assert [c.call_id for c in resolution_b.candidates] == ["b1", "a1"]
    second_a = _verified(_call("a2", 3.0, [1, 2, 3, 4, 5]), resolution_a)
    second_b = _verified(_call("b2", 4.0, [1, 2, 3, 4, 5]), resolution_b)
    assert (second_a.parent_call_id, second_b.parent_call_id) == ("a1", "b1")
    for record in (second_b, second_a):
        add_record(index, record)
    # Once stored, each first call has one child: in flight nothing is counted twice.
    assert (index.entries["a1"].children, index.entries["b1"].children) == (1, 1)
    chains = build_chains("r1", [first_a, first_b, second_a, second_b])
    assert [[c.call_id for c in chain.calls] for chain in chains.chains] == [
        ["a1", "a2"],
        ["b1", "b2"],
    ]


def test_a_continuation_in_flight_that_is_not_linked_releases_its_count():
    index = LinkIndex()
    add_record(index, _call("a1", 1.0, [1, 2], TASK))
    add_record(index, _call("b1", 2.0, [1, 2], TASK))
    _resolve(index, "a2", 3.0)
    assert (index.entries["a1"].children, index.entries["b1"].children) == (1, 0)
    failed = _call("a2", 3.0, [1, 2, 3, 4, 5]).replace(status=CallStatus.FAILED)
    add_record(index, failed)
    assert (index.entries["a1"].children, index.entries["b1"].children) == (0, 0)
    assert [c.call_id for c in _resolve(index, "b2", 4.0).candidates] == ["a1", "b1"]


class _SharedClaims:
    """``ChildClaims`` as one dict every "worker" sees (the shape of ``ChildClaimBoard``
    without its file): parent call id -> how many calls in flight took it."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.held: dict[str, str] = {}
        self.locks = 0

    @contextlib.contextmanager
    def locked(self):
        self.locks += 1
        yield

    def claimed(self, parent_call_id: str) -> bool:
        return self.counts.get(parent_call_id, 0) > 0

    def claim(self, call_id: str, parent_call_id: str) -> None:
        self.counts[parent_call_id] = self.counts.get(parent_call_id, 0) + 1
        self.held[call_id] = parent_call_id

    def release(self, call_id: str) -> None:
        parent = self.held.pop(call_id, None)
        if parent is not None:
            self.counts[parent] -= 1


def _resolve_on(index: LinkIndex, call_id: str, created_at: float, claims=None):
    body = {"model": "m", "messages": HISTORY}
    step = resolve_step(
        index, "r1", HISTORY, body, call_id=call_id, created_at=created_at, claims=claims
    )
    return play(step, [])


def test_identical_sub_agents_continued_at_once_on_two_workers_take_two_parents():
    """Two workers, each with both first calls stored: a continuation in flight on worker 1
    is invisible to worker 2's index; the shared claims make it count there."""
    first_a = _call("a1", 1.0, [1, 2], TASK)
    first_b = _call("b1", 2.0, [1, 2], TASK)
    worker_1, worker_2, alone = LinkIndex(), LinkIndex(), LinkIndex()
    for index in (worker_1, worker_2, alone):
        add_record(index, first_a)
        add_record(index, first_b)
    claims = _SharedClaims()
    on_1 = _resolve_on(worker_1, "a2", 3.0, claims)
    on_2 = _resolve_on(worker_2, "b2", 4.0, claims)
    assert [c.call_id for c in on_1.candidates] == ["a1", "b1"]
    assert [c.call_id for c in on_2.candidates] == ["b1", "a1"]
    assert claims.counts == {"a1": 1, "b1": 1} and claims.locks == 2
    # What worker 2 chose without them: worker 1's parent.
    assert _resolve_on(alone, "b2", 4.0).parent_call_id == "a1"
    second_a = _verified(_call("a2", 3.0, [1, 2, 3, 4, 5]), on_1)
    second_b = _verified(_call("b2", 4.0, [1, 2, 3, 4, 5]), on_2)
    assert (second_a.parent_call_id, second_b.parent_call_id) == ("a1", "b1")
    for call_id in ("a2", "b2"):
        claims.release(call_id)
    assert claims.counts == {"a1": 0, "b1": 0}
    # Stored (and read by the other worker's index), each first call has its one child.
    for index in (worker_1, worker_2):
        add_record(index, second_a)
        add_record(index, second_b)
        assert (index.entries["a1"].children, index.entries["b1"].children) == (1, 1)


def test_a_continuation_claims_its_parent_while_its_twins_first_call_is_in_flight():
    """Two identical sessions started at once on two workers: worker 1 continues a1 while b1
    is still in flight there (one candidate in its index), worker 2 continues b1 once both
    are stored (two candidates). Worker 1's claim makes worker 2 take b1, not a1 again (a
    branch under a1 and b1 left alone: two identical samples for the trainer)."""
    first_a = _call("a1", 1.0, [1, 2], TASK)
    first_b = _call("b1", 2.0, [1, 2], TASK)
    worker_1, worker_2, alone = LinkIndex(), LinkIndex(), LinkIndex()
    add_record(worker_1, first_a)
    worker_1.add("b1", 2.0, child_digest=None, request_digest="rq-b1", model="m")
    for index in (worker_2, alone):
        add_record(index, first_a)
        add_record(index, first_b)
    claims = _SharedClaims()
    on_1 = _resolve_on(worker_1, "a2", 3.0, claims)
    assert on_1.parent_call_id == "a1" and claims.counts == {"a1": 1}
    on_2 = _resolve_on(worker_2, "b2", 4.0, claims)
    assert [c.call_id for c in on_2.candidates] == ["b1", "a1"]
    assert claims.counts == {"a1": 1, "b1": 1} and claims.locks == 2
    # What worker 2 chose without worker 1's claim: a1, taken already.
    assert _resolve_on(alone, "b2", 4.0).parent_call_id == "a1"


def test_a_root_claims_nothing():
    claims = _SharedClaims()
    body = {"model": "m", "messages": TASK}
    step = resolve_step(LinkIndex(), "r1", TASK, body, call_id="a1", created_at=1.0, claims=claims)
    assert play(step, []).parent_call_id is None
    assert claims.locks == 0 and claims.counts == {}


def test_a_claimed_parent_is_taken_when_every_other_candidate_has_a_child():
    """Claims order the candidates; they never remove one: when all are taken, the
    earliest (as for one process's calls in flight)."""
    index = LinkIndex()
    add_record(index, _call("a1", 1.0, [1, 2], TASK))
    add_record(index, _call("b1", 2.0, [1, 2], TASK))
    claims = _SharedClaims()
    claims.claim("x2", "a1")
    claims.claim("y2", "b1")
    resolution = _resolve_on(index, "z2", 5.0, claims)
    assert [c.call_id for c in resolution.candidates] == ["a1", "b1"]
    assert claims.counts == {"a1": 2, "b1": 1}


def test_a_claim_released_after_the_index_was_brought_up_makes_the_step_catch_up():
    """Worker 1's continuation of a1 is stored and its claim released between worker 2's
    catch-up and its look at the claims: no claim and no stored child in worker 2's index.
    The index is not current (the rollout's count moved), so the step asks ``CatchUp`` and
    chooses again from the index that holds the stored child."""
    first_a = _call("a1", 1.0, [1, 2], TASK)
    first_b = _call("b1", 2.0, [1, 2], TASK)
    second_a = _call("a2", 3.0, [1, 2, 3, 4, 5]).replace(parent_call_id="a1")
    stale, caught_up = LinkIndex(), LinkIndex()
    for index in (stale, caught_up):
        add_record(index, first_a)
        add_record(index, first_b)
    add_record(caught_up, second_a)
    claims = _SharedClaims()  # a2's claim: already released
    currents = iter([False, True])
    body = {"model": "m", "messages": HISTORY}
    step = resolve_step(
        stale, "r1", HISTORY, body, call_id="b2", created_at=4.0, claims=claims,
        index_current=lambda: next(currents),
    )  # fmt: skip
    resolution = play(step, [(CatchUp("r1"), caught_up)])
    assert resolution.parent_call_id == "b1"
    assert [c.call_id for c in resolution.candidates] == ["b1", "a1"]
    assert claims.counts == {"b1": 1} and claims.locks == 2
    assert caught_up.entries["b2"].counted_parent == "b1"  # in flight in the current index


def test_a_sibling_sent_while_a_failed_calls_retry_is_in_flight_is_no_retry():
    """A GRPO group: sample 1's first call failed; its retry is in flight when sample 2's
    first call arrives, identical. The retry replaced the failed call at once (in flight), so
    sample 2 is a sample of its own, not a second retry of that call (review: both were
    retries, and the chains kept one of the two answered samples)."""
    body = {"model": "m", "messages": TASK}
    index = LinkIndex()

    def resolve(call_id: str, created_at: float):
        step = resolve_step(index, "r1", TASK, body, call_id=call_id, created_at=created_at)
        return play(step, [])

    failed = resolve("s1", 1.0)
    assert failed.retry_of is None
    # stored failed (the engine's 500)
    index.add("s1", 1.0, child_digest=None, request_digest=failed.request_digest, status="failed")
    retry = resolve("s1r", 2.0)  # in flight
    assert retry.retry_of == "s1"
    sibling = resolve("s2", 3.0)
    assert sibling.retry_of is None
    assert index.entries["s1"].superseded_by == "s1r"
