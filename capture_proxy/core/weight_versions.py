"""Weight versions, read side: which policy weights sampled each generated token. Pure.

Owns how the read API, the exports and the viewer read ``CallRecord.weight_versions`` (spans
``[{"version": str, "start": int, "end": int}]``, half-open over ``generation_token_ids``,
vLLM 0.32's ``WeightVersionSpan`` shape) and ``weight_version_source`` (``engine_spans`` |
``engine_reported`` | ``observed`` | None): the order of versions, the per-token version
index of a training sample, and a rollout's counts. It must not decide a call's versions
(the call flow does, when the call is captured).

Order: a version that is a decimal integer (``"3"``, ``"-1"``; how RL frameworks number their
steps) compares as that integer; any other version (vLLM's initial ``"default"``, ``"v7"``)
is older than every integer version, and such versions are not ordered among themselves
(``version_key`` sorts them by name only to give tables a fixed order).

A record is read defensively: a span that is not a ``{"version": str, "start": int, "end":
int}`` object is skipped, spans are clipped to the generation, and a generated token no span
covers has no version (``NO_VERSION``), so a malformed record is never a failed read.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from capture_proxy.core.records import CallRecord

#: ``weight_version_source`` values (``core.records.CallRecord``).
SOURCES = ("engine_spans", "engine_reported", "observed")
#: The version index of a position without a version (prompt and interstitial tokens, and
#: generated tokens whose version is unknown).
NO_VERSION = -1
VERSION_INDEX_DTYPE = np.int32

_INTEGER = re.compile(r"-?[0-9]+", re.ASCII)


def integer_version(version: str) -> int | None:
    """The version as an integer when it is written as one (``"12"`` -> 12), else None."""
    return int(version) if _INTEGER.fullmatch(version) else None


def version_key(version: str) -> tuple[int, int, str]:
    """A sort key, oldest first: non-integer versions (by name), then integers ascending."""
    number = integer_version(version)
    return (0, 0, version) if number is None else (1, number, version)


def spans_of(record: CallRecord) -> list[tuple[str, int, int]]:
    """The record's spans as ``(version, start, end)``, clipped to its generation, empty ones
    and malformed entries left out (see the module docstring). ``[]`` when unknown."""
    n = record.num_generation_tokens
    out = []
    for span in record.weight_versions or ():
        if not isinstance(span, dict):
            continue
        version, start, end = span.get("version"), span.get("start"), span.get("end")
        if not isinstance(version, str) or type(start) is not int or type(end) is not int:
            continue
        start, end = max(0, start), min(n, end)
        if start < end:
            out.append((version, start, end))
    return out


def token_versions(record: CallRecord, table: dict[str, int]) -> npt.NDArray[np.int32]:
    """int32 ``[num_generation_tokens]``: each generated token's index in ``table`` (version
    -> index; it must hold every version of the record), ``NO_VERSION`` where unknown. One
    slice assignment per span."""
    out = np.full(record.num_generation_tokens, NO_VERSION, VERSION_INDEX_DTYPE)
    for version, start, end in spans_of(record):
        out[start:end] = table[version]
    return out


def num_unknown_tokens(record: CallRecord) -> int:
    """Generated tokens that no span covers."""
    n = record.num_generation_tokens
    spans = spans_of(record)
    if not spans:
        return n
    covered = np.zeros(n, dtype=bool)
    for _, start, end in spans:
        covered[start:end] = True
    return n - int(np.count_nonzero(covered))


def version_table(versions: Iterable[str]) -> list[str]:
    """The distinct versions, oldest first (``version_key``)."""
    return sorted(set(versions), key=version_key)


def tokens_by_version(records: Iterable[CallRecord]) -> dict[str, int]:
    """Generated tokens per version over ``records``, oldest version first."""
    counts: Counter[str] = Counter()
    for record in records:
        for version, start, end in spans_of(record):
            counts[version] += end - start
    return {v: counts[v] for v in version_table(counts)}


def integer_range(versions: Iterable[str]) -> tuple[int | None, int | None]:
    """``(min, max)`` of the integer versions among ``versions``; ``(None, None)`` without."""
    numbers = [n for n in map(integer_version, versions) if n is not None]
    return (min(numbers), max(numbers)) if numbers else (None, None)


def rollout_summary(records: list[CallRecord]) -> dict[str, Any]:
    """A rollout's weight versions for its summary (over all of ``records``, whatever their
    status): ``weight_versions`` ``{version: num_generation_tokens}`` oldest first;
    ``weight_version_min`` / ``weight_version_max``: the integer versions' range (None
    without one); ``weight_version_sources``: ``{source: num_calls}``;
    ``weight_version_unknown``: ``{"num_calls", "num_generation_tokens"}``, the calls with
    generated tokens of no known version, and those tokens."""
    by_version = tokens_by_version(records)
    low, high = integer_range(by_version)
    unknown = [num_unknown_tokens(r) for r in records]
    sources = Counter(r.weight_version_source for r in records if r.weight_version_source)
    return {
        "weight_versions": by_version,
        "weight_version_min": low,
        "weight_version_max": high,
        "weight_version_sources": dict(sorted(sources.items())),
        "weight_version_unknown": {
            "num_calls": sum(1 for n in unknown if n),
            "num_generation_tokens": sum(unknown),
        },
    }
