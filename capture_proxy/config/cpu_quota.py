"""How many CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota.

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
A quota of 2.5 CPUs gives 2 (never fewer than 1): a third worker would be throttled. Anything
unreadable or unexpected is taken as no quota. Pure file reads, no event loop.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


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
    try:
        cgroups = (proc / "self" / "cgroup").read_text()
        mounts = (proc / "self" / "mountinfo").read_text()
    except OSError:
        return None
    quotas = [
        q
        for directory in _cpu_cgroup_dirs(cgroups, mounts)
        if (q := _quota_in(directory)) is not None
    ]
    return min(quotas, default=None)


def _cpu_cgroup_dirs(cgroups: str, mounts: str) -> list[tuple[int, Path]]:
    """``(version, directory)`` for the process's cpu cgroup and each ancestor up to its
    mount, in the cgroup2 file system (the ``0::`` line) and in v1's ``cpu`` controller
    hierarchy, those mounted (a hybrid host has both; its cpu controller is v1's, and v2's
    directories have no ``cpu.max``)."""
    paths: dict[int, str] = {}
    for line in cgroups.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            paths[2] = path
        elif "cpu" in controllers.split(","):
            paths[1] = path
    dirs: list[tuple[int, Path]] = []
    for version, path in paths.items():
        mount = _mount_of(mounts, version)
        if mount is None:
            continue
        root, point = mount
        relative = os.path.relpath(path, root) if path.startswith(root) else "."
        here = Path(os.path.normpath(point / relative))
        dirs.append((version, here))
        while here != point and point in here.parents:
            here = here.parent
            dirs.append((version, here))
    return dirs


def _mount_of(mounts: str, version: int) -> tuple[str, Path] | None:
    """``(root within the hierarchy, mount point)`` of the cgroup2 file system (v2) or of the
    v1 hierarchy holding the ``cpu`` controller, from ``/proc/self/mountinfo`` lines
    (``proc(5)``: ``id parent major:minor root point options [tags] - fstype source super``)."""
    for line in mounts.splitlines():
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        fstype, super_options = rest[0], rest[2].split(",")
        if (version == 2 and fstype == "cgroup2") or (
            version == 1 and fstype == "cgroup" and "cpu" in super_options
        ):
            return fields[3], Path(fields[4])
    return None


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
