"""How many CPUs and how much memory this process may use: its affinity mask and the
machine's memory, capped by its cgroup's CPU quota and memory limit.

A container's CPU limit (Docker's ``--cpus``, Kubernetes' ``resources.limits.cpu``) is a CFS
quota on its cgroup, not an affinity mask: ``os.sched_getaffinity`` (and ``os.cpu_count``)
still count every CPU of the host. A proxy that starts one worker per host CPU in a container
limited to 2 CPUs runs dozens of throttled workers, each with its own caches (``serve
--workers``' default; ``docs/workers.md``). The quota is read as the kernel publishes it:

- cgroup v2: ``cpu.max`` (``"$MAX $PERIOD"``, ``$MAX`` = ``max`` when unlimited) in the
  process's cgroup (``/proc/self/cgroup``: ``0::<path>``) and in each of its ancestors up to
  the cgroup2 mount (``/proc/self/mountinfo``); the smallest limit counts;
- cgroup v1: ``cpu.cfs_quota_us`` (-1 when unlimited) over ``cpu.cfs_period_us`` in the
  ``cpu`` controller's hierarchy, likewise.

(Kernel documentation: ``admin-guide/cgroup-v2.rst`` "cpu.max", ``scheduler/sched-bwc.rst``.)
A quota of 2.5 CPUs gives 2 (never fewer than 1): a third worker would be throttled.

A container's memory limit (Docker's ``--memory``, Kubernetes' ``resources.limits.memory``)
is likewise its cgroup's, not the machine's (``/proc/meminfo`` counts the host's): cgroup v2's
``memory.max`` (``max`` when unlimited; ``memory.high``, the throttling point, where lower),
v1's ``memory.limit_in_bytes`` (a number near 2**63
when unlimited), in the process's cgroup and its ancestors, the smallest
(``admin-guide/cgroup-v2.rst`` "memory.max", ``admin-guide/cgroup-v1/memory.rst``). A process
past it is killed by the kernel (OOM). ``serve`` sizes its worker count and caches by it
(``config/memory_budget.py``).

Anything unreadable or unexpected is taken as no quota, no limit. Pure file reads, no event
loop.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

#: a limit as read: CPUs (float) or bytes (int)
Limit = TypeVar("Limit", int, float)


def usable_cpus(proc: Path = Path("/proc")) -> int:
    """The CPUs this process may run on (its affinity mask), capped by its cgroup's CPU quota
    (``cgroup_cpu_quota``, rounded down), at least 1."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(proc)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def cgroup_cpu_quota(proc: Path = Path("/proc")) -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in CPUs (e.g. 2.0, 0.5), the
    smallest that applies; None when there is none or it cannot be read (``proc``: the proc
    file system whose ``self/cgroup`` and ``self/mountinfo`` are read)."""
    return _smallest(proc, "cpu", _quota_in)


def usable_memory_bytes(proc: Path = Path("/proc")) -> int | None:
    """The memory this process may use, in bytes: the machine's (``MemTotal`` of ``meminfo``)
    capped by its cgroup's limit (``cgroup_memory_limit``); None when neither can be read."""
    limits = [cgroup_memory_limit(proc)]
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemTotal" and value.split()[1:] == ["kB"]:
                limits.append(int(value.split()[0]) * 1024)
    except (OSError, ValueError):
        pass
    return min((b for b in limits if b is not None), default=None)


def cgroup_memory_limit(proc: Path = Path("/proc")) -> int | None:
    """The memory limit of this process's cgroup and its ancestors, in bytes, the smallest
    that applies; None when there is none or it cannot be read (``proc`` as for
    ``cgroup_cpu_quota``)."""
    return _smallest(proc, "memory", _memory_limit_in)


