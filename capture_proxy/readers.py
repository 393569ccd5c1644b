"""Readers for training loaders: captured rollouts as numpy / Arrow, from the proxy or a file.

Owns the client side of the read API for trainers (see ``core.samples``, ``core.export`` and
``core.token_tree`` for the forms). Depends on numpy, pyarrow (imported only by the bulk reader; the
``arrow`` extra, else an ImportError naming it) and the standard library, so a training job
can import it without aiohttp. Every function that talks to a proxy takes ``token``: the
proxy's ``captures_token``, sent as a bearer token.

    from capture_proxy.readers import fetch_chains, iter_rollouts
    chains = fetch_chains("http://proxy:8080", "rollout-17", token=TOKEN)
    chains.manifest["main_chain_id"], chains.incomplete, chains.unlinked_call_ids
    for s in chains:                       # ChainSample, one per root-to-leaf path
        s.arrays["input_ids"], s.arrays["loss_mask"], s.arrays["log_probs"]
        s.arrays["weight_versions"][s.arrays["weight_version_index"]]  # -1: none (masked)

    for rollout in iter_rollouts("http://proxy:8080", token=TOKEN, after=last_cursor):
        train_on(rollout.samples())        # dicts of numpy arrays, one per sample
        commit(rollout.cursor)             # durably: resume after it
        retire(rollout.rollout_id, rollout.snapshot_id, rollout.version)

A busy proxy answers a read it could not start within its ``read_api_timeout_s`` with ``503``
and ``Retry-After`` (code ``read_timeout``): every function here waits as long as it says (at
most ``MAX_RETRY_AFTER_S``) and asks again, up to ``READ_RETRIES`` times (a module setting:
``readers.READ_RETRIES = 0`` to see the first 503), then raises it.

Errors: urllib's ``HTTPError`` for 4xx/5xx answers (its body is the proxy's error JSON);
``ValueError`` for a body that is not the form asked for (``load_chains`` of a non-archive,
a stream of another format or a newer version); pyarrow's ``ArrowInvalid`` for a bulk stream
cut short (the rollouts yielded before it are whole).
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from capture_proxy.core.samples import ChainSample, read_archive, read_archive_images
from capture_proxy.core.token_tree import TokenTree, read_tree
from capture_proxy.core.weight_versions import sequence_index

__all__ = [
    "ChainSample",
    "Chains",
    "ExportedRollout",
    "TokenTree",
    "fetch_atif",
    "fetch_chains",
    "fetch_tree",
    "iter_rollouts",
    "load_chains",
    "load_tree",
]


@dataclass(frozen=True)
class Chains:
    """A rollout's chains archive: ``manifest`` (``manifest.json``: ``rollout_id``,
    ``samples``, ``unlinked_call_ids``, ``main_chain_id``, ``incomplete``, ``lifecycle``,
    ``images``), ``samples`` in manifest order and ``images``: each image's bytes by sha256
    (a sample's ``images`` entries name them; ``families.vision.rebuild_pixel_values(bytes,
    entry["processor"])`` rebuilds its pixel input). Iterating, ``len`` and indexing go over
    the samples."""

    manifest: dict[str, Any]
    samples: list[ChainSample]
    images: dict[str, bytes] = field(default_factory=dict)

    @property
    def incomplete(self) -> bool:
        return bool(self.manifest.get("incomplete"))

    @property
    def unlinked_call_ids(self) -> list[str]:
        return list(self.manifest.get("unlinked_call_ids", []))

    @property
    def main_chain_id(self) -> str | None:
        return self.manifest.get("main_chain_id")

    @property
    def main_chain(self) -> list[ChainSample]:
        """The samples of the main chain (the one with the most generated tokens)."""
        return [s for s in self.samples if s.chain_id == self.main_chain_id]

    def __iter__(self) -> Iterator[ChainSample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> ChainSample:
        return self.samples[i]


def _read_source(source: bytes | str | os.PathLike[str] | IO[bytes]) -> IO[bytes]:
    if isinstance(source, bytes | bytearray):
        return io.BytesIO(source)
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as f:
            return io.BytesIO(f.read())
    return source


def load_chains(source: bytes | str | os.PathLike[str] | IO[bytes]) -> Chains:
    """A chains archive: its bytes, a path to it, or an open binary file. Raises ValueError
    when it is not a chains archive this reader knows (not a zip, another format, newer)."""
    data = _read_source(source).read()
    try:
        manifest, samples = read_archive(io.BytesIO(data))
        images = read_archive_images(io.BytesIO(data))
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a chains archive: {exc}") from exc
    return Chains(manifest, samples, images)


def load_tree(source: bytes | str | os.PathLike[str] | IO[bytes]) -> TokenTree:
    """A token tree archive (``GET .../tree``). Raises ValueError when it is not one."""
    try:
        return read_tree(_read_source(source))
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a token tree archive: {exc}") from exc


#: Times a read answered ``503`` with ``Retry-After`` is asked again (module docstring).
READ_RETRIES = 4
#: Longest wait taken from one ``Retry-After`` (seconds).
MAX_RETRY_AFTER_S = 30.0
#: Times ``iter_rollouts`` asks again, after the last rollout it handed out, for a page that
#: was cut with no rollout read since the last time
CUT_RESUMES = 3

log = logging.getLogger(__name__)


def _get(url: str, token: str | None, timeout_s: float) -> Any:
    """``token``: the proxy's ``captures_token`` (default: the ``CAPTURE_PROXY_CAPTURES_TOKEN``
    environment variable, if set). A ``503`` with ``Retry-After`` in seconds is asked again
    after that wait, up to ``READ_RETRIES`` times; any other error, or the last, raises."""
    token = token if token is not None else os.environ.get("CAPTURE_PROXY_CAPTURES_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, headers=headers)
    retries = 0
    while True:
        try:
            return urllib.request.urlopen(request, timeout=timeout_s)  # noqa: S310 (http only)
        except urllib.error.HTTPError as exc:
            wait_s = _retry_after_s(exc) if exc.code == 503 else None
            if wait_s is None or retries >= READ_RETRIES:
                raise
            exc.close()
            time.sleep(wait_s)
            retries += 1


def _retry_after_s(error: urllib.error.HTTPError) -> float | None:
    """The wait an error's ``Retry-After`` names in seconds (at most ``MAX_RETRY_AFTER_S``);
    None without one, or for the HTTP-date form."""
    value = error.headers.get("Retry-After") if error.headers is not None else None
    try:
        wait_s = float(value) if value is not None else None
    except ValueError:
        return None
    if wait_s is None or not wait_s >= 0:
        return None
    return min(wait_s, MAX_RETRY_AFTER_S)


def _rollout_url(base_url: str, rollout_id: str, tail: str) -> str:
    quoted = urllib.parse.quote(rollout_id, safe="")
    return f"{base_url.rstrip('/')}/captures/rollouts/{quoted}/{tail}"


def _weight_query(
    min_weight_version: int | None,
    weight_versions: list[str] | None,
    unknown_weight_version: str | None,
) -> list[tuple[str, str]]:
    """The weight-version filter's query parameters (``core.weight_filter``)."""
    out = [] if min_weight_version is None else [("min_weight_version", str(min_weight_version))]
    out += [("weight_version", v) for v in weight_versions or ()]
    if unknown_weight_version is not None:
        out.append(("unknown_weight_version", unknown_weight_version))
    return out


