"""Shared fixtures: one Qwen tokenizer per test session (built once into the user cache)."""

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from capture_proxy.tokenizer import load_qwen_tokenizer


@pytest.fixture(scope="session")
def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """The Qwen tokenizer with the keep_reasoning template (cached under
    ``$CAPTURE_PROXY_CACHE`` or ``~/.cache/capture-proxy``)."""
    return load_qwen_tokenizer()


@pytest.fixture(scope="session")
def fixtures_dir(request) -> Path:
    """tests/fixtures: recorded harness traffic kept in the repository (see
    ``tests/fixtures/opencode/README.md``); tests read nothing outside the repository."""
    path = Path(request.config.rootpath) / "tests" / "fixtures"
    assert path.is_dir(), f"recorded fixtures not found at {path}"
    return path
