"""The per-rollout link index: candidates, retries, unmatched histories (``core.linking.index``)."""

import numpy as np

from capture_proxy.core.chains import build_chains
from capture_proxy.core.linking.index import LinkIndex
from capture_proxy.core.linking.verdicts import ReasonKind, Verdict
from tests.factories import record


class TestIndex:
    def test_verdicts(self):
        index = LinkIndex()
        index.add("a", 1.0, child_digest="d1", request_digest="q1")
        assert index.resolve(None, "q0").verdict is Verdict.ROOT
        res = index.resolve("d1", "q2")
        assert (res.verdict, res.parent_call_id, res.retry_of) == (Verdict.RESOLVED, "a", None)
        res = index.resolve("zz", "q2")
        assert res.verdict is Verdict.UNRESOLVED and res.reason.kind is ReasonKind.NO_MATCH
        assert res.reason.text == "no captured call produced the last model-authored turn"

    def test_an_identical_request_retries_only_a_call_whose_answer_was_not_given(self):
        index = LinkIndex()
        index.add("a", 1.0, child_digest="d1", request_digest="q1", status="complete")
        # Identical and the earlier one answered: a sibling sample, not a retry.
        assert index.resolve(None, "q1").retry_of is None
        # The latest identical call failed or was left incomplete: its retry.
        index.add("a3", 3.0, child_digest=None, request_digest="q1", status="failed")
        assert index.resolve(None, "q1").retry_of == "a3"
        index.add("a3", 3.0, child_digest=None, request_digest="q1", status="incomplete")
        assert index.resolve(None, "q1").retry_of == "a3"

    def test_a_samples_retry_never_replaces_another_samples_answered_call(self):
        """A GRPO group: four samples of one prompt in one rollout, none continued yet (single
        turn). Sample 3's first attempt failed (stored failed), samples 1, 2 and 4 were
        answered, 4 after the failure; sample 3's SDK retries. The retry replaces the failed
        attempt, not the latest identical call (sample 4's answer, which its harness got). A
        retry whose first attempt never reached the proxy (an SDK's retry header, nothing
        failed here) replaces nothing: it is a sample of its own (trial 12: the group's
        export lost a sample that way)."""
        index = LinkIndex()
        index.add("s1", 1.0, child_digest="d1", request_digest="q", status="complete")
        index.add("s2", 2.0, child_digest="d2", request_digest="q", status="complete")
        index.add("s3", 3.0, child_digest=None, request_digest="q", status="failed")
        index.add("s4", 4.0, child_digest="d4", request_digest="q", status="complete")
        assert index.resolve(None, "q").retry_of == "s3"
        index.add("s3r", 5.0, child_digest="d3", request_digest="q", retry_of="s3",
                  status="complete")  # fmt: skip
        assert {c: e.superseded_by for c, e in index.entries.items()} == {
            "s1": None, "s2": None, "s3": "s3r", "s4": None, "s3r": None,
        }  # fmt: skip
        # a fifth sample's retry whose first attempt never arrived: no call to replace
        assert index.resolve(None, "q").retry_of is None

    def test_an_identical_call_in_flight_is_retried_once_known_to_end_incomplete(self):
        """Codex re-sends a request whose stream it dropped (no retry header) while the call
        is still in flight: its retry when that call is known to end incomplete (its harness
        left); a twin session's identical call in flight, whose harness is there, is not."""
        index = LinkIndex()
        index.add("a", 1.0, child_digest=None, request_digest="q1")  # in flight
        gone: set[str] = set()
        assert index.resolve(None, "q1", ends_incomplete=gone.__contains__).retry_of is None
        gone.add("a")
        assert index.resolve(None, "q1", ends_incomplete=gone.__contains__).retry_of == "a"
        # stored: its status decides, the fact is not asked
        index.add("a", 1.0, child_digest="d1", request_digest="q1", status="complete")
        assert index.resolve(None, "q1", ends_incomplete=gone.__contains__).retry_of is None

    def test_candidates_prefer_no_child_yet_then_the_earliest(self):
        # Parallel sub-agents A and B answered alike (one child digest): A1, B1, then A2.
        index = LinkIndex()
        key = {"num_tokens": 5, "tokens_sha256": b"x" * 32}
        index.add("A1", 1.0, child_digest="d", request_digest="qa", status="complete", **key)
        index.add("B1", 2.0, child_digest="d", request_digest="qb", status="complete", **key)
        got = index.resolve("d", "qa2")
        assert [c.call_id for c in got.candidates] == ["A1", "B1"]
        assert got.parent_call_id == "A1"
        # A2 took A1 as its parent: B2 now prefers B1, which has no child yet.
        index.add(
            "A2",
            3.0,
            child_digest="dA2",
            request_digest="qa2",
            status="complete",
            parent_call_id="A1",
            **key,
        )
        got = index.resolve("d", "qb2")
        assert [c.call_id for c in got.candidates] == ["B1", "A1"]

    def test_twin_sessions_token_identical_calls_each_continue_their_own_session(self):
        # Two harness sessions of one task (a deterministic engine, one project dir) whose
        # first calls are token-identical; session B's continuation arrives first. By age it
        # took A's call (trial 11: chains holding calls of two sessions); the session each
        # request names (core.sessions) breaks the tie.
        index = LinkIndex()
        key = {"num_tokens": 5, "tokens_sha256": b"x" * 32, "status": "complete"}
        a, b = ("claude_code", "sess-a"), ("claude_code", "sess-b")
        index.add("A1", 1.0, child_digest="d", request_digest="q", session=a, **key)
        index.add("B1", 2.0, child_digest="d", request_digest="q", session=b, **key)
        assert [c.call_id for c in index.resolve("d", "q2", session=b).candidates] == ["B1", "A1"]
        assert [c.call_id for c in index.resolve("d", "q2", session=a).candidates] == ["A1", "B1"]
        # a request that names no session, or one no candidate names: by age
        assert index.resolve("d", "q2").parent_call_id == "A1"
        assert index.resolve("d", "q2", session=("codex", "sess-b")).parent_call_id == "A1"
        # only a tie-breaker: a call without a child comes before the own session's that has
        # one (else one chain would branch and the twin's be left behind)
        index.add("B2", 3.0, child_digest="dB2", request_digest="q2", parent_call_id="B1",
                  session=b, **key)  # fmt: skip
        assert [c.call_id for c in index.resolve("d", "q3", session=b).candidates] == ["A1", "B1"]

    def test_a_retry_continues_the_parent_of_the_call_it_replaces(self):
        # Twin sessions a and b, token-identical first calls A1 and B1. A2 continues A1; its
        # harness leaves while A2 is in flight, and Codex re-sends A2's request. The re-send
        # retries A2, so it continues A1 (which A2 still counts as a child of), not B1, the
        # twin's call without a child (that would swap the twins' chains: review).
        index = LinkIndex()
        key = {"num_tokens": 5, "tokens_sha256": b"x" * 32}
        a, b = ("codex", "sess-a"), ("codex", "sess-b")
        index.add("A1", 1.0, child_digest="d", request_digest="q1", status="complete",
                  session=a, **key)  # fmt: skip
        index.add("B1", 2.0, child_digest="d", request_digest="q1", status="complete",
                  session=b, **key)  # fmt: skip
        index.add("A2", 3.0, child_digest=None, request_digest="q2", parent_call_id="A1",
                  session=a)  # fmt: skip
        gone = {"A2"}.__contains__
        got = index.resolve("d", "q2", session=a, ends_incomplete=gone)
        assert (got.retry_of, got.parent_call_id) == ("A2", "A1")
        assert [c.call_id for c in got.candidates] == ["A1", "B1"]
        # the same once A2 is stored incomplete (a harness retry header, or its status)
        index.add("A2", 3.0, child_digest=None, request_digest="q2", parent_call_id="A1",
                  status="incomplete", session=a)  # fmt: skip
        got = index.resolve("d", "q2", session=a)
        assert (got.retry_of, got.parent_call_id) == ("A2", "A1")
        # the twin's own next request still takes its own call
        assert index.resolve("d", "q2b", session=b).parent_call_id == "B1"

    def test_a_retry_supersedes_the_call_it_retried_as_a_candidate(self):
        index = LinkIndex()
        key = {"num_tokens": 5, "tokens_sha256": b"x" * 32}
        index.add("a", 1.0, child_digest="d1", request_digest="q1", status="complete", **key)
        index.add(
            "a2",
            2.0,
            child_digest="d1",
            request_digest="q1",
            status="complete",
            retry_of="a",
            **key,
        )
        assert [c.call_id for c in index.resolve("d1", "q9").candidates] == ["a2", "a"]

    def test_a_retry_replaces_the_identical_call_that_was_not_answered_not_a_twins(self):
        """Twin sessions A and B of one rollout send the same first request (sampling engine:
        different answers); B's stream was cut (stored incomplete), A's call a1 answered
        after it; A continues from a1; B re-sends its request and continues from the re-send.
        The retry replaces B's b1, whose answer B never got, not the later a1: a1 stays in
        A's chain, b1 is superseded."""
        index = LinkIndex()
        key = {"num_tokens": 3, "tokens_sha256": b"x" * 32}
        index.add("b1", 1.0, child_digest="dB1", request_digest="q1", status="incomplete")
        index.add("a1", 2.0, child_digest="dA1", request_digest="q1", status="complete", **key)
        index.add("a2", 3.0, child_digest=None, request_digest="qA2", parent_call_id="a1")
        retry = index.resolve(None, "q1")
        assert retry.retry_of == "b1"
        index.add("b1r", 4.0, child_digest=None, request_digest="q1", retry_of=retry.retry_of)
        assert {c: e.superseded_by for c, e in index.entries.items()} == {
            "b1": "b1r", "a1": None, "a2": None, "b1r": None,
        }  # fmt: skip
        # b1 was replaced, b1r is in flight with its harness there: nothing left to retry
        assert index.resolve(None, "q1").retry_of is None

        # The chains built from the records as the proxy stores them.
        def rec(call_id, at, prompt, gen, parent=None, retry_of=None):
            verdict = "resolved" if parent else "root"
            return record(call_id, prompt, gen, created_at=at).replace(
                parent_call_id=parent, retry_of=retry_of, linking={"verdict": verdict}
            )

        chains = build_chains("r1", [
            rec("b1", 1.0, [1, 2], [3]),
            rec("a1", 2.0, [1, 2], [4]),
            rec("a2", 3.0, [1, 2, 4, 7], [8], parent="a1"),
            rec("b1r", 4.0, [1, 2], [5], retry_of=retry.retry_of),
            rec("b2", 5.0, [1, 2, 5, 7], [9], parent="b1r"),
        ])  # fmt: skip
        in_chains = [[r.call_id for r in c.calls] for c in chains.chains]
        assert in_chains == [["a1", "a2"], ["b1r", "b2"]]
        assert chains.superseded == {"b1": "b1r"}
        assert [r.call_id for r in chains.unlinked] == ["b1"]

    def test_a_call_a_retry_superseded_is_not_the_target_again(self):
        """Sample A's first call f failed; the SDK's retry r replaced it and A continued from r.
        Sample B then sends the identical request with no retry signal: a sibling sample, not
        a retry of the failed f (whose retry r already is)."""
        index = LinkIndex()
        key = {"num_tokens": 3, "tokens_sha256": b"x" * 32}
        index.add("f", 1.0, child_digest=None, request_digest="q1", status="failed")
        assert index.resolve(None, "q1").retry_of == "f"
        index.add("r", 2.0, child_digest="dR", request_digest="q1", retry_of="f", **key)
        index.add("r2", 3.0, child_digest=None, request_digest="qR2", parent_call_id="r")
        assert index.entries["f"].superseded_by == "r"
        assert index.resolve(None, "q1").retry_of is None

    def test_candidates_are_scoped_by_model(self):
        index = LinkIndex()
        index.add("t", 1.0, child_digest="d", request_digest="q", model="small", status="complete")
        got = index.resolve("d", "q2", model="big")
        assert got.verdict is Verdict.UNRESOLVED and got.candidates == ()
        assert got.reason.kind is ReasonKind.MODEL_SCOPE
        assert got.reason.text == (
            "the matching turns come from a call to another model: the turns were produced by "
            "model small, this call is to big"
        )
        assert index.resolve("d", "q2", model="small").parent_call_id == "t"

    def test_an_unmatched_history_whose_last_turn_is_a_captured_output_is_history_edited(self):
        turn = {
            "role": "assistant",
            "content": "ls",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": "{}"},
                }
            ],
        }
        index = LinkIndex()
        index.add("p", 1.0, child_digest="d", request_digest="q", status="complete", response=turn)
        got = index.resolve("other", "q2", last_turn=turn)
        assert got.verdict is Verdict.UNRESOLVED
        assert got.reason.kind is ReasonKind.HISTORY_EDITED
        assert got.reason.text == (
            "the last model-authored turn is a captured call's output, but the history before "
            "it was edited"
        )
        assert got.mismatch["class"] == "history_edited"
        assert got.mismatch["parent_call_id"] == "p"
        # The same turn with other tool-call ids: named as such, not as a foreign turn.
        renamed = {**turn, "tool_calls": [{**turn["tool_calls"][0], "id": "toolu_9"}]}
        got = index.resolve("other", "q3", last_turn=renamed)
        assert got.reason.kind is ReasonKind.TOOL_CALL_IDS
        assert got.reason.text == (
            "the last model-authored turn equals a captured call's output but for its tool-call ids"
        )
        assert got.mismatch["parent_call_id"] == "p"
        foreign = {"role": "assistant", "content": "never said"}
        assert index.resolve("other", "q4", last_turn=foreign).reason.kind is ReasonKind.NO_MATCH

    def test_prefix_ancestor_is_the_deepest_token_exact_call_of_the_model(self):
        from capture_proxy.core.stored_form import token_digest

        def key(prompt, gen):
            p, g = np.asarray(prompt, np.uint32), np.asarray(gen, np.uint32)
            return {"num_tokens": len(prompt) + len(gen), "tokens_sha256": token_digest(p, g)}

        index = LinkIndex()
        index.add(
            "a",
            1.0,
            child_digest="da",
            request_digest="qa",
            model="m",
            status="complete",
            **key([1, 2], [3]),
        )
        index.add(
            "b",
            2.0,
            child_digest="db",
            request_digest="qb",
            model="m",
            status="complete",
            **key([1, 2, 3, 4], [5]),
        )
        index.add(
            "c",
            3.0,
            child_digest="dc",
            request_digest="qc",
            model="other",
            status="complete",
            **key([1, 2, 3, 4, 5], [6]),
        )
        prompt = np.asarray([1, 2, 3, 4, 5, 6, 7], np.uint32)
        assert index.prefix_ancestor(prompt, model="m", exclude="x") == "b"
        assert index.prefix_ancestor(prompt, model="other", exclude="x") == "c"
        assert index.prefix_ancestor(prompt[:3], model="m", exclude="x") == "a"
        assert index.prefix_ancestor(np.asarray([9], np.uint32), model="m", exclude="x") is None

    def test_source_history_refuses_note_parents(self):
        index = LinkIndex()
        index.add("note", 1.0, child_digest="d1", request_digest="q1", harness_note=True)
        assert index.resolve("d1", "q2").verdict is Verdict.RESOLVED
        res = index.resolve("d1", "q2", refuse_note_parents=True)
        assert res.verdict is Verdict.UNRESOLVED and res.reason.kind is ReasonKind.NOTE_PARENT
        assert res.reason.text == "parent prompt carried a rewritten harness note (source_history)"


