"""Shared fixtures: one Qwen tokenizer per test session (built once into the user cache)."""

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from capture_proxy.families.qwen_vocab import load_qwen_tokenizer


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


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server from Debian's packages for the whole session (``initdb`` in a
    temporary directory, a loopback port, run as a non-root user when we are root), stopped at
    the end. Skipped when PostgreSQL is not installed (``scripts/install-postgres``), except
    under CI, where that is a failure."""
    import os

    from benchmarks.infra import PostgresServer, postgres_bin_dir

    bin_dir = postgres_bin_dir()
    if bin_dir is None or not (bin_dir / "postgres").exists():
        message = "PostgreSQL is not installed (scripts/install-postgres)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = PostgresServer(bin_dir)
    server.start(deadline_s=60)
    try:
        yield server
    finally:
        server.stop()
