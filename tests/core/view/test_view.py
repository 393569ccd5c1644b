"""Tier 1: the viewer's page models (listing rows, tree layout, token spans, shading, the
side-by-side view of a refused link), without an event loop."""

from __future__ import annotations

import math

import numpy as np

from capture_proxy.core.records import CallStatus, Diagnostic
from capture_proxy.core.view import tokens
from capture_proxy.core.view.call import call_view, plan_call
from capture_proxy.core.view.call_tree import build_call_tree
from capture_proxy.core.view.rollouts import format_age, matches, reward_of, rollout_row
from tests.factories import record


def _linked(call_id, prompt, generation, parent, **kw):
    r = record(call_id, prompt, generation, **kw)
    r.parent_call_id = parent
    r.linking = {"verdict": "resolved" if parent else "root"}
    return r


def _refused(call_id, prompt, generation, parent, position, **kw):
    r = record(call_id, prompt, generation, **kw)
    r.linking = {"verdict": "refused", "digest_parent_call_id": parent}
    r.diagnostics = [
        Diagnostic(
            "parent_digest_mismatch",
            {"parent_call_id": parent, "position": position, "class": "retokenized"},
        )
    ]
    return r


def _rollout():
    a = _linked("a", [1, 2], [3, 4], None, created_at=1.0)
    b = _linked("b", [1, 2, 3, 4, 5], [6], "a", created_at=2.0)
    c = _linked("c", [1, 2, 3, 4, 7], [8, 9], "a", created_at=3.0)
    d = _linked("d", [1, 2, 3, 4, 7, 8, 9, 10], [11], "c", created_at=4.0)
    e = _refused("e", [1, 2, 3, 40, 41, 12], [13], "a", 3, created_at=5.0)
    f = record("f", [1], [], created_at=6.0, status=CallStatus.FAILED)
    return [a, b, c, d, e, f]


def test_tree_draws_branches_refused_links_and_the_main_chain():
    tree = build_call_tree("r1", _rollout())
    assert [(r.call_id, "".join(r.guides), r.depth) for r in tree.rows] == [
        ("a", "", 0),
        ("b", "├─", 1),
        ("c", "└─", 1),
        ("d", "  └─", 2),
        ("e", "", 0),
    ]
    assert [r.call_id for r in tree.rows if r.is_main] == ["a", "b", "c", "d"]
    assert [r.call_id for r in tree.rows if r.is_chain_start] == ["a", "e"]
    a, b, c, d, e = tree.rows
    assert a.is_branch_point and a.num_children == 2
    assert (b.num_new_prompt_tokens, c.num_new_prompt_tokens, d.num_new_prompt_tokens) == (1, 1, 1)
    assert e.refused is not None
    assert (e.refused.parent_call_id, e.refused.parent_number, e.refused.mismatch_class) == (
        "a",
        1,
        "retokenized",
    )
    assert e.refused.position == 3 and e.num_new_prompt_tokens == 6
    assert [(r.call_id, r.status) for r in tree.unlinked] == [("f", "failed")]
    assert (tree.num_chains, tree.num_branches, tree.num_refused) == (2, 1, 1)


def test_superseded_retries_are_dimmed_siblings_before_their_survivor():
    a = _linked("a", [1], [2], None, created_at=1.0)
    old = _linked("old", [1, 2, 3], [4], "a", created_at=2.0)
    new = _linked("new", [1, 2, 3], [4], "a", created_at=3.0)
    new.retry_of = "old"
    tree = build_call_tree("r1", [a, old, new])
    assert [(r.call_id, "".join(r.guides)) for r in tree.rows] == [
        ("a", ""),
        ("old", "├─"),
        ("new", "└─"),
    ]
    assert tree.rows[1].superseded_by_number == 3 and tree.rows[1].num_new_prompt_tokens == 1
    assert tree.rows[2].retry_of_number == 2 and tree.unlinked == []


def test_shading_buckets():
    values = [0.0, -0.1, -0.11, -0.5, -1.5, -2.9, -3.0, -3.01, -50.0, math.nan, -math.inf]
    assert [tokens.shade_bucket(v) for v in values] == [0, 0, 1, 1, 2, 3, 3, 4, 4, 5, 5]


def test_spans_roles_log_probs_and_expert_rows():
    records = _rollout()
    d = records[3]
    d.routed_experts = np.zeros((6, 2, 2), np.uint8)  # rows for positions 2-7
    d.routed_experts_start = 2
    d.generation_log_probs = np.array([-2.0], np.float32)
    plan = plan_call(d, records, None, page_size=4)
    # Ancestors a then c: a generated positions 2-3, c generated 5-6; c's end is 7.
    assert plan.layout.generated_spans == ((2, 4), (5, 7))
    assert plan.layout.parent_end == 7 and plan.parent_call_id == "c"
    assert [(p.number, p.start, p.end) for p in plan.pages] == [(1, 0, 4), (2, 4, 8), (3, 8, 9)]
    assert plan.page.number == 2  # where the new tokens begin (position 7)
    view = call_view(plan, {7: "seven", 10: "ten"})
    assert [(s.position, s.text, s.role.value, s.expert_row) for s in view.spans] == [
        (4, "seven", "context", True),
        (5, "[8]", "ancestor", True),
        (6, "[9]", "ancestor", True),
        (7, "ten", "interstitial", True),
    ]
    assert view.role_counts == {"context": 3, "ancestor": 4, "interstitial": 1, "generation": 1}
    last = tokens.spans(d, plan.layout, 8, 100, None)
    assert [(s.position, s.role.value, s.log_prob, s.bucket, s.expert_row) for s in last] == [
        (8, "generation", -2.0, 3, False)
    ]
    assert view.bucket_counts == [0, 0, 0, 1, 0, 0]
    assert view.diff is None


