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
``unlinked_call_ids``, ``late_call_ids``, ``main_chain_id``, ``lineage``, ``incomplete``,
``diagnostics``, ``num_samples``). A rollout with no sample (every call failed) or a
superseded episode (exports of final episodes only) is a batch of 0 rows: it still has its
manifest, so the trainer can retire it and the cursor passes it.

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
  unless named), ``task_id``: string, ``tags``: map<string, string>;
- ``lineage``: string, JSON, the lineage edges into the sample's chain
  (``[{"kind", "chain_id", "from_call_id", "evidence"}]``, ``core.lineage``; ``[]`` for none);
- ``weight_version_spans``: list<struct<version: string, start: int64, end: int64>>, the
  sample's weight versions as half-open runs over its positions (``[start, end)`` of
  ``input_ids``), in order: the npz's ``weight_version_index`` run-length encoded (positions
  in no span: prompt, interstitial, or generated of no known version);
  ``weight_version_sources``: list<string> ``[num_calls]``, each path call's
  ``weight_version_source``, null when unknown. Spans rather than a per-token index: a handful
  of runs per call instead of 4 bytes a token (the index added 44% to the stream of a long
  rollout, ``benchmarks/weight_export.py``), and a query engine reads a sample's versions
  without unnesting its tokens; ``readers.iter_rollouts`` lays them back out as the npz's
  ``weight_version_index`` and ``weight_versions``.

- images (``core.samples``; empty lists for a sample without): ``image_sha256``: list<string>
  (each image of the leaf's prompt, in prompt order, by the SHA-256 of its bytes);
  ``image_spans``: list<fixed_size_list<int64, 2>> (its ``<|image_pad|>`` positions
  ``[start, end)`` in ``input_ids``); ``image_processor``: list<string> (JSON, the processor
  params that rebuild its ``pixel_values``, ``families.vision.rebuild_pixel_values``);
  ``image_media_type``: list<string>; ``image_data``: list<binary> (its bytes): each row is
  whole by itself, an image carried by several rows (or twice in one) is in each.

Versions: 2 added the two ``weight_version*`` columns (after ``lineage``, so the earlier
columns keep their positions) and the manifest's ``weight_filter`` (``core.weight_filter``:
the filter of the request and the samples it dropped; null without one); 3 added the five
``image_*`` columns (after them).

The bytes are written by ``core.arrow_ipc`` (no pyarrow needed to serve the export); a
reader needs any Arrow library (``readers.iter_rollouts`` uses pyarrow, the ``arrow`` extra).

Pure: no I/O; ``ExportEncoder`` returns bytes for the caller to send.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from capture_proxy.core import arrow_ipc as ipc
from capture_proxy.core.images import PromptImage
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.samples import ChainSample
from capture_proxy.core.weight_versions import sequence_spans

EXPORT_FORMAT = "capture-proxy.export.arrow"
EXPORT_VERSION = 3
#: The content type of the stream (the IANA registration for the Arrow IPC stream format).
CONTENT_TYPE = "application/vnd.apache.arrow.stream"
#: Custom-metadata key of each record batch: the rollout's manifest, JSON.
MANIFEST_KEY = "rollout"
#: The schema's key-value metadata.
SCHEMA_METADATA = {"format": EXPORT_FORMAT, "version": str(EXPORT_VERSION)}

_SPAN_FIELDS = (
    ipc.Field("version", ipc.utf8()),
    ipc.Field("start", ipc.int_(64)),
    ipc.Field("end", ipc.int_(64)),
)

