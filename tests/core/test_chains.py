import itertools
import random

from capture_proxy.core.chains import build_chains, find_parents
from capture_proxy.core.records import CallRecord, CallStatus
from tests.factories import record

# A title root, and an agent chain a1 -> a2 -> a3 with a branch a2 -> b3.
TITLE = record("title", [1, 9, 9], [50, 2], created_at=1.0)
A1 = record("a1", [1, 2, 3], [10, 11, 2], created_at=1.5)
A2 = record("a2", [1, 2, 3, 10, 11, 2, 7, 7], [12, 2], created_at=2.0)
A3 = record("a3", [1, 2, 3, 10, 11, 2, 7, 7, 12, 2, 8], [13, 2], created_at=3.0)
B3 = record("b3", [1, 2, 3, 10, 11, 2, 7, 7, 12, 2, 9, 9], [14], created_at=3.5)
ALL = [TITLE, A1, A2, A3, B3]


def test_parents_by_exact_prefix():
    assert find_parents(ALL) == {
        "title": None,
        "a1": None,
        "a2": "a1",
        "a3": "a2",
        "b3": "a2",
    }


def test_chains_shape_and_order():
    chains = build_chains("r1", ALL)
    assert [c.chain_id for c in chains.chains] == ["title", "a1"]
    assert [r.call_id for r in chains.chains[1].calls] == ["a1", "a2", "a3", "b3"]
    assert chains.chains[1].num_branches == 1
    assert chains.chains[0].parent_of == {"title": None}


def test_same_chains_in_any_arrival_order():
    expected = build_chains("r1", ALL)
    for perm in itertools.permutations(ALL):
        got = build_chains("r1", list(perm))
        assert [(c.chain_id, [r.call_id for r in c.calls], c.parent_of) for c in got.chains] == [
            (c.chain_id, [r.call_id for r in c.calls], c.parent_of) for c in expected.chains
        ]


def test_deepest_parent_wins():
    # a3's prompt also extends a1's prompt + generation, but a2 is deeper.
    assert find_parents([A3, A1, A2])["a3"] == "a2"


def test_near_miss_is_not_linked():
    # One token differs inside the parent's generation: no link, a new root.
    child = record("c", [1, 2, 3, 10, 99, 2, 7], [5], created_at=2.0)
    assert find_parents([A1, child]) == {"a1": None, "c": None}


def test_prompt_equal_to_parent_output_without_interstitial_links():
    child = record("c", [1, 2, 3, 10, 11, 2], [5], created_at=2.0)
    assert find_parents([A1, child])["c"] == "a1"


def test_incomplete_and_failed_calls_are_never_linked():
    broken = record("x", [1, 2, 3], [10, 11, 2], created_at=1.0, status=CallStatus.INCOMPLETE)
    failed = record("f", [1, 2, 3], [], created_at=1.1, status=CallStatus.FAILED)
    chains = build_chains("r1", [broken, failed, A2])
    assert [c.chain_id for c in chains.chains] == ["a2"]
    assert [r.call_id for r in chains.unlinked] == ["x", "f"]


def test_identical_retries_link_to_the_same_parent_and_never_to_each_other():
    r1 = record("r-1", A2.prompt_token_ids.tolist(), [12, 2], created_at=2.0)
    r2 = record("r-2", A2.prompt_token_ids.tolist(), [12, 2], created_at=2.1)
    assert find_parents([A1, r1, r2]) == {"a1": None, "r-1": "a1", "r-2": "a1"}


def test_empty_generation_cannot_be_a_parent():
    empty = record("e", [1, 2, 3], [], created_at=1.0)
    child = record("c", [1, 2, 3, 4], [5], created_at=2.0)
    assert find_parents([empty, child]) == {"e": None, "c": None}


