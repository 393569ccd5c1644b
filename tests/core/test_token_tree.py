"""The token tree: shared prefixes stored once, split where token, mask or log prob differ."""

from __future__ import annotations

import io

import numpy as np
import pytest

from capture_proxy.core.samples import ChainSample
from capture_proxy.core.token_tree import build_token_tree, read_tree, write_tree


def sample(leaf: str, ids: list[int], mask: list[int], experts: bool = False) -> ChainSample:
    m = np.array(mask, np.uint8)
    arrays = {
        "input_ids": np.array(ids, np.uint32),
        "loss_mask": m,
        "log_probs": np.where(m == 1, -0.5, 0.0).astype(np.float32),
        "call_ids": np.array([leaf]),
    }
    if experts:
        arrays["routed_experts"] = np.array(ids, np.uint8).reshape(-1, 1, 1)
        arrays["routed_experts_mask"] = np.ones(len(ids), np.uint8)
    return ChainSample("root", leaf, arrays)


SAMPLES = [
    sample("a", [1, 2, 3, 4, 5], [0, 0, 1, 1, 0]),
    sample("b", [1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 1, 1]),
    sample("c", [1, 2, 3, 9, 9], [0, 0, 1, 1, 1]),
    sample("d", [1, 2, 3, 4], [0, 0, 0, 0]),  # same tokens as a's start, but not generated
]


def test_paths_merge_into_segments_with_exact_arrays():
    tree = build_token_tree("r", SAMPLES)
    a = tree.arrays
    assert (tree.num_tokens, tree.num_path_tokens, tree.num_segments) == (11, 21, 6)
    assert a["segment_offsets"].tolist() == [0, 2, 3, 5, 7, 9, 11]
    assert a["segment_parent"].tolist() == [-1, 0, 1, 2, 1, 0]
    assert a["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 9, 9, 3, 4]
    assert a["positions"].tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 2, 3]
    assert a["loss_mask"].tolist() == [0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0]
    assert a["leaf_segment"].tolist() == [2, 3, 4, 5]
    assert [leaf["segment"] for leaf in tree.leaves] == [2, 3, 4, 5]
    for i, s in enumerate(SAMPLES):
        idx = tree.path_indices(i)
        for name in ("input_ids", "loss_mask", "log_probs"):
            assert a[name][idx].tobytes() == s.arrays[name].tobytes()


def test_routed_experts_follow_the_tokens_and_the_archive_round_trips():
    with_experts = [
        sample(
            s.leaf_call_id,
            s.arrays["input_ids"].tolist(),
            s.arrays["loss_mask"].tolist(),
            experts=True,
        )
        for s in SAMPLES
    ]
    tree = build_token_tree("r", with_experts)
    assert tree.arrays["routed_experts"].reshape(-1).tolist() == tree.arrays["input_ids"].tolist()
    buf = io.BytesIO()
    write_tree(tree, buf, {"main_chain_id": "root"})
    back = read_tree(io.BytesIO(buf.getvalue()))
    assert back.leaves == tree.leaves and back.num_path_tokens == 21
    assert all(np.array_equal(back.arrays[k], v) for k, v in tree.arrays.items())


def test_an_identical_path_adds_nothing_and_no_samples_give_an_empty_tree():
    tree = build_token_tree("r", [SAMPLES[1], SAMPLES[1]])
    assert (tree.num_tokens, tree.num_path_tokens, tree.num_segments) == (7, 14, 1)
    assert tree.arrays["leaf_segment"].tolist() == [0, 0]
    empty = build_token_tree("r", [])
    assert (empty.num_tokens, empty.num_segments) == (0, 0)


def test_samples_with_other_expert_shapes_are_refused():
    one = sample("a", [1, 2], [0, 1], experts=True)
    other = sample("b", [1, 2], [0, 1])
    other.arrays["routed_experts"] = np.zeros((2, 2, 1), np.uint8)
    with pytest.raises(ValueError, match="disagree"):
        build_token_tree("r", [one, other])
