"""The request-time lookup step without an event loop: refresh on a miss, calls in flight."""

from __future__ import annotations

import numpy as np

from capture_proxy.core.linking.commands import ReadParentCandidates
from capture_proxy.core.linking.digests import history_digest, request_digest
from capture_proxy.core.linking.index import IN_FLIGHT, LinkIndex, add_record
from capture_proxy.core.linking.parent_lookup import resolve_step
from capture_proxy.core.linking.verdicts import ReasonKind, Verdict
from capture_proxy.core.records import CallRecord
from tests.core.linking.steps import play

USER = {"role": "user", "content": "list the files"}
HISTORY = [USER, {"role": "assistant", "content": "ls"}, {"role": "user", "content": "more"}]
BODY = {"model": "m", "messages": HISTORY}

PARENT = CallRecord(
    call_id="p",
    rollout_id="r1",
    created_at=1.0,
    model="m",
    request_messages=[USER],
    response_message={"content": "ls"},
    prompt_token_ids=np.asarray([1, 2, 3], np.uint32),
    generation_token_ids=np.asarray([4, 5], np.uint32),
    generation_log_probs=np.full(2, -0.5, np.float32),
)


def _step(index: LinkIndex, *, refresh_on_miss: bool, call_id: str = "c"):
    return resolve_step(
        index,
        "r1",
        HISTORY,
        BODY,
        call_id=call_id,
        created_at=2.0,
        refresh_on_miss=refresh_on_miss,
    )


def test_a_hit_asks_nothing_and_registers_the_call_in_flight():
    index = LinkIndex()
    add_record(index, PARENT)
    got = play(_step(index, refresh_on_miss=True), [])
    assert (got.verdict, got.parent_call_id) == (Verdict.RESOLVED, "p")
    assert (got.parent_digest, got.request_digest) == (
        history_digest(HISTORY),
        request_digest(BODY),
    )
    entry = index.entries["c"]
    assert (entry.status, entry.request_digest, entry.model) == (
        IN_FLIGHT,
        request_digest(BODY),
        "m",
    )


def test_a_miss_reads_the_calls_under_its_parent_digest_once_and_resolves_again():
    index = LinkIndex()
    ask = ReadParentCandidates("r1", history_digest(HISTORY))
    got = play(_step(index, refresh_on_miss=True), [(ask, [PARENT])])
    assert (got.verdict, got.parent_call_id) == (Verdict.RESOLVED, "p")
    assert sorted(index.entries) == ["c", "p"]


def test_a_miss_still_unresolved_after_the_refresh_keeps_its_reason():
    index = LinkIndex()
    ask = ReadParentCandidates("r1", history_digest(HISTORY))
    got = play(_step(index, refresh_on_miss=True), [(ask, [])])
    assert got.verdict is Verdict.UNRESOLVED and got.reason.kind is ReasonKind.NO_MATCH


def test_without_refresh_on_miss_a_miss_asks_nothing():
    got = play(_step(LinkIndex(), refresh_on_miss=False), [])
    assert got.verdict is Verdict.UNRESOLVED and got.reason.kind is ReasonKind.NO_MATCH


def test_a_root_asks_nothing_even_with_refresh_on_miss():
    index = LinkIndex()
    step = resolve_step(
        index,
        "r1",
        [USER],
        {"model": "m", "messages": [USER]},
        call_id="c",
        created_at=2.0,
        refresh_on_miss=True,
    )
    assert play(step, []).verdict is Verdict.ROOT