SCHEMA: tuple[ipc.Field, ...] = tuple(
    ipc.Field(name, kind)
    for name, kind in [
        ("rollout_id", ipc.utf8()),
        ("cursor", ipc.int_(64)),
        ("snapshot_id", ipc.utf8()),
        ("version", ipc.int_(64)),
        ("episode_of", ipc.utf8()),
        ("attempt", ipc.int_(32)),
        ("chain_id", ipc.utf8()),
        ("leaf_call_id", ipc.utf8()),
        ("main_chain", ipc.bool_()),
        ("call_ids", ipc.list_(ipc.utf8())),
        ("input_ids", ipc.list_(ipc.int_(32, signed=False))),
        ("loss_mask", ipc.list_(ipc.int_(8, signed=False))),
        ("log_probs", ipc.list_(ipc.float_(32))),
        ("generation_spans", ipc.list_(ipc.fixed_size_list(ipc.int_(64), 2))),
        ("routed_experts", ipc.list_(ipc.int_(16, signed=False))),
        ("routed_experts_shape", ipc.fixed_size_list(ipc.int_(32), 3)),
        ("routed_experts_mask", ipc.list_(ipc.int_(8, signed=False))),
        ("reward", ipc.float_(64)),
        ("named_rewards", ipc.map_(ipc.utf8(), ipc.float_(64))),
        ("task_id", ipc.utf8()),
        ("tags", ipc.map_(ipc.utf8(), ipc.utf8())),
        ("lineage", ipc.utf8()),
        ("weight_version_spans", ipc.list_(ipc.struct_(_SPAN_FIELDS))),
        ("weight_version_sources", ipc.list_(ipc.utf8())),
        ("image_sha256", ipc.list_(ipc.utf8())),
        ("image_spans", ipc.list_(ipc.fixed_size_list(ipc.int_(64), 2))),
        ("image_processor", ipc.list_(ipc.utf8())),
        ("image_media_type", ipc.list_(ipc.utf8())),
        ("image_data", ipc.list_(ipc.binary())),
    ]
)


def _experts(sample: ChainSample) -> tuple[np.ndarray | None, list[int] | None]:
    experts = sample.arrays.get("routed_experts")
    if experts is None:
        return None, None
    if experts.size and int(experts.max()) > np.iinfo(np.uint16).max:
        raise ValueError(f"routed expert ids of {sample.leaf_call_id} do not fit uint16")
    return experts.astype(np.uint16, copy=False).reshape(-1), [int(n) for n in experts.shape]


def _call_ids(samples: list[ChainSample]) -> ipc.Column:
    flat = ipc.strings([c for s in samples for c in s.call_ids])
    return ipc.list_of(flat, [len(s.call_ids) for s in samples])


def _generation_spans(samples: list[ChainSample]) -> ipc.Column:
    spans = [np.asarray(s.arrays["generation_spans"], np.int64).reshape(-1, 2) for s in samples]
    flat = np.concatenate(spans) if spans else np.zeros((0, 2), np.int64)
    pairs = ipc.Column(flat.shape[0], 0, (b"",), (ipc.primitive(flat.astype("<i8")),))
    return ipc.list_of(pairs, [s.shape[0] for s in spans])


def _sources(samples: list[ChainSample]) -> ipc.Column:
    """list<utf8>: each path call's source (the npz's ``""``, unknown, as null)."""
    rows = [[str(v) or None for v in s.arrays.get("weight_version_sources", ())] for s in samples]
    return ipc.list_of(ipc.strings([v for row in rows for v in row]), [len(r) for r in rows])


def _version_spans(samples: list[ChainSample]) -> ipc.Column:
    """list<struct<version, start, end>>: each sample's version index as runs."""
    rows = [
        sequence_spans(
            [str(v) for v in s.arrays["weight_versions"]], s.arrays["weight_version_index"]
        )
        if "weight_version_index" in s.arrays
        else []
        for s in samples
    ]
    flat = [span for row in rows for span in row]
    bounds = np.array([(a, b) for _, a, b in flat], "<i8").reshape(-1, 2)
    spans = ipc.structs(
        len(flat),
        [
            ipc.strings([v for v, _, _ in flat]),
            ipc.primitive(np.ascontiguousarray(bounds[:, 0])),
            ipc.primitive(np.ascontiguousarray(bounds[:, 1])),
        ],
    )
    return ipc.list_of(spans, [len(row) for row in rows])
def _image_columns(
    samples: list[ChainSample], images: Mapping[str, PromptImage]
) -> dict[str, ipc.Column]:
    """The image columns (see the module docstring). Raises ValueError for an image whose
    bytes ``images`` lacks."""
    lengths = [len(s.images) for s in samples]
    entries = [e for s in samples for e in s.images]
    missing = sorted({str(e["sha256"]) for e in entries} - set(images))
    if missing:
        raise ValueError(f"image {missing[0]} of a sample is not among the images given")
    spans = np.array([[e["prompt_start"], e["prompt_end"]] for e in entries], np.int64)
    pairs = ipc.Column(len(entries), 0, (b"",), (ipc.primitive(spans.reshape(-1).astype("<i8")),))
    found = [images[str(e["sha256"])] for e in entries]
    return {
        "image_sha256": ipc.list_of(ipc.strings([str(e["sha256"]) for e in entries]), lengths),
        "image_spans": ipc.list_of(pairs, lengths),
        "image_processor": ipc.list_of(
            ipc.strings([json.dumps(e.get("processor"), sort_keys=True) for e in entries]),
            lengths,
        ),
        "image_media_type": ipc.list_of(ipc.strings([i.media_type for i in found]), lengths),
        "image_data": ipc.list_of(ipc.binaries([i.data for i in found]), lengths),
    }


