"""Weight versions, read side: their order, the per-token index of a sample, a rollout's counts
and the version filter of the training reads, on records with known spans."""

from __future__ import annotations

import io

import numpy as np
import pytest

from capture_proxy.core.chains import build_chains
from capture_proxy.core.samples import chain_samples, read_archive, write_archive
from capture_proxy.core.weight_filter import WeightFilter, WeightFilterError, select
from capture_proxy.core.weight_versions import (
    index_dtype,
    integer_version,
    num_unknown_tokens,
    path_versions,
    rollout_summary,
    sequence_index,
    sequence_spans,
    spans_of,
    version_table,
)
from tests.factories import record


def weighted_calls():
    """Chain a (a -> b, a -> c), chain t and chain u; c's versions are unknown."""
    a = record(
        "a",
        [1, 2],
        [3, 4, 5],
        weight_versions=[("default", 0, 1), ("3", 1, 3)],
        weight_version_source="engine_spans",
    )
    b = record(
        "b",
        [1, 2, 3, 4, 5, 9],
        [7, 8],
        created_at=1,
        weight_versions=[("4", 0, 2)],
        weight_version_source="engine_reported",
    )
    c = record("c", [1, 2, 3, 4, 5, 8, 8], [6], created_at=2)
    t = record(
        "t",
        [50],
        [51, 52],
        created_at=3,
        weight_versions=[("10", 0, 2)],
        weight_version_source="observed",
    )
    u = record(
        "u",
        [60],
        [61],
        created_at=4,
        weight_versions=[("v7", 0, 1)],
        weight_version_source="engine_reported",
    )
    return [a, b, c, t, u]


def test_integer_versions_order_as_integers_and_others_come_first():
    assert [integer_version(v) for v in ("12", "-1", "007", "default", "1.5", "١")] == [
        12,
        -1,
        7,
        None,
        None,
        None,
    ]
    assert version_table(["10", "default", "9", "v7", "10", "2"]) == [
        "default",
        "v7",
        "2",
        "9",
        "10",
    ]


def test_spans_are_read_defensively():
    r = record("x", [1], [2, 3, 4])
    r.weight_versions = [
        {"version": "3", "start": -2, "end": 1},  # clipped to [0, 1)
        {"version": 4, "start": 1, "end": 2},  # not a string version: skipped
        {"version": "5", "start": True, "end": 2},  # a bool is not an index: skipped
        "junk",
        {"version": "6", "start": 2, "end": 99},  # clipped to [2, 3)
        {"version": "7", "start": 3, "end": 3},  # empty
    ]
    assert spans_of(r) == [("3", 0, 1), ("6", 2, 3)]
    assert path_versions([r])[1].tolist() == [-1, 0, -1, 1]
    assert num_unknown_tokens(r) == 1
    assert num_unknown_tokens(record("y", [1], [2, 3])) == 2  # no spans: all unknown
    assert num_unknown_tokens(record("z", [1], [])) == 0


def test_rollout_summary_counts_tokens_per_version_sources_and_unknowns():
    assert rollout_summary(weighted_calls()) == {
        "weight_versions": {"default": 1, "v7": 1, "3": 2, "4": 2, "10": 2},
        "weight_version_min": 3,
        "weight_version_max": 10,
        "weight_version_sources": {"engine_reported": 2, "engine_spans": 1, "observed": 1},
        "weight_version_unknown": {"num_calls": 1, "num_generation_tokens": 1},
    }
    assert rollout_summary([record("x", [1], [2])]) == {
        "weight_versions": {},
        "weight_version_min": None,
        "weight_version_max": None,
        "weight_version_sources": {},
        "weight_version_unknown": {"num_calls": 1, "num_generation_tokens": 1},
    }


def _samples(records):
    return {
        s.leaf_call_id: s for ch in build_chains("r1", records).chains for s in chain_samples(ch)
    }


