"""The fuzz tier's outcome counts, printed at the end of the session: per property, how many
cases were sent and which (status, code) classes came back."""

from __future__ import annotations

from collections import Counter, defaultdict

#: property -> (status, error code or "ok") -> cases
OUTCOMES: defaultdict[str, Counter[tuple[int, str]]] = defaultdict(Counter)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not OUTCOMES:
        return
    total = sum(sum(c.values()) for c in OUTCOMES.values())
    classes = sum(len(c) for c in OUTCOMES.values())
    terminalreporter.section("fuzz tier outcomes")
    terminalreporter.write_line(f"{total} requests checked, {classes} outcome classes")
    for kind, counts in sorted(OUTCOMES.items()):
        terminalreporter.write_line(f"  {kind}: {sum(counts.values())} requests")
        for (status, label), n in sorted(counts.items()):
            terminalreporter.write_line(f"    {status} {label}: {n}")