def _lineage(manifest: dict[str, Any], chain_id: str) -> str:
    edges = (manifest.get("lineage") or {}).get(chain_id, [])
    return json.dumps(edges, ensure_ascii=False, sort_keys=True)


def rollout_columns(
    manifest: dict[str, Any],
    samples: list[ChainSample],
    metadata: RolloutMetadata,
    images: Mapping[str, PromptImage] | None = None,
) -> list[ipc.Column]:
    """One rollout's samples as the columns of ``SCHEMA``, in order (``manifest`` gives the
    rollout columns: ``rollout_id``, ``cursor``, ``snapshot``, ``version``, ``episode_of``,
    ``attempt``, ``main_chain_id``, ``lineage``; ``images``: the samples' images by sha256).
    Raises ValueError for expert ids past uint16, or a sample's image missing from
    ``images``."""
    n = len(samples)
    experts = [_experts(s) for s in samples]
    snapshot = manifest.get("snapshot") or {}
    named = metadata.named_rewards
    named_rows = [None if named is None else list(named.items())] * n
    tag_rows = [list(metadata.tags.items())] * n
    columns = {
        "rollout_id": ipc.strings([manifest["rollout_id"]] * n),
        "cursor": ipc.repeated(manifest["cursor"], n, "<i8"),
        "snapshot_id": ipc.strings([snapshot.get("snapshot_id")] * n),
        "version": ipc.repeated(manifest["version"], n, "<i8"),
        "episode_of": ipc.strings([manifest["episode_of"]] * n),
        "attempt": ipc.repeated(manifest["attempt"], n, "<i4"),
        "chain_id": ipc.strings([s.chain_id for s in samples]),
        "leaf_call_id": ipc.strings([s.leaf_call_id for s in samples]),
        "main_chain": ipc.booleans([s.chain_id == manifest["main_chain_id"] for s in samples]),
        "call_ids": _call_ids(samples),
        "input_ids": ipc.lists([s.arrays["input_ids"] for s in samples], "<u4"),
        "loss_mask": ipc.lists([s.arrays["loss_mask"] for s in samples], "<u1"),
        "log_probs": ipc.lists([s.arrays["log_probs"] for s in samples], "<f4"),
        "generation_spans": _generation_spans(samples),
        "routed_experts": ipc.lists([e for e, _ in experts], "<u2"),
        "routed_experts_shape": ipc.fixed_size_lists([shape for _, shape in experts], 3, "<i4"),
        "routed_experts_mask": ipc.lists(
            [s.arrays.get("routed_experts_mask") for s in samples], "<u1"
        ),
        "reward": ipc.repeated(metadata.scalar_reward, n, "<f8"),
        "named_rewards": ipc.maps(
            named_rows,
            ipc.primitive(np.array([v for row in named_rows if row for _, v in row], "<f8")),
        ),
        "task_id": ipc.strings([metadata.task_id] * n),
        "tags": ipc.maps(tag_rows, None),
        "lineage": ipc.strings([_lineage(manifest, s.chain_id) for s in samples]),
        "weight_version_spans": _version_spans(samples),
        "weight_version_sources": _sources(samples),
        **_image_columns(samples, images or {}),
    }
    return [columns[f.name] for f in SCHEMA]


class ExportEncoder:
    """Writes the stream in pieces: ``header()`` first, one ``rollout()`` per rollout, then
    ``end()`` (the end-of-stream marker; a stream without it was cut). Stateless between
    calls, so one encoder per response is all it takes."""

    def header(self) -> bytes:
        return ipc.schema_message(SCHEMA, SCHEMA_METADATA)

    def rollout(
        self,
        manifest: dict[str, Any],
        samples: list[ChainSample],
        metadata: RolloutMetadata,
        images: Mapping[str, PromptImage] | None = None,
    ) -> bytes:
        """The bytes of one rollout's record batch (see the module docstring); ``images``: the
        samples' images by sha256."""
        columns = rollout_columns(manifest, samples, metadata, images)
        text = json.dumps({**manifest, "num_samples": len(samples)}, ensure_ascii=False)
        return ipc.record_batch_message(len(samples), columns, {MANIFEST_KEY: text})

    def end(self) -> bytes:
        return ipc.END_OF_STREAM
