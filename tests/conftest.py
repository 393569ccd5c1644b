"""Shared fixtures: one Qwen tokenizer per test session (built once into the user cache)."""

import pytest
from transformers import PreTrainedTokenizerFast

from capture_proxy.tokenizer import load_qwen_tokenizer


@pytest.fixture(scope="session")
def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """The Qwen tokenizer with the keep_reasoning template (cached under
    ``$CAPTURE_PROXY_CACHE`` or ``~/.cache/capture-proxy``)."""
    return load_qwen_tokenizer()
