"""The weight-version filter of the training reads: which samples a trainer keeps. Pure.

Owns the query parameters ``min_weight_version``, ``weight_version`` and
``unknown_weight_version`` of ``GET .../chains`` (JSON and npz) and ``GET /captures/export``,
and the rule they apply to samples (root-to-leaf paths of a chain, ``core.samples``). A sample
is kept when every token its calls generated passes:

- ``min_weight_version=N`` (an integer version, ``integer_version``: any integer the rollout
  summary reports): the token's version is an integer >= N. A
  version that is not an integer (vLLM's ``"default"``, ``"v7"``) is older than every integer
  (``core.weight_versions``), so it never passes;
- ``weight_version=V`` (repeatable, exact strings, at most ``MAX_VERSIONS``): the token's
  version is one of them;
- both given: both.

A generated token of no known version (a call captured without versions, or stored before
record schema v4) cannot be shown to pass: its sample is dropped (``unknown_weight_version=
drop``, the default) or kept (``keep``: the versions that are known must still pass). Every
dropped sample is named in the read's ``weight_filter`` report with the first call of its path
that failed and why, so nothing is left out silently. A call with no generated token passes.

``main_chain_id`` and the chains' shapes stay the rollout's: a filtered read keeps whole
paths (a branch whose path fails is left out; a call stays while one kept path holds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capture_proxy.core.chains import RolloutChains
from capture_proxy.core.records import CallRecord
from capture_proxy.core.samples import ChainSample, path_sample, sample_paths
from capture_proxy.core.weight_versions import (
    MAX_INTEGER_DIGITS,
    integer_version,
    num_unknown_tokens,
    spans_of,
    version_table,
)

#: At most this many ``weight_version`` values, each of 1 to ``MAX_VERSION_LENGTH`` characters.
MAX_VERSIONS = 64
MAX_VERSION_LENGTH = 256
UNKNOWN_CHOICES = ("drop", "keep")

OLDER = "older_than_min_weight_version"
NOT_LISTED = "not_in_weight_versions"
UNKNOWN = "unknown_weight_version"


class WeightFilterError(ValueError):
    """A filter parameter is malformed; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class WeightFilter:
    """``min_version``: keep integer versions >= it; ``versions``: keep these exact versions;
    ``keep_unknown``: keep tokens of no known version (see the module docstring)."""

    min_version: int | None = None
    versions: frozenset[str] | None = None
    keep_unknown: bool = False

    @classmethod
    def from_query(
        cls, min_version: str | None, versions: list[str], unknown: str | None
    ) -> WeightFilter | None:
        """The filter the query parameters name, None when they name none (``unknown``
        alone filters nothing). Raises WeightFilterError naming the bad parameter."""
        if unknown is not None and unknown not in UNKNOWN_CHOICES:
            raise WeightFilterError(
                "unknown_weight_version", f"must be drop or keep, got {unknown[:64]!r}"
            )
        min_number = None if min_version is None else integer_version(min_version)
        if min_version is not None and min_number is None:
            raise WeightFilterError(
                "min_weight_version",
                f"must be an integer version: an optional '-' and 1 to {MAX_INTEGER_DIGITS} "
                f"digits (e.g. 12), got {min_version[:64]!r}; name other versions exactly "
                "with weight_version",
            )
        if len(versions) > MAX_VERSIONS:
            raise WeightFilterError("weight_version", f"at most {MAX_VERSIONS} values")
        for version in versions:
            if not 1 <= len(version) <= MAX_VERSION_LENGTH:
                raise WeightFilterError(
                    "weight_version", f"each value must have 1-{MAX_VERSION_LENGTH} characters"
                )
        if min_version is None and not versions:
            return None
        return cls(
            min_version=min_number,
            versions=frozenset(versions) if versions else None,
            keep_unknown=unknown == "keep",
        )

    def call_reason(self, record: CallRecord) -> str | None:
        """Why ``record``'s generated tokens fail the filter, None when they pass."""
        for version, _, _ in spans_of(record):
            if self.versions is not None and version not in self.versions:
                return NOT_LISTED
            if self.min_version is not None:
                number = integer_version(version)
                if number is None or number < self.min_version:
                    return OLDER
        if not self.keep_unknown and num_unknown_tokens(record):
            return UNKNOWN
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "min_weight_version": self.min_version,
            "weight_versions": None if self.versions is None else sorted(self.versions),
            "unknown_weight_version": "keep" if self.keep_unknown else "drop",
        }


@dataclass(frozen=True)
class Selection:
    """The paths a read keeps, ``(chain_id, path root first)`` in chain order, and
    ``report``: the filter and its dropped samples (None when no filter was given)."""

    paths: list[tuple[str, list[CallRecord]]]
    report: dict[str, Any] | None

    def call_ids(self) -> set[str]:
        """The calls of the kept paths."""
        return {r.call_id for _, path in self.paths for r in path}

    def samples(self) -> list[ChainSample]:
        return [path_sample(chain_id, path) for chain_id, path in self.paths]


def select(chains: RolloutChains, weight_filter: WeightFilter | None) -> Selection:
    """The samples of ``chains`` that ``weight_filter`` keeps (all of them without one)."""
    every = [(c.chain_id, path) for c in chains.chains for path in sample_paths(c)]
    if weight_filter is None:
        return Selection(every, None)
    reasons: dict[str, str | None] = {}  # per call: a call sits on many paths of its chain
    kept, dropped = [], []
    for chain_id, path in every:
        failed = None
        for call in path:
            if call.call_id not in reasons:
                reasons[call.call_id] = weight_filter.call_reason(call)
            if reasons[call.call_id] is not None:
                failed = call
                break
        if failed is None:
            kept.append((chain_id, path))
            continue
        dropped.append(
            {
                "chain_id": chain_id,
                "leaf_call_id": path[-1].call_id,
                "call_id": failed.call_id,
                "reason": reasons[failed.call_id],
                "call_weight_versions": version_table(v for v, _, _ in spans_of(failed)),
            }
        )
    report = {
        **weight_filter.to_json(),
        "num_samples": len(every),
        "num_samples_kept": len(kept),
        "dropped_samples": dropped,
    }
    return Selection(kept, report)
