"""The audit's comparison math on exact numbers (numpy only, no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from capture_proxy.audit import compare
from capture_proxy.audit.compare import RoutingSummary, Thresholds

NAN = float("nan")


def test_token_scores_take_generated_positions_after_the_first():
    mask = np.array([1, 0, 1, 1, 0, 1], np.uint8)  # position 0 can never be generated
    captured = np.array([9, 0, -1, -2, 0, -3], np.float32)
    recomputed = np.array([NAN, -5, -1, -2.5, -7, -1], np.float32)
    s = compare.token_scores(mask, captured, recomputed)
    assert s.positions.tolist() == [2, 3, 5]
    assert s.captured.tolist() == [-1, -2, -3]
    assert s.delta.tolist() == [0.0, -0.5, 2.0]


def test_logprob_stats_are_the_trainers_estimators():
    s = compare.TokenScores(
        np.array([2, 3, 5, 6]),
        np.array([-1.0, -2.0, -3.0, NAN]),
        np.array([-1.0, -2.5, -1.0, -4.0]),
    )
    st = compare.logprob_stats([s], Thresholds(token_delta=0.5, tis_cap=2.0))
    assert (st["num_tokens"], st["num_compared"], st["num_non_finite"]) == (4, 3, 1)
    assert st["mean_abs_delta"] == pytest.approx(2.5 / 3)
    assert st["max_abs_delta"] == 2.0
    assert st["mean_delta"] == pytest.approx(0.5)
    assert st["fraction_over"] == pytest.approx(1 / 3)  # 0.5 is not over 0.5; 2.0 is
    assert st["k1_mean"] == pytest.approx(-0.5)
    assert st["k2_mean"] == pytest.approx((0 + 0.125 + 2.0) / 3)
    k3 = [0.0, math.exp(-0.5) - 1 + 0.5, math.exp(2.0) - 1 - 2.0]
    assert st["k3_mean"] == pytest.approx(sum(k3) / 3)
    assert (st["ratio_min"], st["ratio_max"]) == pytest.approx((math.exp(-0.5), math.exp(2.0)))
    # ratio e^2 > 2 is clipped by TIS; e^-0.5 = 0.61 is inside [1/2, 2] so MIS keeps it.
    assert st["tis_clip_fraction"] == pytest.approx(1 / 3)
    assert st["mis_mask_fraction"] == pytest.approx(1 / 3)


def test_logprob_stats_of_nothing_have_no_figures():
    st = compare.logprob_stats([], Thresholds())
    assert (st["num_tokens"], st["num_compared"]) == (0, 0)
    assert all(st[k] is None for k in compare.FIGURES)
    failures = compare.verdict(st, RoutingSummary("not_moe"), Thresholds())
    assert [f.check for f in failures] == ["num_compared"]


def test_alignment_finds_log_probs_shifted_by_one():
    mask = np.array([0, 0, 1, 1, 1, 1, 1], np.uint8)
    model = np.array([NAN, NAN, -1.0, -2.0, -3.0, -4.0, -5.0])
    right = compare.alignment(mask, model.copy(), model)
    assert right[0] == (0.0, 5)
    # The captured log probs belong to the next token: captured[t] = model[t + 1].
    shifted = np.array([0, 0, -2.0, -3.0, -4.0, -5.0, -6.0])
    got = compare.alignment(mask, shifted, model)
    assert got[1] == (0.0, 4)  # t = 2..5 fit exactly; t = 6 has no generated t + 1
    assert got[0] == (5.0, 5)
    assert got[-1] == (8.0, 4)
    assert compare.merge_alignment([got, right]) == {"-1": 1.5, "0": 0.5, "1": 0.5}


def test_expert_overlap_counts_the_set_not_the_order():
    captured = np.array([[[1, 2], [3, 4]], [[5, 6], [0, 1]]])
    model = np.array([[[2, 1], [3, 7]], [[0, 4], [0, 1]]])
    assert compare.expert_overlap(captured, model).tolist() == [[1.0, 0.5], [0.0, 1.0]]
    with pytest.raises(ValueError, match="shape"):
        compare.expert_overlap(captured, model[:, :1])


def test_routing_scores_and_rows_one_position_off():
    model = np.array([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]])  # [seq 4, layers 1, k 2]
    mask = np.array([1, 1, 1, 0], np.uint8)
    same = compare.routing_scores(model.copy(), mask, model)
    assert same.positions.tolist() == [0, 1, 2] and same.overlap.tolist() == [[1.0]] * 3
    # Rows stored one position late: row i holds position i - 1's routing.
    late = np.concatenate([model[:1] * 0 + 9, model[:-1]])
    off = compare.routing_scores(late, mask, model)
    assert off.overlap.tolist() == [[0.0], [0.0], [0.0]]
    assert off.shifted[-1] == (2.0, 2)  # rows 1, 2 match the model one position earlier
    summary = compare.summarize_routing([same, off], {"-1": 1.0, "1": 0.0})
    assert (summary.num_rows, summary.agreement, summary.exact_fraction) == (6, 0.5, 0.5)
    assert summary.per_layer == [0.5]


def test_verdict_names_each_check_past_its_limit():
    th = Thresholds(max_mean_abs_delta=0.1, max_fraction_over=0.0, max_k3=0.01)
    stats = {"num_compared": 4, "mean_abs_delta": 0.2, "fraction_over": 0.25, "k3_mean": 0.001}
    routing = RoutingSummary("compared", agreement=0.5)
    failures = compare.verdict(stats, routing, th)
    assert [(f.check, f.value, f.limit) for f in failures] == [
        ("mean_abs_delta", 0.2, 0.1),
        ("fraction_over", 0.25, 0.0),
        ("expert_agreement", 0.5, 0.9),
    ]
    assert failures[0].message == "mean |delta| 0.2 > 0.1"
    ok = {**stats, "mean_abs_delta": 0.01, "fraction_over": 0.0}
    assert compare.verdict(ok, RoutingSummary("compared", agreement=0.95), th) == []
    assert (
        compare.verdict({**ok, "k3_mean": NAN}, RoutingSummary("not_moe"), th)[0].check == "k3_mean"
    )


@pytest.mark.parametrize(
    ("status", "require", "fails"),
    [
        ("dense_model", False, True),
        ("shape_mismatch", False, True),
        ("not_captured", False, False),
        ("not_captured", True, True),
        ("not_moe", True, False),
    ],
)
def test_verdict_on_routing_that_cannot_be_compared(status, require, fails):
    stats = {"num_compared": 1, "mean_abs_delta": 0.0, "fraction_over": 0.0, "k3_mean": 0.0}
    failures = compare.verdict(
        stats, RoutingSummary(status, "why"), Thresholds(require_routing=require)
    )
    assert [(f.check, f.value, f.message) for f in failures] == (
        [("routing", status, "why")] if fails else []
    )