def test_non_finite_log_prob_is_bucketed_not_clamped():
    r = record("a", [1], [2, 3])
    r.generation_log_probs = np.array([np.nan, -0.2], np.float32)
    lay = tokens.layout(r, [])
    got = [(s.role.value, s.log_prob, s.bucket) for s in tokens.spans(r, lay, 0, 3, None)]
    assert got == [
        ("interstitial", None, None),
        ("generation", None, 5),
        ("generation", float(np.float32(-0.2)), 1),
    ]


def test_refused_link_side_by_side_from_the_first_difference():
    records = _rollout()
    e = records[4]
    plan = plan_call(e, records, 1)
    assert plan.refused_parent is records[0]
    assert plan.token_ids() == {1, 2, 3, 4, 12, 13, 40, 41}
    view = call_view(plan, {3: "c", 4: "d", 40: "x"})
    diff = view.diff
    assert diff is not None and (diff.position, diff.mismatch_class) == (3, "retokenized")
    assert diff.parent.tokens == [
        (0, 1, "[1]", False),
        (1, 2, "[2]", False),
        (2, 3, "c", False),
        (3, 4, "d", True),
    ]
    assert [t[:2] for t in diff.child.tokens] == [(0, 1), (1, 2), (2, 3), (3, 40), (4, 41), (5, 12)]
    assert (diff.parent.total, diff.child.total) == (4, 6)
    # Without a recorded position, the tokens say where they part.
    assert tokens.diff_ids(records[0], e, None)[0] == 3


def test_listing_rows_and_filters():
    records = _rollout()
    records[4].diagnostics.append(Diagnostic("retry", {}))
    row = rollout_row(
        rollout_id="r1",
        created_at=100.0,
        incomplete=False,
        rollout_diagnostic_kinds=[],
        records=records,
        metadata={"reward": 1},
        now=4000.0,
    )
    assert (row.num_calls, row.num_chains, row.num_failed, row.refused_links) == (6, 2, 1, 1)
    assert row.status == "failed" and row.reward == 1.0 and row.age == "1 h"
    assert row.diagnostic_kinds == ("parent_digest_mismatch", "retry")
    assert matches(row, status="failed", kind="retry")
    assert not matches(row, status="complete", kind=None)
    assert not matches(row, status=None, kind="harness_note_rewritten")
    assert [reward_of(m) for m in (None, {}, {"reward": True}, {"reward": math.nan})] == [None] * 4
    assert reward_of({"reward": -0.25}) == -0.25
    assert [format_age(s) for s in (0, 59.9, 60, 3599, 3600, 86400 * 3)] == [
        "0 s",
        "59 s",
        "1 min",
        "59 min",
        "1 h",
        "3 d",
    ]


def test_a_cut_off_call_superseded_by_a_complete_retry_leaves_the_row_complete():
    cut = record("a", [1, 2], [3], status=CallStatus.INCOMPLETE)
    retry = record("b", [1, 2], [3, 4], created_at=1.0).replace(retry_of="a")

    def row(records, incomplete=False):
        return rollout_row(
            rollout_id="r1",
            created_at=0.0,
            incomplete=incomplete,
            rollout_diagnostic_kinds=[],
            records=records,
            metadata=None,
            now=1.0,
        )

    assert (row([cut]).status, row([cut, retry]).status) == ("incomplete", "complete")
    assert row([cut, retry]).num_incomplete == 1  # the cut-off call is still counted
    assert row([cut, retry], incomplete=True).status == "incomplete"  # a rollout-level mark


def test_named_rewards_are_shown_by_name():
    from capture_proxy.core.view.rollouts import format_reward, reward_of

    assert reward_of({"reward": {"pass": 1, "style": 0.5}}) == {"pass": 1.0, "style": 0.5}
    assert format_reward(reward_of({"reward": {"pass": 1, "style": 0.5}})) == "pass=1 style=0.5"
    assert format_reward(reward_of({"reward": 0.25})) == "0.25"
    assert format_reward(reward_of({"reward": None})) == "–"
    assert reward_of({"reward": {"x": float("nan")}}) is None


def test_tokens_carry_the_weight_version_that_sampled_them():
    records = _rollout()
    records[0].weight_versions = [{"version": "3", "start": 0, "end": 2}]  # a
    records[0].weight_version_source = "engine_reported"
    records[2].weight_versions = [  # c: the update came after its first token
        {"version": "3", "start": 0, "end": 1},
        {"version": "4", "start": 1, "end": 2},
    ]
    records[2].weight_version_source = "engine_spans"
    d = records[3]  # d's own versions are unknown
    view = call_view(plan_call(d, records, None, page_size=100), None)
    assert [(s.position, s.role.value, s.weight_version, s.version_slot) for s in view.spans] == [
        (0, "context", None, None),
        (1, "context", None, None),
        (2, "ancestor", "3", 0),
        (3, "ancestor", "3", 0),
        (4, "context", None, None),
        (5, "ancestor", "3", 0),
        (6, "ancestor", "4", 1),
        (7, "interstitial", None, None),
        (8, "generation", None, None),
    ]
    assert view.version_counts == [("3", 3, 0), ("4", 1, 1)]
    assert view.own_spans == []
    c_view = call_view(plan_call(records[2], records, None), None)
    assert c_view.own_spans == [("3", 0, 1, 0), ("4", 1, 2, 1)]
    assert [s.weight_version for s in c_view.spans] == [None, None, "3", "3", None, "3", "4"]
