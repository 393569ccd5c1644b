"""The harness declarations lineage uses and the generic rules' thresholds (see
``capture_proxy.core.lineage.find``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capture_proxy.core.lineage.model import LineageKind
from harness_notes import ALL_LINEAGE
from harness_notes.lineage import LineageDeclaration, SessionField


@dataclass(frozen=True)
class LineageRules:
    """The harness declarations the rules use, and the generic rules' thresholds (chars)."""

    declarations: tuple[LineageDeclaration, ...] = ALL_LINEAGE
    min_tool_input_chars: int = 64
    min_carried_chars: int = 64

    _by_kind: dict[type, tuple[Any, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        """Raises ValueError for a ``SessionField`` naming an edge kind there is none of."""
        kinds = {k.value for k in LineageKind}
        for d in self.declarations:
            declared = d.edge_kinds | d.parent_edge_kinds if isinstance(d, SessionField) else set()
            if not declared <= kinds:
                unknown = sorted(declared - kinds)
                raise ValueError(f"{d.harness} session: no lineage edge kind {unknown[0]!r}")
            self._by_kind[type(d)] = (*self._by_kind.get(type(d), ()), d)

    def of(self, kind: type[Any]) -> tuple[Any, ...]:
        """The declarations of one kind (grouped once: this is asked per call)."""
        return self._by_kind.get(kind, ())