def test_random_trees_are_recovered_exactly():
    rng = random.Random(7)
    for _ in range(20):
        records = [record("n0", [1, 2], [3], created_at=0.0)]
        truth = {"n0": None}
        for i in range(1, 15):
            parent = rng.choice(records)
            interstitial = [rng.randrange(100, 200) for _ in range(rng.randrange(0, 3))]
            # Unique tokens per call make every prefix relation the intended one.
            prompt = parent.full_token_ids().tolist() + interstitial + [1000 + i]
            records.append(record(f"n{i}", prompt, [2000 + i], created_at=float(i)))
            truth[f"n{i}"] = parent.call_id
        rng.shuffle(records)
        assert find_parents(records) == truth


def test_an_unlinked_call_the_harness_retried_is_superseded_by_the_retry():
    from capture_proxy.core.chains import build_chains
    from capture_proxy.core.records import CallRecord, CallStatus

    cut = CallRecord(call_id="c1", rollout_id="r", created_at=1.0, status=CallStatus.INCOMPLETE)
    retry = record("c2", [1, 2], [3], created_at=2.0).replace(
        retry_of="c1", linking={"verdict": "root"}
    )
    chains = build_chains("r", [retry, cut])
    assert [c.chain_id for c in chains.chains] == ["c2"]
    assert [r.call_id for r in chains.unlinked] == ["c1"]
    assert chains.superseded == {"c1": "c2"}


def test_three_attempts_of_one_request_leave_one_in_the_chain():
    # Each retry names the attempt before it (the linker's latest identical call): c3 -> c2 -> c1.
    cut = CallRecord(call_id="c1", rollout_id="r", created_at=1.0, status=CallStatus.INCOMPLETE)
    second = CallRecord(
        call_id="c2", rollout_id="r", created_at=2.0, status=CallStatus.INCOMPLETE, retry_of="c1"
    )
    third = record("c3", [1, 2], [3], created_at=3.0).replace(
        retry_of="c2", linking={"verdict": "root"}
    )
    child = record("c4", [1, 2, 3, 5], [6], created_at=4.0).replace(
        parent_call_id="c3", linking={"verdict": "resolved"}
    )
    for order in itertools.permutations([cut, second, third, child]):
        chains = build_chains("r", order)
        assert [[r.call_id for r in c.calls] for c in chains.chains] == [["c3", "c4"]]
        assert chains.superseded == {"c1": "c3", "c2": "c3"}


def test_three_complete_attempts_keep_the_one_the_session_continued_from():
    a = record("a", [1, 2], [3], created_at=1.0).replace(linking={"verdict": "root"})
    b = record("b", [1, 2], [4], created_at=2.0).replace(retry_of="a", linking={"verdict": "root"})
    c = record("c", [1, 2], [5], created_at=3.0).replace(retry_of="b", linking={"verdict": "root"})
    child = record("d", [1, 2, 5, 7], [8], created_at=4.0).replace(
        parent_call_id="c", linking={"verdict": "resolved"}
    )
    for order in itertools.permutations([a, b, c, child]):
        chains = build_chains("r", order)
        assert [[r.call_id for r in ch.calls] for ch in chains.chains] == [["c", "d"]]
        assert chains.superseded == {"a": "c", "b": "c"}


def test_two_calls_that_name_the_same_failed_attempt_are_both_kept():
    """With ``serve --workers`` a failed call's retry and an identical sibling sample can each
    be taken for its retry (the workers do not see each other's calls in flight): both are
    answered samples, both stay; the failed attempt is superseded (review: the chains kept
    one of the two)."""
    failed = CallRecord(call_id="f", rollout_id="r", created_at=1.0, status=CallStatus.FAILED)
    retry = record("r1", [1, 2], [3], created_at=2.0).replace(
        retry_of="f", linking={"verdict": "root"}
    )
    sibling = record("s2", [1, 2], [4], created_at=2.5).replace(
        retry_of="f", linking={"verdict": "root"}
    )
    child = record("c", [1, 2, 3, 5], [6], created_at=3.0).replace(
        parent_call_id="r1", linking={"verdict": "resolved"}
    )
    for order in itertools.permutations([failed, retry, sibling, child]):
        chains = build_chains("r", order)
        assert [[r.call_id for r in ch.calls] for ch in chains.chains] == [["r1", "c"], ["s2"]]
        assert chains.superseded == {"f": "r1"}  # the one the harness continued from
