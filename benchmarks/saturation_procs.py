"""The saturation bench's measurements of processes and their metrics: a process tree's CPU
and memory (a proxy with workers is several processes), Prometheus histograms read back into
percentiles, and the histogram of the clients' inter-token gaps.

Must not: start processes or send calls.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.services import proc_cpu_s


def tree_pids(root: int) -> list[int]:
    """``root`` and every process descended from it (read from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children[int(fields[1])].append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of ``root``'s live process tree."""
    return sum(proc_cpu_s(pid) or 0.0 for pid in tree_pids(root))


def tree_pss_kib(root: int) -> int:
    """Proportional set size of the tree (KiB; shared pages split among their users), from
    ``/proc/<pid>/smaps_rollup``; RSS where that is missing."""
    total = 0
    for pid in tree_pids(root):
        for name, key in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
            try:
                text = Path(name).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith(key):
                    total += int(line.split()[1])
                    break
            else:
                continue
            break
    return total


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """A Prometheus histogram's cumulative buckets ``{le: count}`` in an exposition."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The ``q`` quantile (0-1) of the observations between two reads of a histogram, as the
    upper bound of the bucket it falls in (``inf`` past the last); nan when none."""
    edges = sorted(after)
    counts = [after[e] - before.get(e, 0.0) for e in edges]
    if not counts or counts[-1] <= 0:
        return float("nan")
    target = q * counts[-1]
    for edge, count in zip(edges, counts, strict=True):
        if count >= target:
            return edge
    return float("inf")


def gaps_quantile(gaps: np.ndarray, q: float, bin_s: float) -> float:
    """The ``q`` quantile of the clients' gap histogram (seconds; a bin's upper edge)."""
    total = int(gaps.sum())
    if total == 0:
        return float("nan")
    k = int(np.searchsorted(np.cumsum(gaps), q * total))
    return (k + 1) * bin_s


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))
