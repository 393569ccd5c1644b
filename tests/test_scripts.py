"""``scripts/test --quick`` runs the pure and proxy tiers and installs nothing system-wide."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_collects_the_pure_and_proxy_tiers_and_installs_nothing(tmp_path: Path):
    # Installers that would leave a trace if anything called them.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    called = tmp_path / "called"
    for tool in ("apt-get", "npm", "debootstrap", "podman", "buildah", "sudo"):
        script = fake_bin / tool
        script.write_text(f'#!/bin/sh\necho {tool} "$@" >> "{called}"\nexit 1\n')
        script.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    done = subprocess.run(
        [
            str(ROOT / "scripts" / "test"),
            "--quick",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not called.exists(), called.read_text()
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    tiers = {line.split("/")[1] for line in collected if line.startswith("tests/")}
    assert {"core", "proxy", "store", "scripted_engine"} <= tiers
    assert not tiers & {"e2e", "container", "realengine"}
    assert not [line for line in collected if "opencode_runner" in line]
