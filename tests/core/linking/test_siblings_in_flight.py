"""Two identical sub-agents in flight at once stay two chains (the "no child yet" tie-break
counts children in flight, not only stored ones)."""

from __future__ import annotations

import numpy as np

from capture_proxy.core.chains import build_chains
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