def test_link_index_replaces_what_it_knows_of_a_call_and_orders_matches():
    index = LinkIndex()
    index.add("c1", 1.0, child_digest=None, request_digest="req")  # the request arrived
    gone = {"c1"}.__contains__  # its harness left
    assert index.resolve(None, "req", ends_incomplete=gone).retry_of == "c1"
    index.add("c1", 1.0, child_digest="d1", request_digest="req", status="incomplete")  # stored
    index.add("c2", 2.0, child_digest="d1", request_digest="req", status="failed", retry_of="c1")
    got = index.resolve("d1", "req")
    assert (got.verdict, got.parent_call_id, got.retry_of) == (Verdict.RESOLVED, "c2", "c2")
    index.add("c2", 2.0, child_digest="d2", request_digest="other", status="failed")
    got = index.resolve("d1", "other")
    assert (got.parent_call_id, got.retry_of) == ("c1", "c2")
    assert index.resolve("d2", "req").parent_call_id == "c2"
    assert index.resolve("d3", "new").verdict is Verdict.UNRESOLVED
    assert len(index.entries) == 2


def test_a_call_that_ended_unstored_is_a_failed_call_and_no_longer_a_child():
    """The store refused a call in flight (``Linker.release``): its harness got no answer, so
    an identical request is its retry, and the parent it was resolved to has no child again."""
    index = LinkIndex()
    key = {"num_tokens": 3, "tokens_sha256": b"x" * 32}
    index.add("p", 1.0, child_digest="d", request_digest="q0", status="complete", **key)
    index.add("c", 2.0, child_digest=None, request_digest="q1", parent_call_id="p")
    assert index.entries["p"].children == 1
    assert index.resolve(None, "q1").retry_of is None  # in flight, its harness there
    index.end_unstored("c")
    assert (index.entries["p"].children, index.entries["c"].status) == (0, "failed")
    assert index.resolve(None, "q1").retry_of == "c"
    index.end_unstored("c")  # once only
    index.end_unstored("p")  # a stored call: unchanged
    assert (index.entries["p"].children, index.entries["p"].status) == (0, "complete")


