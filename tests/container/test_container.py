"""The sidecar image, built and run for real: ``scripts/container-test`` builds the image with
podman (base image from debootstrap, cached), runs the proxy from it with buildah on the host
network in front of the scripted engine, and drives captured calls through it.

Skipped only when podman/buildah are missing and cannot be installed (not root, or no
apt-get). Takes about 1-2 minutes with a cached base image, 3 minutes without.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "container-test"

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]


def _container_tools() -> str | None:
    """None when podman and buildah are usable (installing them if needed); else why not."""
    if shutil.which("podman") and shutil.which("buildah"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "podman/buildah are not installed and cannot be (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        [
            "apt-get",
            "install",
            "-y",
            "-qq",
            "--no-install-recommends",
            "podman",
            "buildah",
            "debootstrap",
            "containernetworking-plugins",
            "fuse-overlayfs",
            "uidmap",
        ],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"cannot install podman/buildah: {' '.join(cmd)}: {done.stderr[-500:]}"
    return None


def test_proxy_from_the_image_captures_calls():
    reason = _container_tools()
    if reason:
        pytest.skip(reason)
    done = subprocess.run(
        [str(SCRIPT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
        stdin=subprocess.DEVNULL,
    )
    print(done.stderr[-4000:])
    assert done.returncode == 0, f"scripts/container-test failed:\n{done.stderr[-6000:]}"
    assert "all checks passed" in done.stderr
