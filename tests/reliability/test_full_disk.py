"""A store on a filesystem that fills up under load, then gets space back (issue 34).

The proxy runs as a child process (``capture-proxy serve``) whose store lives on a real tmpfs
of ``SIZE_KIB``, mounted in a mount namespace of its own (``unshare``: nothing is mounted on
the host, and the mount goes with the process): as root ``unshare --mount``, else (or when
root lacks the capability) ``unshare --user --map-root-user --mount``, where the kernel allows
user namespaces. A ballast file holds all but about ``STORE_KIB`` of it, so SQLite gets
``SQLITE_FULL`` ("database or disk is full") from the kernel's ENOSPC after a few dozen calls;
deleting the ballast (through ``/proc/<pid>/root``) gives space back, as an operator freeing a
disk would. Where the kernel refuses both mounts the test is skipped, saying so: a limit on
file size (``RLIMIT_FSIZE``, ``EFBIG``) or on SQLite's page count would not be a full disk.

Sessions of the three APIs, streamed and whole (``store_load``), run at once against it:
- ``store_failure = refuse``: once the disk is full every call is refused (503 / in-band
  error), ``/health`` is degraded with SQLite's error, ``store_failures`` counts the refusals;
  after the ballast goes, the refused calls' retries are stored, ``/health`` is ok by itself,
  and every answered call is stored exactly once, in one chain per session;
- ``store_failure = answer``: every call is answered; the ones the full disk lost are counted,
  kept in memory, and once writes succeed marked on their rollouts (``store_failed`` naming
  exactly them).
The figures of each run are printed (``-s``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from pathlib import Path

import aiohttp
import pytest

from benchmarks.services import proxy_service
from capture_proxy.scripted_engine.app import ScriptedEngineConfig, build_scripted_engine_app
from tests.reliability.store_load import (
    Load,
    check_marked_losses,
    check_refused_run,
    health,
    lost_calls,
    metric,
    metrics_text,
)

#: Space the store gets before the disk is full (its schema included), and the ballast.
STORE_KIB = 1200
BALLAST_KIB = 8192
SIZE_KIB = STORE_KIB + BALLAST_KIB
SESSIONS = 36  # 6 per (API, stream or whole)
STEPS = 4
DEADLINE_S = 180.0

#: Mounts the tmpfs at $1 with a ballast of $2 bytes, then runs the rest of the arguments.
_IN_SMALL_DISK = (
    'mount -t tmpfs -o size="$SIZE_KIB"k capture-full-disk "$1" '
    '&& head -c "$2" /dev/zero > "$1/ballast" && shift 2 && exec "$@"'
)
_UNSHARE = {
    "mount namespace": ["unshare", "--mount", "--propagation", "private"],
    "user and mount namespace": [
        "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
    ],
}  # fmt: skip


def _namespace() -> list[str]:
    """The ``unshare`` prefix under which a tmpfs can be mounted here; skips (naming what the
    kernel said) when there is none."""
    said = []
    with tempfile.TemporaryDirectory(prefix="capture-mount-probe-") as probe:
        for name, prefix in _UNSHARE.items():
            try:
                run = subprocess.run(
                    [*prefix, "sh", "-c", 'mount -t tmpfs -o size=64k probe "$1"', "sh", probe],
                    capture_output=True,
                    timeout=30,
                )
            except FileNotFoundError as exc:
                said.append(f"{name}: {exc}")
                continue
            if run.returncode == 0:
                return prefix
            said.append(f"{name}: {run.stderr.decode(errors='replace').strip()}")
    pytest.skip("cannot mount a small filesystem here (" + "; ".join(said) + ")")


@pytest.fixture
async def engine_url(aiohttp_server, qwen_tokenizer) -> str:
    engine = await aiohttp_server(build_scripted_engine_app(ScriptedEngineConfig(), qwen_tokenizer))
    return str(engine.make_url("/")).rstrip("/")


def _proxy_on_small_disk(tmp_path: Path, backend: str, *flags: str):
    """The proxy's service, its store on a fresh tmpfs at ``tmp_path/disk``."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proxy = proxy_service(tmp_path, backend, disk / "store", log_level="WARNING")
    proxy.argv = [
        *_namespace(),
        "sh", "-c", _IN_SMALL_DISK, "sh", str(disk), str(BALLAST_KIB * 1024),
        *proxy.argv, *flags,
    ]  # fmt: skip
    proxy.env = {"SIZE_KIB": str(SIZE_KIB)}
    return proxy, disk


