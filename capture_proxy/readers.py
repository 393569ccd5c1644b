"""Readers for training loaders: captured chains as numpy arrays, from the proxy or a file.

Owns the client side of ``GET /captures/rollouts/<id>/chains?format=npz`` (see
``core.samples`` for the archive and the arrays). Depends on numpy and the standard library
only, so a training job can import it without aiohttp.

    from capture_proxy.readers import load_chains, fetch_chains
    samples = fetch_chains("http://proxy:8080", "rollout-17")
    for s in samples:
        s.arrays["input_ids"], s.arrays["loss_mask"], s.arrays["log_probs"]
"""

from __future__ import annotations

import io
import os
import urllib.parse
import urllib.request
from typing import IO

from capture_proxy.core.samples import ChainSample, read_archive

__all__ = ["ChainSample", "fetch_chains", "load_chains"]


def load_chains(source: bytes | str | os.PathLike[str] | IO[bytes]) -> list[ChainSample]:
    """Samples from a chains archive: its bytes, a path to it, or an open binary file.
    Raises ValueError when it is not a chains archive this reader knows."""
    if isinstance(source, bytes | bytearray):
        return read_archive(io.BytesIO(source))[1]
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as f:
            return read_archive(f)[1]
    return read_archive(source)[1]


def fetch_chains(
    base_url: str, rollout_id: str, *, token: str | None = None, timeout_s: float = 300.0
) -> list[ChainSample]:
    """GET a rollout's chains archive from a proxy at ``base_url`` (e.g.
    ``http://127.0.0.1:8080``). ``token``: the proxy's ``captures_token`` (default: the
    ``CAPTURE_PROXY_CAPTURES_TOKEN`` environment variable, if set). Raises urllib's HTTPError
    for 4xx/5xx answers (401: a missing or wrong token)."""
    quoted = urllib.parse.quote(rollout_id, safe="")
    url = f"{base_url.rstrip('/')}/captures/rollouts/{quoted}/chains?format=npz"
    token = token if token is not None else os.environ.get("CAPTURE_PROXY_CAPTURES_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # noqa: S310 (http only)
        return load_chains(resp.read())
