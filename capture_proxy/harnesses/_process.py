"""Bounded runs of a harness CLI: shared by the Codex and Claude Code drivers.

A harness runs with no stdin in its own process group, which is killed (with any tool
subprocess it left behind) when it exits or after ``timeout_s``. The environment is the
caller's minus provider keys, proxies and the harness's own settings, plus a scratch ``HOME``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

LOOPBACK_NO_PROXY = "127.0.0.1,localhost"


@dataclass(frozen=True)
class HarnessResult:
    harness: str
    returncode: int | None  # None: killed on timeout
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        """A short text for assertion messages."""
        return (
            f"{self.harness} returncode={self.returncode} timed_out={self.timed_out} "
            f"duration={self.duration_s:.1f}s\n--- stdout ---\n{self.stdout[-4000:]}"
            f"\n--- stderr ---\n{self.stderr[-4000:]}"
        )


def find_binary(env_var: str, local: Path, name: str) -> Path | None:
    """``$env_var`` if set (must be executable), else the project-local install, else PATH."""
    override = os.environ.get(env_var)
    if override:
        p = Path(override)
        return p if p.is_file() and os.access(p, os.X_OK) else None
    if local.is_file() and os.access(local, os.X_OK):
        return local
    found = shutil.which(name)
    return Path(found) if found else None


def base_env(home: Path, drop_prefixes: Iterable[str]) -> dict[str, str]:
    """The caller's environment without provider keys, outbound proxies, XDG dirs and any
    variable starting with one of ``drop_prefixes``; ``HOME`` and ``XDG_*`` under ``home``."""
    prefixes = ("XDG_", *drop_prefixes)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(prefixes)
        and not k.endswith(("_API_KEY", "_AUTH_TOKEN"))
        and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    dirs = {
        "HOME": home,
        "XDG_CONFIG_HOME": home / ".config",
        "XDG_DATA_HOME": home / ".local" / "share",
        "XDG_STATE_HOME": home / ".local" / "state",
        "XDG_CACHE_HOME": home / ".cache",
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    env.update({k: str(v) for k, v in dirs.items()})
    env.update(
        {
            "NO_PROXY": LOOPBACK_NO_PROXY,
            "no_proxy": LOOPBACK_NO_PROXY,
            "NO_COLOR": "1",
            "TERM": "dumb",
            "CI": "true",
        }
    )
    return env


def run_bounded(
    harness: str, cmd: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float
) -> HarnessResult:
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # own process group: the timeout kills its children too
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # pipes held open by an escaped grandchild
            out, err = b"", b"(output lost: pipes still open 10 s after kill)"
    except BaseException:
        _kill_group(proc)
        proc.wait(timeout=10)
        raise
    finally:
        # tool subprocesses may outlive a finished harness; never leak them
        _kill_group(proc)
    return HarnessResult(
        harness=harness,
        returncode=None if timed_out else proc.returncode,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        duration_s=time.monotonic() - start,
        timed_out=timed_out,
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
