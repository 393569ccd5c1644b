"""Fixtures of the audit's tests: the proxy stack of tier 2 (a scripted engine and the proxy
on loopback ports), and tiny random-weight Qwen3 models built from a config (never a hub
download), MoE and dense, with the qwen3 family's tokenizer beside the weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.proxy.conftest import make_stack, stack_store_kind

__all__ = ["make_stack", "stack_store_kind"]

TINY = dict(
    vocab_size=151936,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    # Larger than the default 0.02 so that the random model's distributions are not flat:
    # a token shifted by one then shows as a cliff, as it does with a trained model.
    initializer_range=0.2,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """``{"moe": dir, "dense": dir}``: float32 tiny Qwen3-MoE (2 layers, 4 experts, top 2) and
    dense Qwen3, seed 0, saved with ``save_pretrained`` and the qwen3 tokenizer."""
    torch = pytest.importorskip("torch", reason="the audit extra: scripts/install-audit")
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from capture_proxy.families import write_model_tokenizer

    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, cls, config in (
        (
            "moe",
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                norm_topk_prob=True,
                **TINY,
            ),
        ),
        ("dense", Qwen3ForCausalLM, Qwen3Config(**TINY)),
    ):
        torch.manual_seed(0)
        model = cls(config).eval()
        path = root / name
        model.save_pretrained(path)
        write_model_tokenizer(path, "qwen3")
        out[name] = path
    return out
