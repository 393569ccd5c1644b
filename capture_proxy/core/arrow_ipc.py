"""Arrow IPC streaming format, write side: schemas, columns and record-batch messages as bytes.

Owns the encoding of the few Arrow types the bulk export uses (signed and unsigned integers,
floats, bool, utf8, list, fixed-size list, struct, map) into the Arrow columnar format's IPC
*stream* (https://arrow.apache.org/docs/format/Columnar.html#serialization-and-interprocess-communication-ipc
and the flatbuffers schemas ``Schema.fbs`` / ``Message.fbs`` of Apache Arrow, metadata version
V5). The flatbuffer messages are built with Google's ``flatbuffers`` runtime; this module lays
out the tables, the column buffers and the framing. It exists so that serving the export does
not need pyarrow (a 165 MB install); readers (pyarrow, polars, DuckDB, ...) read the bytes as
any Arrow stream. Per-batch custom metadata (``Message.custom_metadata``) is written, which
the small Arrow writers on PyPI do not expose.

Pure: no I/O. It must not know what the export's columns mean (``core.export`` does).

Stream: ``schema_message(schema)``, then ``record_batch_message(...)`` per batch, then
``END_OF_STREAM``. Each message: ``0xFFFFFFFF``, int32 metadata size, the flatbuffer padded to
8 bytes, the body (every buffer padded to 8 bytes). Little-endian throughout. Offsets int32.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import flatbuffers
import numpy as np

END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_CONTINUATION = b"\xff\xff\xff\xff"
_PADDING = bytes(8)
_METADATA_V5 = 4
_HEADER_SCHEMA, _HEADER_RECORD_BATCH = 1, 3
# Type union ids (Schema.fbs ``union Type``).
_INT, _FLOAT, _BINARY, _UTF8, _BOOL, _LIST, _STRUCT, _FIXED_LIST, _MAP = (
    2, 3, 4, 5, 6, 12, 13, 16, 17
)


@dataclass(frozen=True)
class DataType:
    """An Arrow type: ``kind`` one of int, float, bool, utf8, binary, list, fixed_size_list,
    struct, map; ``bits`` and ``signed`` for int and float (float: 32 or 64); ``size`` for a
    fixed-size list; ``children`` the child fields (list: 1, map: 1 ``entries`` struct)."""

    kind: str
    bits: int = 0
    signed: bool = True
    size: int = 0
    children: tuple[Field, ...] = ()


@dataclass(frozen=True)
class Field:
    name: str
    type: DataType
    nullable: bool = True


def int_(bits: int, signed: bool = True) -> DataType:
    return DataType("int", bits=bits, signed=signed)


def float_(bits: int) -> DataType:
    return DataType("float", bits=bits)


def utf8() -> DataType:
    return DataType("utf8")


def binary() -> DataType:
    return DataType("binary")


def bool_() -> DataType:
    return DataType("bool")


def list_(value: DataType) -> DataType:
    """``list<value>``; the child field is named ``item`` (as pyarrow names it)."""
    return DataType("list", children=(Field("item", value),))


def fixed_size_list(value: DataType, size: int) -> DataType:
    return DataType("fixed_size_list", size=size, children=(Field("item", value),))


def struct_(fields: Sequence[Field]) -> DataType:
    return DataType("struct", children=tuple(fields))


def map_(key: DataType, value: DataType) -> DataType:
    """``map<key, value>``: a list of non-null ``entries`` structs of a non-null ``key`` and a
    nullable ``value``, keys not sorted (the Arrow spec's layout, pyarrow's names)."""
    entries = DataType("struct", children=(Field("key", key, False), Field("value", value)))
    return DataType("map", children=(Field("entries", entries, False),))


#: A buffer's bytes: ``bytes``, a byte view of a numpy array, or several views one after the
#: other (a list column's values, sample by sample); copied once, into the message.
Buffer = bytes | memoryview | tuple[memoryview, ...]


def _size(buf: Buffer) -> int:
    return sum(len(part) for part in buf) if isinstance(buf, tuple) else len(buf)


def _view(values: np.ndarray, dtype: str) -> memoryview:
    """The bytes of ``values`` as ``dtype`` (little-endian), without a copy when they are."""
    flat = np.ascontiguousarray(np.asarray(values, dtype=dtype)).reshape(-1)
    return memoryview(flat).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


@dataclass(frozen=True)
class Column:
    """One array in IPC order: ``length`` slots, ``null_count``, its own buffers (validity
    first; an empty validity buffer when there is no null) and its child arrays."""

    length: int
    null_count: int
    buffers: tuple[Buffer, ...]
    children: tuple[Column, ...] = field(default=())


def _validity(valid: Sequence[bool]) -> tuple[int, bytes]:
    """(null count, LSB-first bitmap; empty when nothing is null)."""
    mask = np.asarray(valid, dtype=bool)
    nulls = int(mask.size - np.count_nonzero(mask))
    return nulls, (np.packbits(mask, bitorder="little").tobytes() if nulls else b"")


def _offsets(lengths: Sequence[int]) -> bytes:
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    if ends.size and int(ends[-1]) > np.iinfo(np.int32).max:
        raise ValueError("a list or string column over 2**31 - 1 values (int32 offsets)")
    return np.concatenate([np.zeros(1, "<i4"), ends.astype("<i4")]).tobytes()


def primitive(values: np.ndarray, valid: Sequence[bool] | None = None) -> Column:
    """A fixed-width column from a 1-D numpy array (its dtype is the column's: give the
    array in the field's type); ``valid``: False where the value is null."""
    flat = np.asarray(values).reshape(-1)
    nulls, bitmap = _validity(valid) if valid is not None else (0, b"")
    return Column(flat.size, nulls, (bitmap, _view(flat, flat.dtype.newbyteorder("<").str)))


def repeated(value: float | int | None, n: int, dtype: str) -> Column:
    """``n`` copies of one value (None: ``n`` nulls) as a fixed-width column."""
    if value is None:
        return primitive(np.zeros(n, dtype), [False] * n)
    return primitive(np.full(n, value, dtype))


def booleans(values: Sequence[bool]) -> Column:
    bits = np.packbits(np.asarray(values, dtype=bool), bitorder="little").tobytes()
    return Column(len(values), 0, (b"", bits))


def strings(values: Sequence[str | None]) -> Column:
    """A utf8 column (None: null)."""
    data = [b"" if v is None else v.encode() for v in values]
    nulls, bitmap = _validity([v is not None for v in values])
    return Column(len(values), nulls, (bitmap, _offsets([len(d) for d in data]), b"".join(data)))


def binaries(values: Sequence[bytes | None]) -> Column:
    """A binary column (None: null): the layout of utf8, any bytes."""
    nulls, bitmap = _validity([v is not None for v in values])
    data = [b"" if v is None else v for v in values]
    return Column(len(values), nulls, (bitmap, _offsets([len(d) for d in data]), b"".join(data)))


def lists(values: Sequence[np.ndarray | None], dtype: str) -> Column:
    """A ``list<dtype>`` column from 1-D numpy arrays (None: a null list), flattened
    without going through Python values."""
    parts = tuple(_view(v, dtype) for v in values if v is not None)
    lengths = [0 if v is None else int(np.asarray(v).size) for v in values]
    child = Column(sum(lengths), 0, (b"", parts))
    nulls, bitmap = _validity([v is not None for v in values])
    return Column(len(values), nulls, (bitmap, _offsets(lengths)), (child,))


def list_of(
    children: Column, lengths: Sequence[int], valid: Sequence[bool] | None = None
) -> Column:
    """A list column over an already built child column (``lengths`` per row)."""
    nulls, bitmap = _validity(valid) if valid is not None else (0, b"")
    return Column(len(lengths), nulls, (bitmap, _offsets(lengths)), (children,))


def structs(length: int, children: Sequence[Column]) -> Column:
    """A struct column of ``length`` rows, no null, over its ``children`` (one per field)."""
    for child in children:
        if child.length != length:
            raise ValueError(f"a struct of {length} rows got a field of {child.length}")
    return Column(length, 0, (b"",), tuple(children))


def fixed_size_lists(values: Sequence[Sequence[int] | None], size: int, dtype: str) -> Column:
    """A ``fixed_size_list<dtype, size>`` column (None: null; its slots hold zeros)."""
    flat = np.zeros(len(values) * size, dtype)
    for i, v in enumerate(values):
        if v is not None:
            if len(v) != size:
                raise ValueError(f"a fixed-size list of {size} got {len(v)} values")
            flat[i * size : (i + 1) * size] = v
    nulls, bitmap = _validity([v is not None for v in values])
    return Column(len(values), nulls, (bitmap,), (primitive(flat),))


def maps(values: Sequence[Sequence[tuple[str, object]] | None], value: Column | None) -> Column:
    """A ``map<utf8, ...>`` column: per row a list of (key, value) pairs or None (null);
    ``value`` is the column of every row's values, in order (built by the caller in the
    map's value type); None builds a utf8 column from the pairs."""
    pairs = [p for row in values if row is not None for p in row]
    keys = strings([k for k, _ in pairs])
    vals = (
        value if value is not None else strings([None if v is None else str(v) for _, v in pairs])
    )
    if vals.length != len(pairs):
        raise ValueError(f"{len(pairs)} map entries but {vals.length} values")
    entries = Column(len(pairs), 0, (b"",), (keys, vals))
    return list_of(
        entries, [0 if r is None else len(r) for r in values], [r is not None for r in values]
    )


# --- flatbuffers: Schema.fbs / Message.fbs tables ---------------------------------------------


def _key_values(b: flatbuffers.Builder, metadata: dict[str, str]) -> int:
    offsets = []
    for key, value in metadata.items():
        k, v = b.CreateString(key), b.CreateString(value)
        b.StartObject(2)
        b.PrependUOffsetTRelativeSlot(0, k, 0)
        b.PrependUOffsetTRelativeSlot(1, v, 0)
        offsets.append(b.EndObject())
    return _vector(b, offsets)


def _vector(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def _type_table(b: flatbuffers.Builder, t: DataType) -> tuple[int, int]:
    """(union type id, offset of the type's table)."""
    if t.kind == "int":
        b.StartObject(2)
        b.PrependInt32Slot(0, t.bits, 0)
        b.PrependBoolSlot(1, t.signed, False)
        return _INT, b.EndObject()
    if t.kind == "float":
        b.StartObject(1)
        b.PrependInt16Slot(0, {16: 0, 32: 1, 64: 2}[t.bits], 0)
        return _FLOAT, b.EndObject()
    if t.kind == "fixed_size_list":
        b.StartObject(1)
        b.PrependInt32Slot(0, t.size, 0)
        return _FIXED_LIST, b.EndObject()
    if t.kind == "map":
        b.StartObject(1)
        b.PrependBoolSlot(0, False, False)
        return _MAP, b.EndObject()
    ids = {"utf8": _UTF8, "binary": _BINARY, "bool": _BOOL, "list": _LIST, "struct": _STRUCT}
    if t.kind not in ids:
        raise ValueError(f"no Arrow IPC encoding for type {t.kind!r}")
    b.StartObject(0)
    return ids[t.kind], b.EndObject()


def _field(b: flatbuffers.Builder, f: Field) -> int:
    children = _vector(b, [_field(b, c) for c in f.type.children])
    name = b.CreateString(f.name)
    type_id, type_table = _type_table(b, f.type)
    b.StartObject(7)
    b.PrependUOffsetTRelativeSlot(0, name, 0)
    b.PrependBoolSlot(1, f.nullable, False)
    b.PrependUint8Slot(2, type_id, 0)
    b.PrependUOffsetTRelativeSlot(3, type_table, 0)
    b.PrependUOffsetTRelativeSlot(5, children, 0)
    return b.EndObject()


def _metadata(
    b: flatbuffers.Builder, header_type: int, header: int, body_length: int, custom: int | None
) -> bytes:
    b.StartObject(5)
    b.PrependInt16Slot(0, _METADATA_V5, 0)
    b.PrependUint8Slot(1, header_type, 0)
    b.PrependUOffsetTRelativeSlot(2, header, 0)
    b.PrependInt64Slot(3, body_length, 0)
    if custom is not None:
        b.PrependUOffsetTRelativeSlot(4, custom, 0)
    b.Finish(b.EndObject())
    meta = bytes(b.Output())
    meta += b"\x00" * (-(len(meta) + 8) % 8)
    return _CONTINUATION + struct.pack("<i", len(meta)) + meta


def schema_message(fields: Sequence[Field], metadata: dict[str, str]) -> bytes:
    """The stream's first message: the schema, with its key-value ``metadata``."""
    b = flatbuffers.Builder(1024)
    field_vector = _vector(b, [_field(b, f) for f in fields])
    meta = _key_values(b, metadata)
    b.StartObject(4)
    b.PrependInt16Slot(0, 0, 0)  # little-endian
    b.PrependUOffsetTRelativeSlot(1, field_vector, 0)
    b.PrependUOffsetTRelativeSlot(2, meta, 0)
    return _metadata(b, _HEADER_SCHEMA, b.EndObject(), 0, None)


def _flatten(columns: Sequence[Column]) -> tuple[list[Column], list[Buffer]]:
    """Field nodes and buffers in the IPC order: depth first, a node's buffers before its
    children's."""
    nodes: list[Column] = []
    buffers: list[Buffer] = []

    def visit(c: Column) -> None:
        nodes.append(c)
        buffers.extend(c.buffers)
        for child in c.children:
            visit(child)

    for column in columns:
        visit(column)
    return nodes, buffers


def _structs(b: flatbuffers.Builder, pairs: list[tuple[int, int]]) -> int:
    """A vector of 16-byte structs of two int64 (FieldNode, Buffer)."""
    b.StartVector(16, len(pairs), 8)
    for first, second in reversed(pairs):
        b.Prep(8, 16)
        b.PrependInt64(second)
        b.PrependInt64(first)
    return b.EndVector()


def record_batch_message(
    length: int, columns: Sequence[Column], custom_metadata: dict[str, str] | None = None
) -> bytes:
    """One record batch of ``length`` rows (``columns`` in schema order), with the message's
    ``custom_metadata``. Raises ValueError when a column's length is not ``length``."""
    for i, column in enumerate(columns):
        if column.length != length:
            raise ValueError(f"column {i} has {column.length} rows, the batch {length}")
    nodes, buffers = _flatten(columns)
    spans, at = [], 0
    for buf in buffers:
        size = _size(buf)
        spans.append((at, size))
        at += size + (-size % 8)
    b = flatbuffers.Builder(1024)
    custom = _key_values(b, custom_metadata) if custom_metadata else None
    node_vector = _structs(b, [(n.length, n.null_count) for n in nodes])
    buffer_vector = _structs(b, spans)
    b.StartObject(5)
    b.PrependInt64Slot(0, length, 0)
    b.PrependUOffsetTRelativeSlot(1, node_vector, 0)
    b.PrependUOffsetTRelativeSlot(2, buffer_vector, 0)
    meta = _metadata(b, _HEADER_RECORD_BATCH, b.EndObject(), at, custom)
    # One copy of each buffer, into the message; zeros pad each to 8 bytes.
    pieces: list[bytes | memoryview] = [meta]
    for (_, size), buf in zip(spans, buffers, strict=True):
        pieces.extend(buf if isinstance(buf, tuple) else (buf,))
        pieces.append(_PADDING[: -size % 8])
    return b"".join(pieces)
