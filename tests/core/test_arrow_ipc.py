"""The export's own Arrow IPC writer against pyarrow's: what pyarrow reads from our bytes is
exactly what pyarrow's writer would have written (schema and its metadata, every column, the
per-batch manifest), and every batch passes pyarrow's full validation."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pytest

from capture_proxy.core import arrow_ipc as ipc
from capture_proxy.core.export import (
    MANIFEST_KEY,
    SCHEMA_METADATA,
    ExportEncoder,
)
from capture_proxy.core.images import PromptImage
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.samples import ChainSample

# The export's schema as pyarrow spells it (what trainers see).
PA_SCHEMA = pa.schema(
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
        ("lineage", pa.string()),
        (
            "weight_version_spans",
            pa.list_(
                pa.struct([("version", pa.string()), ("start", pa.int64()), ("end", pa.int64())])
            ),
        ),
        ("weight_version_sources", pa.list_(pa.string())),
        ("image_sha256", pa.list_(pa.string())),
        ("image_spans", pa.list_(pa.list_(pa.int64(), 2))),
        ("image_processor", pa.list_(pa.string())),
        ("image_media_type", pa.list_(pa.string())),
        ("image_data", pa.list_(pa.binary())),
    ],
    metadata=SCHEMA_METADATA,
)

# Two images (bytes with a NUL and a non-UTF-8 byte: binary, not text), the second twice.
IMAGES = {
    "a" * 64: PromptImage("a" * 64, "image/png", 4, 3, b"\x89PNG\x00\xff one"),
    "b" * 64: PromptImage("b" * 64, "image/jpeg", 5, 6, b"\xff\xd8\xff two"),
}


def _image(sha: str, start: int, end: int) -> dict:
    return {
        "sha256": sha,
        "media_type": IMAGES[sha].media_type,
        "width": IMAGES[sha].width,
        "height": IMAGES[sha].height,
        "prompt_start": start,
        "prompt_end": end,
        "processor": {"image_grid_thw": [1, 2, 2]},
    }


def _sample(
    chain_id: str,
    leaf: str,
    calls: list[str],
    seq: int,
    experts: bool,
    images: tuple[dict, ...] = (),
) -> ChainSample:
    rng = np.random.default_rng(seq)
    arrays = {
        "call_ids": np.array(calls),
        "input_ids": rng.integers(0, 151_000, seq).astype(np.uint32),
        "loss_mask": (rng.random(seq) < 0.5).astype(np.uint8),
        "log_probs": np.where(rng.random(seq) < 0.5, -rng.random(seq), 0.0).astype(np.float32),
        "generation_spans": np.array([[2, 5], [7, seq]][: len(calls)], np.int64),
        "weight_version_index": rng.integers(-1, 2, seq).astype(np.int32),
        "weight_versions": np.array(["default", "12"]),
        "weight_version_sources": np.array(["engine_spans", ""][: len(calls)]),
    }
    if experts:
        arrays["routed_experts"] = rng.integers(0, 300, (seq, 4, 2)).astype(np.uint16)
        arrays["routed_experts_mask"] = np.ones(seq, np.uint8)
    return ChainSample(chain_id, leaf, arrays, images)


def _runs(sample: ChainSample) -> list[dict]:
    """The sample's version index as runs, by a plain loop over the positions."""
    table, index = sample.arrays["weight_versions"], sample.arrays["weight_version_index"]
    runs: list[dict] = []
    for position, i in enumerate(index.tolist()):
        if runs and runs[-1]["end"] == position and runs[-1]["index"] == i:
            runs[-1]["end"] += 1
        elif i >= 0:
            runs.append({"index": i, "start": position, "end": position + 1})
    return [{"version": str(table[r["index"]]), "start": r["start"], "end": r["end"]} for r in runs]


def _reference_batch(manifest: dict, samples: list[ChainSample], meta: RolloutMetadata):
    """The rows as pyarrow builds them from Python values."""
    n, named = len(samples), meta.named_rewards
    experts = [s.arrays.get("routed_experts") for s in samples]
    masks = [s.arrays.get("routed_experts_mask") for s in samples]
    columns = {
        "rollout_id": [manifest["rollout_id"]] * n,
        "cursor": [manifest["cursor"]] * n,
        "snapshot_id": [(manifest.get("snapshot") or {}).get("snapshot_id")] * n,
        "version": [manifest["version"]] * n,
        "episode_of": [manifest["episode_of"]] * n,
        "attempt": [manifest["attempt"]] * n,
        "chain_id": [s.chain_id for s in samples],
        "leaf_call_id": [s.leaf_call_id for s in samples],
        "main_chain": [s.chain_id == manifest["main_chain_id"] for s in samples],
        "call_ids": [s.call_ids for s in samples],
        "input_ids": [s.arrays["input_ids"].tolist() for s in samples],
        "loss_mask": [s.arrays["loss_mask"].tolist() for s in samples],
        "log_probs": [s.arrays["log_probs"].tolist() for s in samples],
        "generation_spans": [s.arrays["generation_spans"].tolist() for s in samples],
        "routed_experts": [None if e is None else e.reshape(-1).tolist() for e in experts],
        "routed_experts_shape": [None if e is None else list(e.shape) for e in experts],
        "routed_experts_mask": [None if m is None else m.tolist() for m in masks],
        "reward": [meta.scalar_reward] * n,
        "named_rewards": [None if named is None else list(named.items())] * n,
        "task_id": [meta.task_id] * n,
        "tags": [list(meta.tags.items())] * n,
        "lineage": [
            json.dumps((manifest.get("lineage") or {}).get(s.chain_id, []), sort_keys=True)
            for s in samples
        ],
        "weight_version_spans": [_runs(s) for s in samples],
        # the npz's "" (unknown) is null in Arrow
        "weight_version_sources": [
            [v or None for v in s.arrays["weight_version_sources"].tolist()] for s in samples
        ],
        "image_sha256": [[e["sha256"] for e in s.images] for s in samples],
        "image_spans": [[[e["prompt_start"], e["prompt_end"]] for e in s.images] for s in samples],
        "image_processor": [
            [json.dumps(e["processor"], sort_keys=True) for e in s.images] for s in samples
        ],
        "image_media_type": [[IMAGES[e["sha256"]].media_type for e in s.images] for s in samples],
        "image_data": [[IMAGES[e["sha256"]].data for e in s.images] for s in samples],
    }
    return pa.RecordBatch.from_arrays(
        [pa.array(columns[f.name], f.type) for f in PA_SCHEMA], schema=PA_SCHEMA
    )


