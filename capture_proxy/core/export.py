"""Bulk export encoding: frozen rollouts as one Arrow IPC stream, one row per training sample.

Owns the columnar form of ``GET /captures/export`` (``readers.iter_rollouts`` reads it). Why
Arrow IPC *streaming*: it is written and read incrementally (a record batch at a time, no
footer, unlike Parquet or a zip of npz, whose index comes last), so the proxy streams a page
of rollouts without holding it and a trainer that crashes mid-stream keeps every batch it
received whole; and pyarrow, polars, DuckDB, Ray Data and Hugging Face datasets read it as it
is, zero-copy into numpy.

Stream layout: the schema (``SCHEMA``; schema metadata ``format`` = ``EXPORT_FORMAT``,
``version`` = ``EXPORT_VERSION``), then one record batch per rollout, in cursor order, whose
custom metadata ``rollout`` is the rollout's manifest (JSON: ``rollout_id``, ``cursor``,
``snapshot``, ``version``, ``episode_of``, ``attempt``, ``superseded_by``, ``metadata``,
``unlinked_call_ids``, ``late_call_ids``, ``main_chain_id``, ``incomplete``, ``diagnostics``,
``num_samples``). A rollout with no sample (every call failed) or a superseded episode (exports
of final episodes only) is a batch of 0 rows: it still has its manifest, so the trainer can
retire it and the cursor passes it.

Columns, per sample (one root-to-leaf path of a chain, ``core.samples``):

- ``rollout_id``, ``snapshot_id``, ``chain_id``, ``leaf_call_id``: string; ``cursor``,
  ``version``: int64; ``episode_of``: string, ``attempt``: int32; ``main_chain``: bool;
- ``call_ids``: list<string> (the path's calls); ``input_ids``: list<uint32> ``[seq]``;
  ``loss_mask``: list<uint8> ``[seq]``; ``log_probs``: list<float32> ``[seq]`` (0.0 off the
  mask); ``generation_spans``: list<fixed_size_list<int64, 2>> ``[num_calls]``;
- ``routed_experts``: list<uint16>, the ``[seq, num_layers, top_k]`` array flattened
  row-major, with ``routed_experts_shape`` fixed_size_list<int32, 3> and
  ``routed_experts_mask`` list<uint8> ``[seq]``; null without routed experts;
- ``reward``: float64 (null unless one number), ``named_rewards``: map<string, float64> (null
  unless named), ``task_id``: string, ``tags``: map<string, string>.

Pure: no I/O; ``ExportEncoder`` returns bytes for the caller to send.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pyarrow as pa

from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.samples import ChainSample

EXPORT_FORMAT = "capture-proxy.export.arrow"
EXPORT_VERSION = 1
#: The content type of the stream (the IANA registration for the Arrow IPC stream format).
CONTENT_TYPE = "application/vnd.apache.arrow.stream"
#: Custom-metadata key of each record batch: the rollout's manifest, JSON.
MANIFEST_KEY = "rollout"

SCHEMA = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("cursor", pa.int64()),
        ("snapshot_id", pa.string()),
        ("version", pa.int64()),
        ("episode_of", pa.string()),
        ("attempt", pa.int32()),
        ("chain_id", pa.string()),
        ("leaf_call_id", pa.string()),
        ("main_chain", pa.bool_()),
        ("call_ids", pa.list_(pa.string())),
        ("input_ids", pa.list_(pa.uint32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("log_probs", pa.list_(pa.float32())),
        ("generation_spans", pa.list_(pa.list_(pa.int64(), 2))),
        ("routed_experts", pa.list_(pa.uint16())),
        ("routed_experts_shape", pa.list_(pa.int32(), 3)),
        ("routed_experts_mask", pa.list_(pa.uint8())),
        ("reward", pa.float64()),
        ("named_rewards", pa.map_(pa.string(), pa.float64())),
        ("task_id", pa.string()),
        ("tags", pa.map_(pa.string(), pa.string())),
    ],
    metadata={"format": EXPORT_FORMAT, "version": str(EXPORT_VERSION)},
)


def _lists(values: list[np.ndarray | None], value_type: pa.DataType) -> pa.Array:
    """A list array from numpy arrays (None: a null list), without going through Python."""
    present = [v for v in values if v is not None]
    lengths = np.array([0 if v is None else v.shape[0] for v in values], np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = (
        np.concatenate([np.ascontiguousarray(v).reshape(-1) for v in present])
        if present
        else np.zeros(0)
    )
    mask = pa.array([v is None for v in values]) if len(present) < len(values) else None
    return pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(flat, type=value_type), type=pa.list_(value_type), mask=mask
    )


def _experts(sample: ChainSample) -> tuple[np.ndarray | None, list[int] | None]:
    experts = sample.arrays.get("routed_experts")
    if experts is None:
        return None, None
    if experts.size and int(experts.max()) > np.iinfo(np.uint16).max:
        raise ValueError(f"routed expert ids of {sample.leaf_call_id} do not fit uint16")
    return experts.astype(np.uint16).reshape(-1), [int(n) for n in experts.shape]


def rollout_batch(
    manifest: dict[str, Any],
    samples: list[ChainSample],
    metadata: RolloutMetadata,
) -> pa.RecordBatch:
    """One rollout's samples as a record batch of ``SCHEMA`` (``manifest`` gives the rollout
    columns: ``rollout_id``, ``cursor``, ``snapshot``, ``version``, ``episode_of``,
    ``attempt``, ``main_chain_id``). Raises ValueError for expert ids past uint16."""
    n = len(samples)
    experts = [_experts(s) for s in samples]
    snapshot = manifest.get("snapshot") or {}
    named = metadata.named_rewards
    columns: dict[str, pa.Array] = {
        "rollout_id": pa.array([manifest["rollout_id"]] * n, pa.string()),
        "cursor": pa.array([manifest["cursor"]] * n, pa.int64()),
        "snapshot_id": pa.array([snapshot.get("snapshot_id")] * n, pa.string()),
        "version": pa.array([manifest["version"]] * n, pa.int64()),
        "episode_of": pa.array([manifest["episode_of"]] * n, pa.string()),
        "attempt": pa.array([manifest["attempt"]] * n, pa.int32()),
        "chain_id": pa.array([s.chain_id for s in samples], pa.string()),
        "leaf_call_id": pa.array([s.leaf_call_id for s in samples], pa.string()),
        "main_chain": pa.array([s.chain_id == manifest["main_chain_id"] for s in samples]),
        "call_ids": pa.array([s.call_ids for s in samples], pa.list_(pa.string())),
        "input_ids": _lists([s.arrays["input_ids"] for s in samples], pa.uint32()),
        "loss_mask": _lists([s.arrays["loss_mask"] for s in samples], pa.uint8()),
        "log_probs": _lists([s.arrays["log_probs"] for s in samples], pa.float32()),
        "generation_spans": pa.array(
            [s.arrays["generation_spans"].tolist() for s in samples],
            pa.list_(pa.list_(pa.int64(), 2)),
        ),
        "routed_experts": _lists([e for e, _ in experts], pa.uint16()),
        "routed_experts_shape": pa.array([shape for _, shape in experts], pa.list_(pa.int32(), 3)),
        "routed_experts_mask": _lists(
            [s.arrays.get("routed_experts_mask") for s in samples], pa.uint8()
        ),
        "reward": pa.array([metadata.scalar_reward] * n, pa.float64()),
        "named_rewards": pa.array(
            [None if named is None else list(named.items())] * n,
            pa.map_(pa.string(), pa.float64()),
        ),
        "task_id": pa.array([metadata.task_id] * n, pa.string()),
        "tags": pa.array([list(metadata.tags.items())] * n, pa.map_(pa.string(), pa.string())),
    }
    return pa.RecordBatch.from_arrays([columns[f.name] for f in SCHEMA], schema=SCHEMA)


class ExportEncoder:
    """Writes the stream in pieces: ``header()`` first, one ``rollout()`` per rollout, then
    ``end()`` (the end-of-stream marker; a stream without it was cut). Not thread-safe: one
    encoder per response, used from one thread at a time."""

    def __init__(self) -> None:
        self._sink = io.BytesIO()
        self._writer = pa.ipc.new_stream(self._sink, SCHEMA)

    def _drain(self) -> bytes:
        out = self._sink.getvalue()
        self._sink.seek(0)
        self._sink.truncate()
        return out

    def header(self) -> bytes:
        return self._drain()

    def rollout(
        self, manifest: dict[str, Any], samples: list[ChainSample], metadata: RolloutMetadata
    ) -> bytes:
        """The bytes of one rollout's record batch (see the module docstring)."""
        batch = rollout_batch(manifest, samples, metadata)
        text = json.dumps({**manifest, "num_samples": len(samples)}, ensure_ascii=False)
        self._writer.write_batch(batch, custom_metadata={MANIFEST_KEY: text})
        return self._drain()

    def end(self) -> bytes:
        self._writer.close()
        return self._drain()