def test_a_retry_header_names_an_answered_call_of_its_own_session_only():
    """A replica that stored a call and was killed before its answer's end reached the
    harness left it complete; the harness's SDK sends it again with its retry header. With
    the session the request names, that call is known as the one retried; another session's
    answered call (a GRPO sample beside it) never is, nor any call without the header or
    without a session."""
    index = LinkIndex()
    mine, other = ("opencode", "ses_a"), ("opencode", "ses_b")
    index.add("b1", 1.0, child_digest="d1", request_digest="q", status="complete", session=other)
    index.add("a1", 2.0, child_digest="d2", request_digest="q", status="complete", session=mine)
    assert index.resolve(None, "q", session=mine, retry_requested=True).retry_of == "a1"
    assert index.resolve(None, "q", session=mine).retry_of is None  # no header
    assert index.resolve(None, "q", retry_requested=True).retry_of is None  # no session
    assert index.resolve(None, "q", session=other, retry_requested=True).retry_of is None
    # continued, it is no retry's target
    index.add("a2", 3.0, child_digest=None, request_digest="q2", parent_call_id="a1")
    assert index.resolve(None, "q", session=mine, retry_requested=True).retry_of is None


def test_a_lost_call_of_a_session_is_retried_by_its_own_session_not_a_sibling_sample():
    """A GRPO group, each sample its own OpenCode session: sample 0's first attempt failed
    (stored failed), or is in flight with its harness gone (a timeout); then sample 0's SDK
    retry and samples 1..3 come at once. A sibling that comes first (on the other worker of
    ``serve --workers 2``, or sooner on this one) is a sample of its own; the failed attempt
    is the retry's (trial 13: a sibling took it, and the retry had ``retry_of = None``)."""
    sessions = [("opencode", f"ses_{i}") for i in range(4)]
    for failed in ({"status": "failed"}, {}):  # stored failed; in flight, its harness gone
        index = LinkIndex()
        index.add("f0", 1.0, child_digest=None, request_digest="q", session=sessions[0], **failed)
        gone = {"f0"}.__contains__
        for i, sibling in enumerate(sessions[1:], 1):
            got = index.resolve(None, "q", session=sibling, ends_incomplete=gone)
            assert got.retry_of is None, i
            index.add(f"s{i}", 1.0 + i, child_digest=None, request_digest="q", session=sibling)
        got = index.resolve(
            None, "q", session=sessions[0], retry_requested=True, ends_incomplete=gone
        )
        assert got.retry_of == "f0"
        # a request that names no session keeps the rule without sessions
        assert index.resolve(None, "q", ends_incomplete=gone).retry_of == "f0"
