"""The link index's maintained order (``LinkIndex._childless``, ``_latest_request``,
``_childless_requests``) answers as sorting every call of the digest would, and resolving
looks only at the childless calls of a digest that many calls share (``core.linking.index``)."""

import contextlib
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.core.linking import candidate_order
from capture_proxy.core.linking.index import IN_FLIGHT, LinkIndex
from capture_proxy.core.linking.resolution import Candidates

CALLS = [f"c{i}" for i in range(8)]
DIGESTS = ["d0", "d1"]
REQUESTS = ["q0", "q1"]
SESSIONS = [None, ("claude_code", "s0"), ("claude_code", "s1")]
HISTORIES = [None, b"h0", b"h1"]
KEY = {"num_tokens": 5, "tokens_sha256": b"x" * 32}

# One step: (call, created_at, child digest, request digest, status, verifiable, model,
# parent, retry_of, session, history); a call is filed in flight or stored, again and again,
# as the proxy does.
steps = st.lists(
    st.tuples(
        st.sampled_from(CALLS),
        st.sampled_from([1.0, 2.0, 3.0]),
        st.sampled_from([None, *DIGESTS]),
        st.sampled_from([None, *REQUESTS]),
        st.sampled_from([IN_FLIGHT, "complete", "failed", "incomplete"]),
        st.booleans(),
        st.sampled_from(["m", "n"]),
        st.sampled_from([None, *CALLS]),
        st.sampled_from([None, *CALLS]),
        st.sampled_from(SESSIONS),
        st.sampled_from(HISTORIES),
    ),
    max_size=40,
)


def _expected_candidates(
    index: LinkIndex,
    digest: str,
    model: str,
    session: tuple[str, str] | None = None,
    history: bytes | None = None,
) -> list[str]:
    """The candidates as a full sort of the digest's calls orders them (the rule): when a
    verifiable, not superseded one sent ``history``, those and the verifiable, not superseded
    ones whose history is not known first."""
    found = [e for e in index.entries.values() if e.child_digest == digest and e.model == model]
    ordered = sorted(found, key=candidate_order.preferring(session))
    fit = [e for e in ordered if e.num_tokens is not None and e.superseded_by is None]
    if history is None or not any(e.history == history for e in fit):
        return [e.call_id for e in ordered]
    same = [e for e in fit if e.history in (history, None)]
    return [e.call_id for e in [*same, *(e for e in ordered if e not in same)]]


def _expected_retry_target(
    index: LinkIndex, request: str, ending: frozenset[str] = frozenset()
) -> str | None:
    """The latest identical call whose harness is known not to have got its answer (stored
    failed or incomplete, or in flight and known to end so: ``ending``) that no retry
    superseded and no call continued, else None (the rule)."""
    lost = [
        e
        for e in index.entries.values()
        if e.request_digest == request
        and e.superseded_by is None
        and e.children == 0
        and (e.status in ("failed", "incomplete") or e.status == IN_FLIGHT and e.call_id in ending)
    ]
    return max(lost, key=lambda e: (e.created_at, e.call_id)).call_id if lost else None


@settings(max_examples=400, deadline=None)
@given(steps, st.frozensets(st.sampled_from(CALLS)))
def test_candidates_and_retry_target_are_what_a_full_sort_gives(ops, ending):
    index = LinkIndex()
    last_history: dict[str, bytes] = {}
    for call, at, child, request, status, verifiable, model, parent, retry, session, history in ops:
        index.add(
            call,
            at,
            child_digest=child,
            request_digest=request,
            status=status,
            model=model,
            parent_call_id=parent,
            retry_of=retry,
            session=session,
            history=history,
            **(KEY if verifiable else {}),
        )
        # a call filed without its history keeps the one it was filed with before
        if history is not None:
            last_history[call] = history
        assert index.entries[call].history == last_history.get(call)
        for digest in DIGESTS:
            for model_asked in ("m", "n"):
                for session_asked in SESSIONS:
                    for history_asked in HISTORIES:
                        got = index.resolve(
                            digest,
                            "q-new",
                            model=model_asked,
                            session=session_asked,
                            history=history_asked,
                        )
                        want = _expected_candidates(
                            index, digest, model_asked, session_asked, history_asked
                        )
                        assert [c.call_id for c in got.candidates] == want
                        assert got.parent_call_id == (want[0] if want else None)
        for request in REQUESTS:
            # only calls in flight are asked whether they end incomplete
            asked: list[str] = []
            ends_incomplete = lambda c, asked=asked: asked.append(c) or c in ending  # noqa: E731
            got = index.resolve(None, request, ends_incomplete=ends_incomplete).retry_of
            assert got == _expected_retry_target(index, request, ending)
            assert all(index.entries[c].status == IN_FLIGHT for c in asked)
        children = {c: 0 for c in index.entries}
        for e in index.entries.values():
            if e.counted_parent in children:
                children[e.counted_parent] += 1
        # the children counts the order uses are the calls counted as children
        assert {c: e.children for c, e in index.entries.items()} == children


