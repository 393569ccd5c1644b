"""Tier 1: which incomplete calls a complete retry supersedes (``core.completeness``)."""

from __future__ import annotations

import itertools

from capture_proxy.core.completeness import (
    RetryLink,
    superseded_by_retries,
    unsuperseded_incomplete,
)

OK, CUT, FAILED = "complete", "incomplete", "failed"


def test_a_complete_retry_supersedes_the_cut_off_call():
    calls = [RetryLink("a", CUT), RetryLink("b", OK, retry_of="a")]
    assert superseded_by_retries(calls) == {"a"}
    assert unsuperseded_incomplete(calls) == []


def test_an_incomplete_or_failed_retry_supersedes_nothing():
    for status in (CUT, FAILED):
        calls = [RetryLink("a", CUT), RetryLink("b", status, retry_of="a")]
        assert superseded_by_retries(calls) == frozenset()
        assert unsuperseded_incomplete(calls) == (["a", "b"] if status == CUT else ["a"])


def test_a_complete_retry_supersedes_the_whole_chain_of_attempts_in_any_order():
    calls = [
        RetryLink("a", CUT),
        RetryLink("b", CUT, retry_of="a"),
        RetryLink("c", FAILED, retry_of="b"),
        RetryLink("d", OK, retry_of="c"),
        RetryLink("x", CUT),  # another request, never retried
        RetryLink("y", CUT, retry_of="z"),  # a cut-off retry of a call not given
        RetryLink("w", OK, retry_of="v"),  # a complete retry of a call not given
    ]
    for order in itertools.permutations(calls):
        assert superseded_by_retries(order) == {"a", "b", "c", "v"}
        assert unsuperseded_incomplete(order) == ["x", "y"]


def test_a_retry_of_a_complete_call_changes_nothing_and_duplicates_count_once():
    calls = [
        RetryLink("a", OK),
        RetryLink("b", CUT, retry_of="a"),  # the retry was cut off: incomplete
        RetryLink("b", CUT, retry_of="a"),
    ]
    assert unsuperseded_incomplete(calls) == ["b"]


def test_a_cycle_ends_the_walk():
    calls = [RetryLink("a", OK, retry_of="b"), RetryLink("b", CUT, retry_of="a")]
    assert superseded_by_retries(calls) == {"b"}
    assert unsuperseded_incomplete(calls) == []