def fetch_chains(
    base_url: str,
    rollout_id: str,
    *,
    token: str | None = None,
    timeout_s: float = 300.0,
    min_weight_version: int | None = None,
    weight_versions: list[str] | None = None,
    unknown_weight_version: str | None = None,
) -> Chains:
    """GET a rollout's chains archive from a proxy at ``base_url`` (e.g.
    ``http://127.0.0.1:8080``); ``min_weight_version``, ``weight_versions`` (exact) and
    ``unknown_weight_version`` (``"drop"`` | ``"keep"``) keep only the samples whose generated
    tokens pass (``core.weight_filter``; the dropped ones are named in
    ``manifest["weight_filter"]``). Raises urllib's HTTPError for 4xx/5xx answers."""
    query = urllib.parse.urlencode(
        [
            ("format", "npz"),
            *_weight_query(min_weight_version, weight_versions, unknown_weight_version),
        ]
    )
    url = _rollout_url(base_url, rollout_id, f"chains?{query}")
    with _get(url, token, timeout_s) as resp:
        return load_chains(resp.read())


def fetch_tree(
    base_url: str, rollout_id: str, *, token: str | None = None, timeout_s: float = 300.0
) -> TokenTree:
    """GET a rollout's token tree (``core.token_tree``). Raises HTTPError for 4xx/5xx answers."""
    with _get(_rollout_url(base_url, rollout_id, "tree"), token, timeout_s) as resp:
        return load_tree(resp.read())


