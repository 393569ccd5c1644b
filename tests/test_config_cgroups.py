"""The CPUs and memory ``serve --workers`` counts by default: the affinity mask capped by the
cgroup's CPU quota, the machine's memory capped by the cgroup's memory limit
(``capture_proxy.config.cgroups``), read from fake ``/proc`` and cgroup trees laid out as the
kernel publishes them (cgroup v2, v1 and a hybrid host)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capture_proxy.config.cgroups import (
    cgroup_cpu_quota,
    cgroup_memory_limit,
    usable_cpus,
    usable_memory_bytes,
)

GIB = 1 << 30


def _proc(tmp_path: Path, cgroup: str, mountinfo: list[str]) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    return proc


def _write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (line.split("=", 1) for line in text.split(";")):
        (path / name).write_text(value + "\n")


def _v2_mount(point: Path, root: str = "/") -> str:
    return f"30 23 0:26 {root} {point} rw,nosuid,relatime shared:4 - cgroup2 cgroup2 rw"


def _v1_cpu_mount(point: Path, root: str = "/") -> str:
    return f"32 31 0:29 {root} {point} rw,relatime - cgroup cgroup rw,cpu,cpuacct"


def test_a_v2_container_limited_to_two_cpus(tmp_path):
    cg = tmp_path / "sys" / "fs" / "cgroup"
    _write(cg, "cpu.max=200000 100000")
    proc = _proc(tmp_path, "0::/\n", [_v2_mount(cg)])
    assert cgroup_cpu_quota(proc) == 2.0


def test_the_smallest_limit_of_the_cgroup_and_its_ancestors_counts(tmp_path):
    cg = tmp_path / "cg"
    _write(cg / "kubepods" / "pod1", "cpu.max=150000 100000")
    _write(cg / "kubepods" / "pod1" / "c1", "cpu.max=max 100000")
    _write(cg / "kubepods", "cpu.max=400000 100000")
    proc = _proc(tmp_path, "0::/kubepods/pod1/c1\n", [_v2_mount(cg)])
    assert cgroup_cpu_quota(proc) == 1.5


def test_a_v1_hierarchy_and_a_hybrid_host(tmp_path):
    cpu = tmp_path / "cgroup" / "cpu,cpuacct"
    unified = tmp_path / "cgroup" / "unified"
    unified.mkdir(parents=True)  # v2 mounted, without the cpu controller: no cpu.max
    _write(cpu, "cpu.cfs_quota_us=50000;cpu.cfs_period_us=100000")
    # a container without a cgroup namespace: its path is the mount's root
    proc = _proc(
        tmp_path,
        "12:cpu,cpuacct:/docker/abc\n0::/docker/abc\n",
        [_v1_cpu_mount(cpu, root="/docker/abc"), _v2_mount(unified, root="/docker/abc")],
    )
    assert cgroup_cpu_quota(proc) == 0.5
    assert usable_cpus(proc) == 1  # half a CPU still runs one worker


@pytest.mark.parametrize(
    "files",
    ["cpu.max=max 100000", "cpu.max=garbage", "cpu.max=0 0", "cpu.cfs_quota_us=-1"],
)
def test_no_limit_or_an_unreadable_one_is_no_quota(tmp_path, files):
    cg = tmp_path / "cg"
    _write(cg, files)
    mounts = [_v2_mount(cg)] if files.startswith("cpu.max") else [_v1_cpu_mount(cg)]
    cgroup = "0::/\n" if files.startswith("cpu.max") else "4:cpu,cpuacct:/\n"
    assert cgroup_cpu_quota(_proc(tmp_path, cgroup, mounts)) is None
    assert cgroup_cpu_quota(tmp_path / "no-proc") is None


def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_down(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    cg = tmp_path / "cg"
    _write(cg, "cpu.max=250000 100000")
    proc = _proc(tmp_path, "0::/\n", [_v2_mount(cg)])
    assert usable_cpus(proc) == 2
    (cg / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(proc) == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    (cg / "cpu.max").write_text("800000 100000\n")
    assert usable_cpus(proc) == 2


def _v1_memory_mount(point: Path, root: str = "/") -> str:
    return f"33 31 0:30 {root} {point} rw,relatime - cgroup cgroup rw,memory"


def test_a_v2_pod_limited_in_memory_the_smallest_limit_counts(tmp_path):
    cg = tmp_path / "cg"
    _write(cg / "kubepods", f"memory.max={8 * GIB}")
    _write(cg / "kubepods" / "pod1", f"memory.max={2 * GIB}")
    _write(cg / "kubepods" / "pod1" / "c1", "memory.max=max")
    proc = _proc(tmp_path, "0::/kubepods/pod1/c1\n", [_v2_mount(cg)])
    assert cgroup_memory_limit(proc) == 2 * GIB


def test_a_v1_memory_hierarchy_on_a_hybrid_host(tmp_path):
    memory = tmp_path / "cgroup" / "memory"
    unified = tmp_path / "cgroup" / "unified"
    unified.mkdir(parents=True)  # v2 mounted without the memory controller: no memory.max
    _write(memory, f"memory.limit_in_bytes={512 << 20}")
    proc = _proc(
        tmp_path,
        "9:memory:/docker/abc\n0::/docker/abc\n",
        [_v1_memory_mount(memory, root="/docker/abc"), _v2_mount(unified, root="/docker/abc")],
    )
    assert cgroup_memory_limit(proc) == 512 << 20
    assert cgroup_cpu_quota(proc) is None  # no cpu controller mounted in this tree


@pytest.mark.parametrize(
    "files",
    [
        "memory.max=max",
        "memory.max=lots",
        "memory.limit_in_bytes=9223372036854771712",  # v1's "no limit"
        "memory.limit_in_bytes=-1",
    ],
)
def test_no_memory_limit_or_an_unreadable_one_is_none(tmp_path, files):
    cg = tmp_path / "cg"
    _write(cg, files)
    v2 = files.startswith("memory.max")
    mounts = [_v2_mount(cg)] if v2 else [_v1_memory_mount(cg)]
    proc = _proc(tmp_path, "0::/\n" if v2 else "9:memory:/\n", mounts)
    assert cgroup_memory_limit(proc) is None
    assert cgroup_memory_limit(tmp_path / "no-proc") is None


def test_usable_memory_is_the_machines_capped_by_the_limit(tmp_path):
    cg = tmp_path / "cg"
    _write(cg, f"memory.max={2 * GIB}")
    proc = _proc(tmp_path, "0::/\n", [_v2_mount(cg)])
    (proc / "meminfo").write_text("MemTotal:       25165824 kB\nMemFree:  1 kB\n")  # 24 GiB
    assert usable_memory_bytes(proc) == 2 * GIB
    (cg / "memory.max").write_text("max\n")
    assert usable_memory_bytes(proc) == 24 * GIB  # no limit: the machine's
    (proc / "meminfo").unlink()
    assert usable_memory_bytes(proc) is None  # neither known
    (cg / "memory.max").write_text(f"{GIB}\n")
    assert usable_memory_bytes(proc) == GIB


def test_the_mount_that_holds_the_process_cgroup_is_read_not_the_first(tmp_path):
    """A second cgroup2 mount of a subtree listed first (a runtime's bind mount of one cgroup
    elsewhere) does not stand for the hierarchy: the mount whose root holds the process's
    cgroup does."""
    other = tmp_path / "run" / "sub"
    _write(other, "memory.max=max;cpu.max=max 100000")
    cg = tmp_path / "cg"
    _write(cg / "pod", f"memory.max={GIB};cpu.max=100000 100000")
    proc = _proc(tmp_path, "0::/pod\n", [_v2_mount(other, root="/elsewhere"), _v2_mount(cg)])
    assert cgroup_memory_limit(proc) == GIB
    assert cgroup_cpu_quota(proc) == 1.0


def test_v2_memory_high_counts_where_it_is_below_the_max(tmp_path):
    """Past ``memory.high`` the kernel throttles the cgroup and reclaims hard (Kubernetes'
    memory QoS sets it under the limit): the proxy sizes itself by it."""
    cg = tmp_path / "cg"
    _write(cg, f"memory.max={2 * GIB};memory.high={GIB + GIB // 2}")
    proc = _proc(tmp_path, "0::/\n", [_v2_mount(cg)])
    assert cgroup_memory_limit(proc) == GIB + GIB // 2
    (cg / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(proc) == GIB + GIB // 2
    (cg / "memory.high").write_text("max\n")
    assert cgroup_memory_limit(proc) is None
