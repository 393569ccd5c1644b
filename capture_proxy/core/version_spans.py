"""The policy weight version of each generated token, from what the engine says or what the
proxy observed around the call (pure).

A call's versions are spans ``[{"version": str, "start": int, "end": int}]``: half-open ranges
of ``generation_token_ids`` indexes, in order, covering every generated token (vLLM 0.32's
``vllm/outputs.py`` ``WeightVersionSpan``). How they were known, strongest first:

- ``engine_spans``: the engine named each token's version (vLLM ``/inference/v1/generate``:
  ``choices[0].weight_versions`` on the whole answer and the stream's last chunk);
- ``engine_reported``: the engine named one version for the answer (SGLang
  ``meta_info.weight_version``), taken for all its tokens;
- ``observed``: the proxy's cached reading of the engine's ``GET /weight_info`` when the call
  was sent, and again between engine reads and at the end. Where a change inside a call fell
  is not known: the proxy may read tokens the engine sampled before the change (buffered in
  its socket) after it has seen the change. So every token keeps the version the call
  started under (staleness is never undercounted) and a ``weight_version_changed`` diagnostic
  names the change and the tokens it may have fallen in: ``tokens: [first, end)``, from the
  first token read after the change was seen (0 for a whole answer) to the segment's end.

A call continued after an engine abort has one segment per engine request; each segment's
spans are offset by the tokens before it and the weakest source of the segments is the call's.
Must not: do I/O or import aiohttp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ENGINE_SPANS = "engine_spans"
ENGINE_REPORTED = "engine_reported"
OBSERVED = "observed"

#: sources by strength: a call's source is the weakest of its segments'
_STRENGTH = {ENGINE_SPANS: 2, ENGINE_REPORTED: 1, OBSERVED: 0}

Span = dict[str, Any]


def valid_engine_spans(spans: Any, num_tokens: int) -> list[Span] | None:
    """``spans`` (an engine's ``weight_versions``) when they are well formed and cover exactly
    ``[0, num_tokens)`` in order; else None (not trusted, another source is used)."""
    if not isinstance(spans, list) or (not spans and num_tokens):
        return None
    out: list[Span] = []
    at = 0
    for span in spans:
        if not isinstance(span, dict):
            return None
        version, start, end = span.get("version"), span.get("start"), span.get("end")
        if not isinstance(version, str) or type(start) is not int or type(end) is not int:
            return None
        if start != at or end < start:
            return None
        if end > start:
            out.append({"version": version, "start": start, "end": end})
        at = end
    return out if at == num_tokens else None


def _append(spans: list[Span], version: str, start: int, end: int) -> None:
    if end <= start:
        return
    if spans and spans[-1]["version"] == version and spans[-1]["end"] == start:
        spans[-1]["end"] = end
    else:
        spans.append({"version": version, "start": start, "end": end})


@dataclass
class Observation:
    """The proxy's readings of one engine request's version: ``first`` when it was sent, then
    each change seen and the number of tokens received by then."""

    first: str | None = None
    changes: list[tuple[int, str]] = field(default_factory=list)
    last: str | None = None

    def seen(self, version: str | None, at_token: int) -> None:
        """A reading after ``at_token`` tokens had arrived (None: no reading)."""
        if version is None:
            return
        current = self.last if self.last is not None else self.first
        if current is None:
            self.first = version
        elif version != current:
            self.changes.append((at_token, version))
        self.last = version


@dataclass
class WeightVersions:
    """The versions of one call's tokens, segment by segment (``begin_segment`` before each
    engine request after the first)."""

    spans: list[Span] = field(default_factory=list)
    source: str | None = None
    changed: list[dict[str, Any]] = field(default_factory=list)
    unknown: bool = False
    _offset: int = 0

    def add_segment(
        self,
        num_tokens: int,
        *,
        engine_spans: Any = None,
        engine_version: Any = None,
        observed: Observation | None = None,
        whole: bool = False,
    ) -> None:
        """The versions of the segment's ``num_tokens`` tokens, from the strongest source that
        has them. ``whole``: the tokens came in one answer (an observed change cannot be
        placed)."""
        base = self._offset
        self._offset += num_tokens
        if num_tokens == 0:
            return
        exact = valid_engine_spans(engine_spans, num_tokens)
        if exact is not None:
            for span in exact:
                _append(self.spans, span["version"], base + span["start"], base + span["end"])
            self._weakest(ENGINE_SPANS)
            return
        if isinstance(engine_version, str) and engine_version:
            _append(self.spans, engine_version, base, base + num_tokens)
            self._weakest(ENGINE_REPORTED)
            return
        if observed is None or observed.first is None:
            self.unknown = True
            return
        self._observed(observed, base, num_tokens, whole)
        self._weakest(OBSERVED)

    def _observed(self, seen: Observation, base: int, num_tokens: int, whole: bool) -> None:
        assert seen.first is not None
        _append(self.spans, seen.first, base, base + num_tokens)
        if seen.changes:
            first_after = 0 if whole else min(seen.changes[0][0], num_tokens)
            self.changed.append(
                {
                    "from": seen.first,
                    "to": seen.changes[-1][1],
                    "tokens": [base + first_after, base + num_tokens],
                }
            )

    def _weakest(self, source: str) -> None:
        if self.source is None or _STRENGTH[source] < _STRENGTH[self.source]:
            self.source = source

    def result(self) -> tuple[list[Span] | None, str | None]:
        """(spans, source) of every token, or (None, None) when a segment's are unknown."""
        if self.unknown or not self.spans:
            return None, None
        return self.spans, self.source


def versions_of(spans: Sequence[Span] | None) -> list[str]:
    """The distinct versions of ``spans`` in order of first use."""
    seen: dict[str, None] = {}
    for span in spans or ():
        seen.setdefault(span["version"], None)
    return list(seen)