def fetch_atif(
    base_url: str,
    rollout_id: str,
    *,
    token: str | None = None,
    strict: bool = False,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """GET a rollout as an ATIF trajectory (``core.atif``); ``strict``: refused (HTTPError
    422) when the rollout has any gap diagnostic."""
    tail = "atif" + ("?strict=true" if strict else "")
    with _get(_rollout_url(base_url, rollout_id, tail), token, timeout_s) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


@dataclass(frozen=True)
class ExportedRollout:
    """One rollout of a bulk export: its ``manifest`` (``core.export``) and ``batch`` (a
    ``pyarrow.RecordBatch`` of ``core.export.SCHEMA``, one row per sample)."""

    manifest: dict[str, Any]
    batch: Any

    @property
    def rollout_id(self) -> str:
        return str(self.manifest["rollout_id"])

    @property
    def cursor(self) -> int:
        """Commit this once the rollout is durably taken; resume with ``after=cursor``."""
        return int(self.manifest["cursor"])

    @property
    def snapshot_id(self) -> str:
        return str(self.manifest["snapshot"]["snapshot_id"])

    @property
    def version(self) -> int:
        """The version read: retire with it."""
        return int(self.manifest["version"])

    @property
    def superseded_by(self) -> str | None:
        """The final episode's rollout id when this episode is superseded (0 samples)."""
        return self.manifest.get("superseded_by")

    def samples(self) -> list[dict[str, Any]]:
        """The rows as dicts: list columns as numpy arrays (``routed_experts`` reshaped to
        ``[seq, num_layers, top_k]``), the others as Python values; and from
        ``weight_version_spans`` (``[{"version", "start", "end"}]`` over the positions), the
        npz's ``weight_version_index`` (int16 ``[seq]``, -1 where no span lies) and
        ``weight_versions`` (the sample's versions, oldest first).
        ``weight_version_sources``: a list of strings, None for an unknown source."""
        return _numpy_rows(self.batch)


def _numpy_rows(batch: Any) -> list[dict[str, Any]]:
    arrays = {
        "input_ids": np.uint32,
        "loss_mask": np.uint8,
        "log_probs": np.float32,
        "routed_experts_mask": np.uint8,
        "routed_experts": np.uint16,
    }
    columns = {name: batch.column(name) for name in batch.schema.names}
    rows = []
    for i in range(batch.num_rows):
        row: dict[str, Any] = {}
        for name, column in columns.items():
            cell = column[i]
            if name in arrays:
                row[name] = (
                    None
                    if not cell.is_valid
                    else cell.values.to_numpy(zero_copy_only=False).astype(arrays[name])
                )
            elif name in ("generation_spans", "image_spans"):
                row[name] = np.array(cell.as_py() or [], np.int64).reshape(-1, 2)
            else:
                row[name] = cell.as_py()
        shape = row.get("routed_experts_shape")
        if row.get("routed_experts") is not None and shape is not None:
            row["routed_experts"] = row["routed_experts"].reshape(shape)
        if isinstance(row.get("named_rewards"), list):
            row["named_rewards"] = dict(row["named_rewards"])
        if isinstance(row.get("tags"), list):
            row["tags"] = dict(row["tags"])
        if "weight_version_spans" in row:
            _version_arrays(row)
        rows.append(row)
    return rows


def _version_arrays(row: dict[str, Any]) -> None:
    """The npz's ``weight_version_index`` (int16 ``[seq]``) and ``weight_versions`` from the
    row's ``weight_version_spans`` (``core.export``)."""
    spans = [(s["version"], s["start"], s["end"]) for s in row["weight_version_spans"] or ()]
    table, index = sequence_index(spans, len(row["input_ids"]))
    row["weight_version_index"], row["weight_versions"] = index, table


def iter_rollouts(
    base_url: str,
    *,
    token: str | None = None,
    after: int = 0,
    limit: int = 100,
    episodes: str = "final",
    timeout_s: float = 300.0,
    min_weight_version: int | None = None,
    weight_versions: list[str] | None = None,
    unknown_weight_version: str | None = None,
) -> Iterator[ExportedRollout]:
    """Every frozen rollout with a cursor greater than ``after``, in cursor order, page by
    page (``limit`` per request) until a page comes back short. Rollouts frozen while this
    runs are included when they sort after the pages already read. The weight-version filter
    (as ``fetch_chains``) keeps only the samples that pass; a rollout all of whose samples are
    dropped still comes, with 0 rows, to be retired. A page cut while the loop's body works
    (the proxy bounds how long it waits for a reader: ``read_send_timeout_s``) is asked again
    after the last rollout handed out, up to ``CUT_RESUMES`` times without a rollout read in
    between. Raises HTTPError for 4xx/5xx, ValueError for another format, pyarrow's
    ArrowInvalid (or the socket's error) for a stream cut more often than that."""
    try:
        import pyarrow as pa  # a trainer that only reads archives does not need it
    except ImportError as exc:
        raise ImportError(
            "iter_rollouts reads the Arrow export with pyarrow: pip install 'capture-proxy[arrow]'"
        ) from exc

    weight_query = _weight_query(min_weight_version, weight_versions, unknown_weight_version)
    cuts = 0
    while True:
        query = urllib.parse.urlencode(
            [
                ("status", "frozen"),
                ("after", str(after)),
                ("limit", str(limit)),
                ("episodes", episodes),
                *weight_query,
            ]
        )
        count = 0
        try:
            url = f"{base_url.rstrip('/')}/captures/export?{query}"
            for manifest, batch in _export_page(pa, url, token, timeout_s):
                count += 1
                after = int(manifest["cursor"])
                cuts = 0
                yield ExportedRollout(manifest, batch)
        except (pa.ArrowInvalid, OSError, http.client.HTTPException) as exc:
            # The page was cut (the proxy's ``read_send_timeout_s`` ran out while the loop's
            # body worked on a rollout, or the connection dropped): asked again after the last
            # rollout handed out, which loses and repeats none (cursor order). An HTTP error
            # or a connection refused is no cut.
            cuts += 1
            if isinstance(exc, urllib.error.URLError) or cuts > CUT_RESUMES:
                raise
            log.info("export page cut after %d rollouts (%s); resuming after %d", count, exc, after)
            continue
        if count < limit:
            return


def _export_page(
    pa: Any, url: str, token: str | None, timeout_s: float
) -> Iterator[tuple[dict[str, Any], Any]]:
    """One page of the Arrow export: each rollout's manifest and record batch, in order.
    Raises ValueError for another format or a newer version."""
    from capture_proxy.core.export import EXPORT_FORMAT, EXPORT_VERSION, MANIFEST_KEY

    with _get(url, token, timeout_s) as resp:
        reader = pa.ipc.open_stream(resp)
        meta = reader.schema.metadata or {}
        if meta.get(b"format") != EXPORT_FORMAT.encode():
            raise ValueError(f"not a {EXPORT_FORMAT} stream")
        if int(meta.get(b"version", b"0")) > EXPORT_VERSION:
            raise ValueError(f"export version {meta[b'version'].decode()} is newer")
        while True:
            try:
                item = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                return
            yield json.loads(item.custom_metadata[MANIFEST_KEY.encode()]), item.batch