def _free_ballast(pid: int, disk: Path) -> None:
    """Delete the ballast in the proxy's mount namespace (its view of the filesystem)."""
    os.remove(f"/proc/{pid}/root{disk}/ballast")


async def test_a_full_disk_refuses_calls_and_stores_every_answered_one_after_recovery(
    engine_url, tmp_path
):
    proxy, disk = _proxy_on_small_disk(tmp_path, engine_url)
    proxy.start()
    try:
        async with aiohttp.ClientSession(proxy.url) as client:
            await proxy.wait_healthy(client, 60)
            load = Load(client, SESSIONS, STEPS, DEADLINE_S)
            tasks = load.start("full")
            await asyncio.wait_for(load.stalled.wait(), DEADLINE_S)
            assert load.refused, "the disk never filled: no call was refused"
            assert load.waiting > 0
            status, body = await health(client)
            assert (status, body["status"]) == (503, "degraded")
            assert "database or disk is full" in body["store"]["write_error"]
            refused_while_full = len(load.refused)
            text = await metrics_text(client)
            assert metric(text, "capture_proxy_store_failures_total") == refused_while_full
            answered_while_full = len(load.answered)

            _free_ballast(proxy.pid, disk)
            load.recovered.set()
            await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
            status, body = await health(client)
            assert (status, body["status"]) == (200, "ok"), body
            figures = await check_refused_run(client, load)
            assert figures["answered"] == SESSIONS * STEPS
            print(
                f"\nfull disk, store_failure = refuse: {figures} (before the ballast went: "
                f"{answered_while_full} answered, {refused_while_full} refused); {load.by_kind()}"
            )
    finally:
        proxy.stop()


async def test_a_full_disk_with_answer_setting_marks_every_lost_call_after_recovery(
    engine_url, tmp_path
):
    proxy, disk = _proxy_on_small_disk(tmp_path, engine_url, "--store-failure", "answer")
    proxy.start()
    try:
        async with aiohttp.ClientSession(proxy.url) as client:
            await proxy.wait_healthy(client, 60)
            load = Load(client, SESSIONS, STEPS, DEADLINE_S)
            await asyncio.wait_for(asyncio.gather(*load.start("lossy")), DEADLINE_S)
            assert not load.refused and len(load.answered) == SESSIONS * STEPS
            lost = await lost_calls(client, load)
            num_lost = sum(len(v) for v in lost.values())
            assert num_lost > 0, "the disk never filled: no call was lost"
            status, body = await health(client)
            assert (status, body["status"]) == (503, "degraded")
            assert body["capture"]["answered_unstored"] == num_lost
            unmarked = body["store"]["unmarked_losses"]
            assert 0 < unmarked["calls"] <= num_lost  # a mark may fit where a call did not
            # Meanwhile the rollout's view says what was lost (from memory or the store).
            await check_marked_losses(client, lost)
            text = await metrics_text(client)
            assert metric(text, "capture_proxy_calls_answered_unstored_total") == num_lost
            assert metric(text, "capture_proxy_store_failures_total") == num_lost

            _free_ballast(proxy.pid, disk)
            after = Load(client, 1, 1, DEADLINE_S)  # a write that succeeds: marks follow
            await asyncio.wait_for(asyncio.gather(*after.start("after")), DEADLINE_S)
            await _until_healthy(client)
            await check_marked_losses(client, lost)
            stored = len(load.answered) - num_lost
            print(
                f"\nfull disk, store_failure = answer: sent {len(load.attempts)}, answered "
                f"{len(load.answered)}, stored {stored}, lost and marked {num_lost} on "
                f"{sum(1 for v in lost.values() if v)} rollouts (unmarked while full: "
                f"{unmarked['calls']} calls), store_failures {num_lost}"
            )
    finally:
        proxy.stop()


async def _until_healthy(client: aiohttp.ClientSession) -> None:
    """Poll ``/health`` until 200 (the marks run off the call's path), bounded."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while True:
        status, body = await health(client)
        if status == 200:
            return
        assert loop.time() < end, body
        await asyncio.sleep(0.05)
