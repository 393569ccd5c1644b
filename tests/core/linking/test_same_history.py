"""Sessions of one rollout that answered alike share a child digest (the digest chains the
model's turns only); a continuation's first candidate is the call whose request sent the very
history it continues (``candidate_order._same_history_first``), so it is counted, and claimed, as
that call's child while in flight, and its session's next call does not go past a wrong
first candidate to the digest's other calls."""

from __future__ import annotations

import numpy as np

from capture_proxy.core.capture import prepare_request
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.linking.index import LinkIndex, add_record
from capture_proxy.core.linking.parent_lookup import resolve_step
from capture_proxy.core.records import CallRecord
from capture_proxy.core.stored_form import MessageDigests
from tests.core.linking.steps import play
from tests.core.linking.test_siblings_in_flight import _SharedClaims

ANSWER = {"role": "assistant", "content": "Scripted session"}
KNOWN = KnownMessages()


def _task(session: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"Task {session}."},
    ]


def _continued(session: str) -> list[dict]:
    return [*_task(session), ANSWER, {"role": "user", "content": "Continue."}]


def _resolve(index: LinkIndex, call_id: str, at: float, messages: list[dict], claims=None):
    """``resolve_step`` as the flow asks it: the request prepared with its messages' facts
    (``PreparedRequest.history_keys``)."""
    body = {"model": "m", "messages": messages}
    prepared = prepare_request(body, None, KNOWN.facts(messages))
    step = resolve_step(
        index,
        "r1",
        prepared.linking_messages,
        prepared.body,
        call_id=call_id,
        created_at=at,
        linking_facts=prepared.linking_facts,
        claims=claims,
        history_keys=prepared.history_keys,
    )
    return play(step, [])


def _first_call(call_id: str, at: float, session: str) -> CallRecord:
    return CallRecord(
        call_id=call_id,
        rollout_id="r1",
        created_at=at,
        model="m",
        request_messages=_task(session),
        response_message={"content": ANSWER["content"]},
        prompt_token_ids=np.asarray([1, 2, 3], np.uint32),
        generation_token_ids=np.asarray([4, 5], np.uint32),
        generation_log_probs=np.full(2, -0.5, np.float32),
    )


def _sessions(index: LinkIndex, count: int) -> None:
    """``count`` sessions' first calls, filed in flight (as roots) and stored, s0 first."""
    for i in range(count):
        _resolve(index, f"s{i}-1", float(i), _task(f"s{i}"))
        add_record(index, _first_call(f"s{i}-1", float(i), f"s{i}"))


def test_a_continuation_takes_the_call_that_sent_its_history_first():
    index = LinkIndex()
    _sessions(index, 2)
    assert index.entries["s0-1"].child_digest == index.entries["s1-1"].child_digest
    # s1's continuation comes first: by age it would take s0's call, still childless
    got = _resolve(index, "s1-2", 3.0, _continued("s1"))
    assert [c.call_id for c in got.candidates] == ["s1-1", "s0-1"]
    assert got.parent_call_id == "s1-1"
    # counted as s1's child while in flight: s0's continuation still finds its own first
    got = _resolve(index, "s0-2", 4.0, _continued("s0"))
    assert [c.call_id for c in got.candidates] == ["s0-1", "s1-1"]
    assert (index.entries["s0-1"].children, index.entries["s1-1"].children) == (1, 1)


def test_without_the_history_the_order_is_as_before():
    # The rule the history breaks: earliest childless first (what a call filed without
    # facts, or an index entry read whole from the store, still gets).
    index = LinkIndex()
    _sessions(index, 2)
    body = {"model": "m", "messages": _continued("s1")}
    got = play(resolve_step(index, "r1", _continued("s1"), body, call_id="x", created_at=3.0), [])
    assert [c.call_id for c in got.candidates] == ["s0-1", "s1-1"]


def test_the_history_goes_before_a_wrong_claim():
    # 1,000 sessions answered alike; s500's first call is claimed elsewhere by a call that
    # took it first by age (the wrong one): s500's own continuation still takes it first;
    # the rest keeps the claims' order (the unclaimed by age, the claimed one last), made
    # only when asked.
    index = LinkIndex()
    _sessions(index, 1000)
    claims = _SharedClaims()
    claims.claim("elsewhere", "s500-1")
    got = _resolve(index, "s500-2", 2000.0, _continued("s500"), claims)
    assert got.parent_call_id == "s500-1"
    assert [c.call_id for c in got.candidates._head] == ["s500-1"]
    assert got.candidates._all is None  # the rest not made yet
    others = [f"s{i}-1" for i in range(1000) if i != 500]
    assert [c.call_id for c in got.candidates] == ["s500-1", *others]


def test_twins_with_one_history_keep_the_childless_first():
    # Two sessions with the very same history (a deterministic engine, one task): both sent
    # it, so the childless one comes first, as before.
    index = LinkIndex()
    for call_id, at in (("a1", 1.0), ("b1", 2.0)):
        _resolve(index, call_id, at, _task("same"))
        add_record(index, _first_call(call_id, at, "same"))
    first = _resolve(index, "a2", 3.0, _continued("same"))
    second = _resolve(index, "b2", 4.0, _continued("same"))
    assert (first.parent_call_id, second.parent_call_id) == ("a1", "b1")
    assert [c.call_id for c in second.candidates] == ["b1", "a1"]


def test_history_keys_are_chain_digests_of_the_linking_history():
    plain = _continued("s0")
    prepared = prepare_request({"model": "m", "messages": plain}, None, KNOWN.facts(plain))
    own, continued = prepared.history_keys
    assert own == MessageDigests.of(plain).chain[-1]
    assert continued == MessageDigests.of(plain[:2]).chain[-1]
    # the continued key of a child is the own key of the call that sent that history
    first = prepare_request({"model": "m", "messages": _task("s0")}, None, KNOWN.facts(_task("s0")))
    assert first.history_keys == (continued, None)
    # a prefill (a trailing assistant message) is the call's own turn: left out of both
    prefilled = [*plain, {"role": "assistant", "content": "Sure,"}]
    body = {"model": "m", "messages": prefilled, "continue_final_message": True,
            "add_generation_prompt": False}  # fmt: skip
    prepared = prepare_request(body, None, KNOWN.facts(prefilled))
    assert prepared.prefill is not None
    assert prepared.history_keys == (own, continued)
    # no facts, no keys
    assert prepare_request({"model": "m", "messages": plain}, None).history_keys == (None, None)