def _manifest(rollout_id: str, cursor: int, main: str) -> dict:
    return {
        "rollout_id": rollout_id,
        "cursor": cursor,
        "snapshot": {"snapshot_id": f"snap-{cursor}"},
        "version": 3,
        "episode_of": rollout_id.split("-a")[0],
        "attempt": 1,
        "main_chain_id": main,
        "lineage": {
            "c9": [{"kind": "spawned_by", "chain_id": "c1", "from_call_id": "c1", "evidence": {}}]
        }
        if main == "c1"
        else {},
    }


ROLLOUTS = [
    (
        _manifest("task7-a1", 1, "c1"),
        [
            _sample("c1", "c2", ["c1", "c2"], 40, experts=True),
            _sample(
                "c1",
                "c3",
                ["c1", "c3"],
                33,
                experts=True,
                images=(_image("a" * 64, 3, 7), _image("b" * 64, 9, 11), _image("b" * 64, 20, 22)),
            ),
            _sample("c9", "c9", ["c9"], 12, experts=False),
        ],
        RolloutMetadata(reward={"pass": 1.0, "style": 0.5}, task_id="task7", tags={"split": "tr"}),
    ),
    (_manifest("t8", 2, "d1"), [_sample("d1", "d1", ["d1"], 9, False)], RolloutMetadata(1.0)),
    (_manifest("t9", 3, "x"), [], RolloutMetadata(task_id="é-unicode", tags={"k": "v", "a": ""})),
]


def _stream() -> bytes:
    encoder = ExportEncoder()
    parts = [encoder.header()]
    parts += [encoder.rollout(m, s, meta, IMAGES) for m, s, meta in ROLLOUTS]
    return b"".join([*parts, encoder.end()])


def test_pyarrow_reads_exactly_what_its_own_writer_would_have_written():
    reader = pa.ipc.open_stream(io.BytesIO(_stream()))
    assert reader.schema.equals(PA_SCHEMA, check_metadata=True)
    got = []
    while True:
        try:
            got.append(reader.read_next_batch_with_custom_metadata())
        except StopIteration:
            break
    assert len(got) == len(ROLLOUTS)
    for item, (manifest, samples, meta) in zip(got, ROLLOUTS, strict=True):
        item.batch.validate(full=True)
        assert item.batch.equals(_reference_batch(manifest, samples, meta))
        assert json.loads(item.custom_metadata[MANIFEST_KEY.encode()]) == {
            **manifest,
            "num_samples": len(samples),
        }
    first = got[0].batch.to_pylist()[0]
    assert first["named_rewards"] == [("pass", 1.0), ("style", 0.5)]
    assert first["routed_experts_shape"] == [40, 4, 2]
    assert first["weight_version_spans"] == _runs(ROLLOUTS[0][1][0])
    assert first["weight_version_sources"] == ["engine_spans", None]
    assert reader.schema.metadata[b"version"] == b"3"
    assert got[2].batch.num_rows == 0


def test_a_cut_stream_keeps_every_whole_batch():
    data = _stream()
    whole = len(ExportEncoder().header()) + len(ExportEncoder().rollout(*ROLLOUTS[0], IMAGES))
    reader = pa.ipc.open_stream(io.BytesIO(data[: whole + 100]))
    assert reader.read_next_batch().num_rows == 3
    with pytest.raises(pa.ArrowInvalid):
        reader.read_next_batch()


def test_the_message_framing_is_eight_byte_aligned_with_the_end_marker():
    header = ExportEncoder().header()
    assert header[:4] == b"\xff\xff\xff\xff"
    assert int.from_bytes(header[4:8], "little") == len(header) - 8
    assert len(header) % 8 == 0
    assert len(ExportEncoder().rollout(*ROLLOUTS[0], IMAGES)) % 8 == 0
    assert ExportEncoder().end() == b"\xff\xff\xff\xff\x00\x00\x00\x00"


def test_a_column_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="column 1 has 2 rows, the batch 3"):
        ipc.record_batch_message(3, [ipc.strings(["a", "b", "c"]), ipc.strings(["a", "b"])])
    with pytest.raises(ValueError, match="a fixed-size list of 3 got 2 values"):
        ipc.fixed_size_lists([[1, 2]], 3, "<i4")


def test_nulls_are_a_validity_bitmap_least_significant_bit_first():
    column = ipc.strings(["a", None, "bc", None, None, None, None, None, "d"])
    assert (column.length, column.null_count) == (9, 6)
    assert column.buffers[0] == bytes([0b00000101, 0b00000001])
    assert np.frombuffer(column.buffers[1], "<i4").tolist() == [0, 1, 1, 3, 3, 3, 3, 3, 3, 4]
    assert column.buffers[2] == b"abcd"
    assert ipc.strings(["a"]).buffers[0] == b""
