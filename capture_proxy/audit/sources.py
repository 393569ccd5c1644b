"""Where the audit's samples come from: a store directory or a proxy's read API, through the
exporters' own code.

Owns turning rollouts into ``AuditSample`` objects in one of the trainer's forms:

- ``npz``: ``core.samples.write_archive`` then ``read_archive`` (the bytes of
  ``GET .../chains?format=npz`` and ``readers.load_chains``);
- ``arrow``: ``core.export.ExportEncoder`` then ``readers.ExportedRollout.samples`` (the
  stream of ``GET /captures/export``, read as ``readers.iter_rollouts`` reads it);
- ``tree``: ``core.token_tree.build_token_tree`` / ``write_tree`` then ``read_tree`` and each leaf's
  ``path_indices`` (``GET .../tree``, ``readers.load_tree``).

From a store the chains come from ``core.chains.build_chains`` over the snapshot's calls
(``rest.snapshot_records``: late calls left out), as the REST handlers build them. It never
builds a sample itself and never imports torch.
"""

from __future__ import annotations

import io
import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from capture_proxy.core.chains import build_chains
from capture_proxy.core.episodes import parse_episode
from capture_proxy.core.export import ExportEncoder
from capture_proxy.core.records import CallRecord
from capture_proxy.core.samples import ChainSample, chain_samples, read_archive, write_archive
from capture_proxy.core.token_tree import TokenTree, build_token_tree, read_tree, write_tree
from capture_proxy.readers import ExportedRollout, fetch_chains, fetch_tree, iter_rollouts
from capture_proxy.store.base import RolloutInfo

Form = Literal["npz", "arrow", "tree"]
FORMS: tuple[Form, ...] = ("npz", "arrow", "tree")


@dataclass(frozen=True)
class AuditSample:
    """One training sample as a trainer receives it. Arrays over the sample's ``seq``
    positions: ``input_ids`` int64 ``[seq]``, ``loss_mask`` uint8 ``[seq]``, ``log_probs``
    float32 ``[seq]`` (captured; 0.0 off the mask), ``routed_experts`` int64
    ``[seq, num_layers, top_k]`` with ``routed_experts_mask`` uint8 ``[seq]`` or both None;
    ``generation_spans`` int64 ``[num_calls, 2]`` (None in the tree form, which has none)."""

    rollout_id: str
    chain_id: str
    leaf_call_id: str
    call_ids: tuple[str, ...]
    input_ids: np.ndarray
    loss_mask: np.ndarray
    log_probs: np.ndarray
    routed_experts: np.ndarray | None
    routed_experts_mask: np.ndarray | None
    generation_spans: np.ndarray | None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def call_at(self, position: int) -> str | None:
        """The id of the path call that generated ``position``, or None (no spans)."""
        if self.generation_spans is None:
            return None
        for call_id, (start, end) in zip(self.call_ids, self.generation_spans, strict=True):
            if start <= position < end:
                return call_id
        return None


def _sample(
    rollout_id: str,
    chain_id: str,
    leaf_call_id: str,
    call_ids: list[str],
    arrays: dict[str, Any],
) -> AuditSample:
    experts = arrays.get("routed_experts")
    spans = arrays.get("generation_spans")
    return AuditSample(
        rollout_id=rollout_id,
        chain_id=chain_id,
        leaf_call_id=leaf_call_id,
        call_ids=tuple(call_ids),
        input_ids=np.asarray(arrays["input_ids"]).astype(np.int64),
        loss_mask=np.asarray(arrays["loss_mask"]).astype(np.uint8),
        log_probs=np.asarray(arrays["log_probs"]).astype(np.float32),
        routed_experts=None if experts is None else np.asarray(experts).astype(np.int64),
        routed_experts_mask=(
            None if experts is None else np.asarray(arrays["routed_experts_mask"], np.uint8)
        ),
        generation_spans=None if spans is None else np.asarray(spans, np.int64).reshape(-1, 2),
    )


def from_archive(rollout_id: str, samples: list[ChainSample]) -> list[AuditSample]:
    """Samples read back from a chains archive (``read_archive`` / ``load_chains``)."""
    return [_sample(rollout_id, s.chain_id, s.leaf_call_id, s.call_ids, s.arrays) for s in samples]


def from_tree(tree: TokenTree) -> list[AuditSample]:
    """Each leaf's path of a token tree, gathered with ``TokenTree.path_indices``."""
    out = []
    for i, leaf in enumerate(tree.leaves):
        at = tree.path_indices(i)
        arrays: dict[str, Any] = {
            k: tree.arrays[k][at]
            for k in (
                "input_ids",
                "loss_mask",
                "log_probs",
                "routed_experts",
                "routed_experts_mask",
            )
            if k in tree.arrays
        }
        out.append(
            _sample(
                tree.rollout_id, leaf["chain_id"], leaf["leaf_call_id"], leaf["call_ids"], arrays
            )
        )
    return out


