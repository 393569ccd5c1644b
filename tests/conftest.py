"""Shared fixtures: one Qwen tokenizer per test session (built once into the user cache), and
one HF directory of it; the apps a test served are let go when it ends
(``release_served_apps``)."""

from pathlib import Path

import pytest
from aiohttp import web_app
from transformers import PreTrainedTokenizerFast

from capture_proxy.families.qwen_vocab import load_qwen_tokenizer


def release_served_apps() -> None:
    """Forget the apps aiohttp remembers having served. aiohttp caches each (handler, apps)
    pair's middleware chain in a process-wide LRU of 1024 entries
    (``web_app._cached_build_middleware``): made for one app per process, it keeps every app a
    test suite serves alive with all it holds (a proxy's tokenizers, store, caches: some
    100 MB for an exact-token stack) until evicted. Over the suite that was some 4 GB, and
    tokenizer loads slowed on the grown heap. ``tests/test_app.py`` checks that this lets a
    served app go (it fails if aiohttp moves the cache)."""
    cache = getattr(web_app, "_cached_build_middleware", None)
    if cache is not None:
        cache.cache_clear()


@pytest.fixture(autouse=True)
def _release_served_apps():
    """After each test (its app fixtures torn down first): ``release_served_apps``."""
    yield
    release_served_apps()


@pytest.fixture(scope="session")
def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """The Qwen tokenizer with the keep_reasoning template (cached under
    ``$CAPTURE_PROXY_CACHE`` or ``~/.cache/capture-proxy``)."""
    return load_qwen_tokenizer()


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    """That tokenizer as an HF directory (``capture-proxy export-tokenizer``), written once per
    session: the ``tokenizer`` setting of exact-token stacks. Read only."""
    from capture_proxy.cli import main

    path = tmp_path_factory.mktemp("tok") / "qwen"
    assert main(["export-tokenizer", str(path)]) == 0
    return path


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