def _alike_sessions(childless: int) -> LinkIndex:
    """1,000 sessions of one rollout whose first answers were alike (one child digest "d"),
    each continued by its own second call, and ``childless`` first calls after them
    (a1000, ...) without a child yet."""
    index = LinkIndex()
    for i in range(1000):
        index.add(f"a{i}", float(i), child_digest="d", request_digest="q", status="complete", **KEY)
        index.add(f"b{i}", i + 0.5, child_digest=f"e{i}", request_digest=f"r{i}",
                  status="complete", parent_call_id=f"a{i}", **KEY)  # fmt: skip
    for i in range(1000, 1000 + childless):
        index.add(f"a{i}", float(i), child_digest="d", request_digest="q", status="complete", **KEY)
    return index


@contextlib.contextmanager
def _preferences_looked() -> Iterator[list[str]]:
    """The call ids ``candidate_order._preference`` is asked about meanwhile, in order."""
    looked: list[str] = []
    preference = candidate_order._preference
    candidate_order._preference = lambda e: looked.append(e.call_id) or preference(e)
    try:
        yield looked
    finally:
        candidate_order._preference = preference


def test_a_digest_shared_by_many_calls_resolves_from_its_childless_calls():
    # A new session's second call resolves to its own first call, the one without a child,
    # without ordering the 1,000 others.
    index = _alike_sessions(1)
    with _preferences_looked() as looked:
        got = index.resolve("d", "r-new", model=None)
        first = got.candidates[0]
        assert looked == ["a1000"]
        assert (got.parent_call_id, first.call_id, first.num_tokens) == ("a1000", "a1000", 5)
        # the rest, asked for, in the rule's order: earliest first (all have a child)
        assert isinstance(got.candidates, Candidates)
        assert [c.call_id for c in got.candidates][:3] == ["a1000", "a0", "a1"]
        assert len(got.candidates) == 1001
    # the shared first request's retry target: none while every identical call was answered;
    # the latest once it failed
    assert index.resolve(None, "q").retry_of is None
    index.add("a1001", 1001.0, child_digest=None, request_digest="q", status="failed")
    assert index.resolve(None, "q").retry_of == "a1001"


def test_claims_elsewhere_keep_the_resolution_to_the_childless_calls():
    # The same 1,000 sessions with children, and two childless first calls, the earlier one
    # claimed by a call in flight on another worker: the later one is first, and still only
    # the childless calls are ordered until a reader goes past them.
    index = _alike_sessions(2)
    with _preferences_looked() as looked:
        got = index.resolve("d", "r-new", model=None, claimed={"a1000"}.__contains__)
        assert (got.parent_call_id, got.candidates[0].call_id) == ("a1001", "a1001")
        assert looked == ["a1001"]
        # the rest, asked for: the claimed one among those with a child, by age
        assert [c.call_id for c in got.candidates][:3] == ["a1001", "a0", "a1"]
        assert [c.call_id for c in got.candidates][-2:] == ["a999", "a1000"]
        assert len(got.candidates) == 1002
    # every childless call claimed: all are ordered, the claimed ones by age among the rest
    every = index.resolve("d", "r-new", model=None, claimed={"a1000", "a1001"}.__contains__)
    assert [c.call_id for c in every.candidates][:2] == ["a0", "a1"]
    assert [c.call_id for c in every.candidates][-2:] == ["a1000", "a1001"]
