"""Training samples: chain paths as per-position arrays, and their zip-of-npz archive."""

import io
import math
import zipfile

import numpy as np
import pytest

from capture_proxy.core.chains import build_chains
from capture_proxy.core.samples import chain_samples, read_archive, write_archive
from tests.factories import record


def _calls():
    root = record("a", [1, 2], [3, 4], created_at=0)
    root.routed_experts = np.full((3, 1, 2), 5, np.uint8)  # positions 0..2
    child = record("b", [1, 2, 3, 4, 9], [7], created_at=1)
    child.generation_log_probs = np.array([math.nan], np.float32)
    child.routed_experts = np.full((2, 1, 2), 6, np.uint8)  # positions 3..4, from start 3
    child.routed_experts_start = 3
    sibling = record("c", [1, 2, 3, 4, 8, 8], [6, 6], created_at=2)
    title = record("t", [5], [5], created_at=3)
    return [child, sibling, root, title]


def test_one_sample_per_leaf_with_masks_and_aligned_experts():
    chains = build_chains("r1", _calls())
    (b, c), (t,) = (chain_samples(ch) for ch in chains.chains)
    assert (b.chain_id, b.leaf_call_id, b.call_ids) == ("a", "b", ["a", "b"])
    assert b.arrays["input_ids"].tolist() == [1, 2, 3, 4, 9, 7]
    assert b.arrays["loss_mask"].tolist() == [0, 0, 1, 1, 0, 1]
    lp = b.arrays["log_probs"]
    assert lp.dtype == np.float32 and lp[:5].tolist() == [0, 0, -0.5, -1.0, 0] and np.isnan(lp[5])
    assert b.arrays["generation_spans"].tolist() == [[2, 4], [5, 6]]
    assert b.arrays["routed_experts"][:, 0, 0].tolist() == [5, 5, 5, 6, 6, 0]
    assert b.arrays["routed_experts_mask"].tolist() == [1, 1, 1, 1, 1, 0]
    assert c.call_ids == ["a", "c"] and c.arrays["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert t.call_ids == ["t"] and "routed_experts" not in t.arrays


def test_archive_round_trip_is_exact():
    chains = build_chains("r1", _calls())
    buf = io.BytesIO()
    write_archive(chains, buf, {"incomplete": False})
    manifest, samples = read_archive(io.BytesIO(buf.getvalue()))
    assert manifest["rollout_id"] == "r1" and manifest["incomplete"] is False
    assert [s["file"] for s in manifest["samples"]] == ["a/b.npz", "a/c.npz", "t/t.npz"]
    want = [s for ch in chains.chains for s in chain_samples(ch)]
    for got, exp in zip(samples, want, strict=True):
        assert got.arrays.keys() == exp.arrays.keys()
        for k, arr in exp.arrays.items():
            assert got.arrays[k].dtype == arr.dtype
            assert got.arrays[k].tobytes() == arr.tobytes(), k


def test_foreign_or_newer_archives_are_refused():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("manifest.json", '{"format": "capture-proxy.chains.npz", "version": 99}')
    with pytest.raises(ValueError, match="newer"):
        read_archive(io.BytesIO(buf.getvalue()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("manifest.json", "{}")
    with pytest.raises(ValueError, match="not a"):
        read_archive(io.BytesIO(buf.getvalue()))
