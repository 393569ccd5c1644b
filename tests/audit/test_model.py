"""The audit's model side against transformers' public forward: the same log probs and router
choices, batched or not, in float32 and in bf16 (whose CPU head is multiplied in float32 and
rounded, ``model._logits``)."""

from __future__ import annotations

import numpy as np
import pytest

from capture_proxy.audit.sources import AuditSample

torch = pytest.importorskip("torch", reason="the audit extra: scripts/install-audit")
from capture_proxy.audit.model import AuditModel, ModelOptions  # noqa: E402


def _sample(name: str, seq: int, seed: int) -> AuditSample:
    rng = np.random.default_rng(seed)
    mask = np.zeros(seq, np.uint8)
    mask[seq // 2 :] = 1
    return AuditSample(
        "r", name, name, (name,), rng.integers(1000, 150000, seq), mask,
        np.zeros(seq, np.float32), None, None, None,
    )  # fmt: skip


def _public(model_dir, dtype, ids: np.ndarray):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.inference_mode():
        out = model(torch.from_numpy(ids)[None], output_router_logits=True)
    logp = out.logits[0].float().log_softmax(-1)
    lp = logp[torch.arange(len(ids) - 1), torch.from_numpy(ids[1:])].numpy()
    experts = [torch.topk(r.float(), 2, dim=-1).indices.numpy() for r in out.router_logits]
    return lp, np.stack(experts, axis=1)


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 2e-5), ("bfloat16", 1e-4)])
def test_scores_are_the_public_forwards_batched_or_not(tiny_models, dtype, tol):
    model = AuditModel(ModelOptions(tiny_models["moe"], dtype=dtype, max_batch_tokens=10_000))
    assert (model.num_moe_layers, model.top_k, str(model.dtype)) == (2, 2, f"torch.{dtype}")
    a, b = _sample("a", 40, 1), _sample("b", 25, 2)
    assert list(model.batches([b, a])) == [[1, 0]]  # longest first, one pass
    together = model.score([a, b])
    alone = model.score([b])[0]
    # Padding changes only the matmul shapes: float rounding, nothing more. In bfloat16 (8
    # mantissa bits: a logit near 12 rounds in steps of 1/16) another shape may take another
    # kernel (oneDNN on AVX-512 does): log probs then differ by up to 0.008 here, which is
    # rounding; a padding leak would move them by tenths.
    batched_tol = tol if dtype == "float32" else 0.02
    np.testing.assert_allclose(together[1].log_probs, alone.log_probs, atol=batched_tol, rtol=0)
    np.testing.assert_array_equal(together[1].experts, alone.experts)
    for s, got in zip((a, b), together, strict=True):
        lp, experts = _public(tiny_models["moe"], getattr(torch, dtype), s.input_ids)
        gen = np.flatnonzero(s.loss_mask)
        assert np.isnan(got.log_probs[: gen[0]]).all()
        np.testing.assert_allclose(got.log_probs[gen], lp[gen - 1], atol=batched_tol, rtol=0)
        assert got.experts.shape == (s.num_tokens, 2, 2)
        if dtype == "float32":  # bf16 router near-ties may order differently: sets compared
            np.testing.assert_array_equal(np.sort(got.experts, -1), np.sort(experts, -1))


def test_batches_keep_to_the_token_budget(tiny_models):
    model = AuditModel(ModelOptions(tiny_models["dense"], max_batch_tokens=100))
    samples = [_sample(str(n), seq, n) for n, seq in enumerate((30, 60, 20, 50))]
    assert list(model.batches(samples)) == [[1], [3, 0], [2]]  # 60 alone; 2 x 50; 20
    assert (model.num_moe_layers, model.top_k) == (0, None)
    assert model.score([samples[0]])[0].experts is None