def test_each_sample_has_a_version_index_beside_its_loss_mask():
    s = _samples(weighted_calls())
    b = s["b"].arrays
    assert b["input_ids"].tolist() == [1, 2, 3, 4, 5, 9, 7, 8]
    assert b["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 1, 1]
    assert b["weight_versions"].tolist() == ["default", "3", "4"]
    assert b["weight_version_index"].dtype == np.int16
    assert b["weight_version_index"].tolist() == [-1, -1, 0, 1, 1, -1, 2, 2]
    assert b["weight_version_sources"].tolist() == ["engine_spans", "engine_reported"]
    c = s["c"].arrays  # c's own generation has no known version
    assert c["weight_versions"].tolist() == ["default", "3"]
    assert c["weight_version_index"].tolist() == [-1, -1, 0, 1, 1, -1, -1, -1]
    assert c["weight_version_sources"].tolist() == ["engine_spans", ""]
    assert s["t"].arrays["weight_version_index"].tolist() == [-1, 0, 0]
    assert s["u"].arrays["weight_versions"].tolist() == ["v7"]
    # staleness as a trainer computes it: current version minus each generated token's
    # (the non-integer "default" has none: NaN)
    table = np.array([integer_version(str(v)) for v in b["weight_versions"]], dtype=float)
    idx = b["weight_version_index"]
    staleness = 5 - table[idx[b["loss_mask"] == 1]]
    assert np.isnan(staleness[0]) and staleness[1:].tolist() == [2, 2, 1, 1]


def test_the_archive_keeps_the_version_arrays_and_names_them_in_the_manifest():
    chains = build_chains("r1", weighted_calls())
    buf = io.BytesIO()
    write_archive(chains, buf)
    manifest, samples = read_archive(io.BytesIO(buf.getvalue()))
    assert [(e["leaf_call_id"], e["weight_versions"]) for e in manifest["samples"]] == [
        ("b", ["default", "3", "4"]),
        ("c", ["default", "3"]),
        ("t", ["10"]),
        ("u", ["v7"]),
    ]
    assert samples[0].arrays["weight_version_index"].tolist() == [-1, -1, 0, 1, 1, -1, 2, 2]
    assert samples[1].arrays["weight_version_sources"].tolist() == ["engine_spans", ""]


def _kept(wf):
    selection = select(build_chains("r1", weighted_calls()), wf)
    return [path[-1].call_id for _, path in selection.paths], selection.report


def test_min_weight_version_keeps_samples_whose_every_token_is_that_new():
    kept, report = _kept(WeightFilter(min_version=3))
    assert kept == ["t"]  # a's "default" token is older than 3; u's "v7" too; c unknown
    assert report == {
        "min_weight_version": 3,
        "weight_versions": None,
        "unknown_weight_version": "drop",
        "num_samples": 4,
        "num_samples_kept": 1,
        "dropped_samples": [
            {
                "chain_id": "a",
                "leaf_call_id": "b",
                "call_id": "a",
                "reason": "older_than_min_weight_version",
                "call_weight_versions": ["default", "3"],
            },
            {
                "chain_id": "a",
                "leaf_call_id": "c",
                "call_id": "a",
                "reason": "older_than_min_weight_version",
                "call_weight_versions": ["default", "3"],
            },
            {
                "chain_id": "u",
                "leaf_call_id": "u",
                "call_id": "u",
                "reason": "older_than_min_weight_version",
                "call_weight_versions": ["v7"],
            },
        ],
    }
    assert _kept(WeightFilter(min_version=11))[0] == []
    assert _kept(WeightFilter(min_version=-5))[0] == ["t"]


def test_exact_versions_and_what_happens_to_unknown_ones():
    kept, report = _kept(WeightFilter(versions=frozenset({"default", "3", "4"})))
    assert kept == ["b"]
    assert [(d["leaf_call_id"], d["call_id"], d["reason"]) for d in report["dropped_samples"]] == [
        ("c", "c", "unknown_weight_version"),
        ("t", "t", "not_in_weight_versions"),
        ("u", "u", "not_in_weight_versions"),
    ]
    kept, report = _kept(WeightFilter(versions=frozenset({"default", "3"}), keep_unknown=True))
    assert kept == ["c"] and report["unknown_weight_version"] == "keep"
    kept, _ = _kept(WeightFilter(min_version=10, versions=frozenset({"10", "v7"})))
    assert kept == ["t"]


def test_no_filter_keeps_every_sample_and_reports_nothing():
    kept, report = _kept(None)
    assert kept == ["b", "c", "t", "u"] and report is None
    selection = select(build_chains("r1", weighted_calls()), None)
    assert selection.call_ids() == {"a", "b", "c", "t", "u"}


@pytest.mark.parametrize(
    ("min_version", "versions", "unknown", "param"),
    [
        ("abc", [], None, "min_weight_version"),
        ("3.0", [], None, "min_weight_version"),
        ("", [], None, "min_weight_version"),
        ("1" * 257, [], None, "min_weight_version"),
        ("-" + "1" * 257, [], None, "min_weight_version"),
        ("+3", [], None, "min_weight_version"),
        ("٣", [], None, "min_weight_version"),
        (None, [""], None, "weight_version"),
        (None, ["x" * 257], None, "weight_version"),
        (None, [str(i) for i in range(65)], None, "weight_version"),
        ("3", [], "maybe", "unknown_weight_version"),
    ],
)
def test_bad_filter_values_name_their_parameter(min_version, versions, unknown, param):
    with pytest.raises(WeightFilterError) as info:
        WeightFilter.from_query(min_version, versions, unknown)
    assert info.value.param == param


def test_min_weight_version_takes_every_integer_the_summary_reports():
    # The trial's case (#7): the summary reported 99999999999999999999999 as an integer, the
    # filter refused anything of 19 digits or more as "not an integer version".
    big = 99999999999999999999999
    calls = [
        record("x", [1], [2, 3], weight_versions=[("10", 0, 2)]),
        record("y", [9], [8], created_at=1, weight_versions=[(str(big), 0, 1)]),
    ]
    summary = rollout_summary(calls)
    assert (summary["weight_version_min"], summary["weight_version_max"]) == (10, big)
    for n in (10**18, big, summary["weight_version_max"]):
        wf = WeightFilter.from_query(str(n), [], None)
        assert wf == WeightFilter(n, None, keep_unknown=False)
        selection = select(build_chains("r1", calls), wf)
        assert [path[-1].call_id for _, path in selection.paths] == ["y"]
    # One bound for both: 256 digits is an integer version everywhere, 257 nowhere.
    longest = "-" + "9" * 256
    assert integer_version(longest) == -(10**256 - 1)
    assert WeightFilter.from_query(longest, [], None) == WeightFilter(-(10**256 - 1))
    too_long = "9" * 257
    assert integer_version(too_long) is None
    summary = rollout_summary([record("z", [1], [2], weight_versions=[(too_long, 0, 1)])])
    assert (summary["weight_version_min"], summary["weight_version_max"]) == (None, None)
    # (before, a version past Python's 4,300-digit int(str) limit failed the summary)
    huge = rollout_summary([record("w", [1], [2], weight_versions=[("9" * 5000, 0, 1)])])
    assert huge["weight_version_max"] is None
    with pytest.raises(WeightFilterError) as info:
        WeightFilter.from_query(too_long, [], None)
    assert str(info.value) == (
        "min_weight_version: must be an integer version: an optional '-' and 1 to 256 digits "
        f"(e.g. 12), got {too_long[:64]!r}; name other versions exactly with weight_version"
    )


def test_the_query_parameters_make_the_filter():
    assert WeightFilter.from_query(None, [], None) is None
    assert WeightFilter.from_query(None, [], "keep") is None  # nothing to filter on
    assert WeightFilter.from_query("-2", ["a", "b"], "keep") == WeightFilter(
        -2, frozenset({"a", "b"}), keep_unknown=True
    )
    assert WeightFilter.from_query("7", [], None) == WeightFilter(7, None, keep_unknown=False)


def test_a_sample_index_as_runs_and_back():
    b = _samples(weighted_calls())["b"].arrays
    spans = sequence_spans(b["weight_versions"].tolist(), b["weight_version_index"])
    assert spans == [("default", 2, 3), ("3", 3, 5), ("4", 6, 8)]
    table, index = sequence_index(spans, 8)
    assert table == b["weight_versions"].tolist()
    assert index.dtype == np.int16 and index.tobytes() == b["weight_version_index"].tobytes()
    assert sequence_spans([], np.zeros(0, np.int32)) == []
    assert sequence_spans(["3"], np.array([0, 0, -1, 0], np.int32)) == [("3", 0, 2), ("3", 3, 4)]
    assert sequence_index([], 3)[1].tolist() == [-1, -1, -1]


def test_the_index_widens_past_32767_versions():
    assert (index_dtype(0), index_dtype(32_767), index_dtype(32_768)) == (np.int16,) * 2 + (
        np.int32,
    )
    spans = [(str(i), i, i + 1) for i in range(32_768)]
    table, index = sequence_index(spans, 32_769)
    assert index.dtype == np.int32 and index[-2:].tolist() == [32_767, -1]
    assert table[-1] == "32767"