def _smallest(
    proc: Path, controller: str, limit_in: Callable[[tuple[int, Path]], Limit | None]
) -> Limit | None:
    """The smallest limit ``limit_in`` reads in the process's ``controller`` cgroup and its
    ancestors; None when none is set or ``proc`` cannot be read."""
    try:
        cgroups = (proc / "self" / "cgroup").read_text()
        mounts = (proc / "self" / "mountinfo").read_text()
    except OSError:
        return None
    limits = [
        limit
        for directory in _cgroup_dirs(cgroups, mounts, controller)
        if (limit := limit_in(directory)) is not None
    ]
    return min(limits, default=None)


def _cgroup_dirs(cgroups: str, mounts: str, controller: str) -> list[tuple[int, Path]]:
    """``(version, directory)`` for the process's cgroup and each ancestor up to its mount, in
    the cgroup2 file system (the ``0::`` line) and in v1's hierarchy of ``controller`` (``cpu``,
    ``memory``), those mounted (a hybrid host has both; its controllers are v1's, and v2's
    directories then have no ``cpu.max`` or ``memory.max``)."""
    paths: dict[int, str] = {}
    for line in cgroups.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            paths[2] = path
        elif controller in controllers.split(","):
            paths[1] = path
    dirs: list[tuple[int, Path]] = []
    for version, path in paths.items():
        mount = _mount_of(mounts, version, controller, path)
        if mount is None:
            continue
        root, point = mount
        relative = os.path.relpath(path, root) if _holds(root, path) else "."
        here = Path(os.path.normpath(point / relative))
        dirs.append((version, here))
        while here != point and point in here.parents:
            here = here.parent
            dirs.append((version, here))
    return dirs


def _holds(root: str, path: str) -> bool:
    """Whether the cgroup ``path`` is ``root`` or below it (``/a`` does not hold ``/ab``)."""
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def _mount_of(mounts: str, version: int, controller: str, path: str) -> tuple[str, Path] | None:
    """``(root within the hierarchy, mount point)`` of the cgroup2 file system (v2) or of the
    v1 hierarchy holding ``controller``, from ``/proc/self/mountinfo`` lines
    (``proc(5)``: ``id parent major:minor root point options [tags] - fstype source super``):
    the first whose root holds the cgroup ``path`` (another may mount only a subtree), else
    the first."""
    found = list(_mounts_of(mounts, version, controller))
    return next((m for m in found if _holds(m[0], path)), found[0] if found else None)


def _mounts_of(mounts: str, version: int, controller: str) -> Iterator[tuple[str, Path]]:
    for line in mounts.splitlines():
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        fstype, super_options = rest[0], rest[2].split(",")
        if (version == 2 and fstype == "cgroup2") or (
            version == 1 and fstype == "cgroup" and controller in super_options
        ):
            yield fields[3], Path(fields[4])


def _quota_in(where: tuple[int, Path]) -> float | None:
    version, directory = where
    try:
        if version == 2:
            limit, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
            if limit == "max":
                return None
            return int(limit) / int(period or "100000")
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        if quota <= 0:
            return None
        return quota / int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None


#: v1's "no limit": PAGE_COUNTER_MAX pages, a number near 2**63 (rounded to pages)
_V1_UNLIMITED = 1 << 62


def _memory_limit_in(where: tuple[int, Path]) -> int | None:
    """v2: the smaller of ``memory.max`` (past it the kernel kills) and ``memory.high`` (past
    it the kernel throttles the cgroup hard and reclaims: Kubernetes' memory QoS sets it below
    the limit); v1: ``memory.limit_in_bytes``."""
    version, directory = where
    if version == 2:
        limits = [_v2_bytes(directory / name) for name in ("memory.max", "memory.high")]
        return min((b for b in limits if b is not None), default=None)
    try:
        limit = int((directory / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    return None if limit >= _V1_UNLIMITED or limit <= 0 else limit


def _v2_bytes(path: Path) -> int | None:
    """A v2 memory file's bytes; None for ``max`` or what cannot be read."""
    try:
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None