def from_export(rollout: ExportedRollout) -> list[AuditSample]:
    """The rows of one rollout of the Arrow export (``ExportedRollout.samples``)."""
    return [
        _sample(rollout.rollout_id, row["chain_id"], row["leaf_call_id"], row["call_ids"], row)
        for row in rollout.samples()
    ]


def _arrow_round_trip(info: RolloutInfo, samples: list[ChainSample]) -> ExportedRollout:
    """The rollout's record batch as the export streams it, read back as a trainer does."""
    import pyarrow as pa

    snapshot = info.snapshot
    episode = parse_episode(info.rollout_id)
    manifest = {
        "rollout_id": info.rollout_id,
        "cursor": snapshot.cursor if snapshot else 0,
        "snapshot": snapshot.to_json() if snapshot else {},
        "version": info.version,
        "episode_of": episode.base,
        "attempt": episode.attempt,
        "main_chain_id": None,
    }
    encoder = ExportEncoder()
    body = encoder.header() + encoder.rollout(manifest, samples, info.metadata) + encoder.end()
    reader = pa.ipc.open_stream(io.BytesIO(body))
    item = reader.read_next_batch_with_custom_metadata()
    return ExportedRollout(json.loads(item.custom_metadata[b"rollout"]), item.batch)


def rollout_samples(info: RolloutInfo, records: list[CallRecord], form: Form) -> list[AuditSample]:
    """A rollout's samples in ``form``, from its snapshot's calls (late calls already left
    out by the caller). Raises ValueError for an unknown form."""
    chains = build_chains(info.rollout_id, records)
    samples = [s for chain in chains.chains for s in chain_samples(chain)]
    if form == "npz":
        buf = io.BytesIO()
        write_archive(chains, buf)
        buf.seek(0)
        return from_archive(info.rollout_id, read_archive(buf)[1])
    if form == "arrow":
        return from_export(_arrow_round_trip(info, samples))
    if form == "tree":
        buf = io.BytesIO()
        write_tree(build_token_tree(info.rollout_id, samples), buf)
        buf.seek(0)
        return from_tree(read_tree(buf))
    raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")


async def store_samples(
    store_dir: Path, rollout_ids: list[str] | None, form: Form
) -> tuple[list[AuditSample], list[str]]:
    """The samples of ``rollout_ids`` (None: every rollout) of the embedded store at
    ``store_dir``, opened as a reader beside a running proxy. Returns (samples, rollout ids
    not found). Raises StoreError when the store cannot be opened."""
    from capture_proxy.rest.reads import snapshot_records
    from capture_proxy.store.sqlite import SQLiteStore

    store = SQLiteStore(store_dir, exclusive=False)
    await store.open()
    try:
        infos: list[RolloutInfo] = []
        missing: list[str] = []
        if rollout_ids is None:
            after = None
            while page := await store.list_rollouts(limit=500, after=after):
                infos.extend(page)
                after = page[-1].rollout_id
        else:
            for rid in rollout_ids:
                info = await store.get_rollout(rid)
                if info is None:
                    missing.append(rid)
                else:
                    infos.append(info)
        out: list[AuditSample] = []
        for info in infos:
            records = snapshot_records(info, await store.get_rollout_calls(info.rollout_id))
            out.extend(rollout_samples(info, records, form))
        return out, missing
    finally:
        await store.close()


def _list_rollout_ids(base_url: str, token: str | None) -> Iterator[str]:
    from capture_proxy.readers import _get

    after: str | None = None
    while True:
        query = {"limit": "1000", **({"after": after} if after else {})}
        url = f"{base_url.rstrip('/')}/captures/rollouts?{urllib.parse.urlencode(query)}"
        with _get(url, token, 300.0) as resp:
            page = json.loads(resp.read())
        yield from (r["rollout_id"] for r in page["rollouts"])
        after = page.get("next_after")
        if not after:
            return


def api_samples(
    base_url: str, token: str | None, rollout_ids: list[str] | None, form: Form
) -> tuple[list[AuditSample], list[str]]:
    """The samples of ``rollout_ids`` (None: every rollout; the ``arrow`` form: every frozen
    one, as ``GET /captures/export`` serves only those) from the proxy at ``base_url``, and
    the ids asked for that the export did not hold (``arrow`` only; the other forms raise
    urllib's HTTPError 404 for an unknown id, as for any 4xx/5xx answer)."""
    if form == "arrow":
        wanted = None if rollout_ids is None else set(rollout_ids)
        exported: list[AuditSample] = []
        seen: set[str] = set()
        for rollout in iter_rollouts(base_url, token=token):
            if wanted is None or rollout.rollout_id in wanted:
                seen.add(rollout.rollout_id)
                exported.extend(from_export(rollout))
        return exported, sorted((wanted or set()) - seen)
    ids = list(rollout_ids) if rollout_ids is not None else list(_list_rollout_ids(base_url, token))
    out: list[AuditSample] = []
    for rid in ids:
        if form == "npz":
            out.extend(from_archive(rid, fetch_chains(base_url, rid, token=token).samples))
        else:
            out.extend(from_tree(fetch_tree(base_url, rid, token=token)))
    return out, []
