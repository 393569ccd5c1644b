"""Child processes of the benchmarks: the scripted engine and the proxy as ``capture-proxy``
processes on free loopback ports, with their logs, health waits, CPU and memory figures, and
py-spy sampling.

Every wait has a deadline; stopping is SIGINT then SIGKILL, by the pid we started. Must not:
send model calls (``sessions`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A loopback port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def cli_command() -> list[str]:
    """How to run ``capture-proxy``: the venv's script, else this interpreter's module."""
    script = Path(sys.executable).parent / "capture-proxy"
    return [str(script)] if script.exists() else [sys.executable, "-m", "capture_proxy.cli"]


@dataclass
class Service:
    """A child process serving HTTP on ``port``; its output goes to ``log_path``."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    #: extra environment (``PYTHONPATH`` of another source tree: a baseline in the same run)
    env: dict[str, str] | None = None
    #: its working directory (default: this tree); ``python -m`` imports from there first
    cwd: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd or ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env} if self.env else None,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def wait_healthy(self, session: aiohttp.ClientSession, deadline_s: float) -> None:
        """Poll ``/health`` until 200, the process exits, or ``deadline_s`` passes."""
        assert self.proc is not None
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(
                    self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy after {deadline_s} s: {self.tail()}")

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL and reap (bounded)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGINT (aiohttp's graceful exit, lets a profiler write), then SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


def baseline_env(src: str | None) -> dict[str, str] | None:
    """The environment that runs ``capture-proxy`` from the source tree ``src`` (e.g. a
    ``git archive`` of the fork point), so a baseline is measured in the same run."""
    return {"PYTHONPATH": str(Path(src).resolve())} if src else None


def one_process(argv: list[str], baseline_src: str | None = None) -> list[str]:
    """``serve`` argv in one process (``--workers 1``): the benchmarks read one pid's CPU. A
    baseline tree (``--baseline-src``) from before ``serve --workers`` has no such flag and
    is one process anyway; one after it (its default: a worker per CPU) gets the flag too."""
    one = [*argv, "--workers", "1"]
    if baseline_src is None:
        return one
    return one if (Path(baseline_src) / "capture_proxy" / "cli" / "workers.py").exists() else argv


def engine_service(work: Path, port: int | None = None, policy: Path | None = None) -> Service:
    """The scripted engine (``policy``: its policy file, else the default policy)."""
    port = port or free_port()
    argv = [*cli_command(), "scripted-engine", "--port", str(port)]
    if policy is not None:
        argv += ["--policy", str(policy)]
    return Service("engine", argv, port, work / "engine.log")


def proxy_service(
    work: Path,
    backend: str,
    store: Path | str,
    port: int | None = None,
    *,
    log_level: str = "INFO",
    profile_to: Path | None = None,
    store_synchronous: str = "full",
    name: str = "proxy",
    workers: int | None = 1,
) -> Service:
    """``capture-proxy serve`` on ``store``; ``workers``: its ``--workers`` (None: the
    default, one per CPU: then its CPU is its process tree's)."""
    port = port or free_port()
    args = ["serve", "--backend", backend, "--port", str(port), "--store", str(store)]
    args += ["--log-level", log_level, "--store-synchronous", store_synchronous]
    if workers is not None:
        args += ["--workers", str(workers)]
    if profile_to is not None:
        argv = [sys.executable, "-m", "cProfile", "-o", str(profile_to)]
        argv += ["-m", "capture_proxy.cli", *args]
    else:
        argv = [*cli_command(), *args]
    return Service(name, argv, port, work / f"{name}.log")


def proc_status_kib(pid: int, field_name: str) -> int | None:
    """A ``/proc/<pid>/status`` field in KiB (e.g. ``VmHWM``: peak resident set)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (``/proc/<pid>/stat``, all threads)."""
    split = proc_user_sys_s(pid)
    return None if split is None else split[0] + split[1]


def proc_user_sys_s(pid: int) -> tuple[float, float] | None:
    """User and system CPU seconds of a process (``/proc/<pid>/stat``, all threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick
    except (OSError, ValueError, IndexError):
        return None


def thread_cpu_s(pid: int) -> dict[str, tuple[float, float]]:
    """User and system CPU seconds of each live thread of ``pid``, summed by thread role:
    ``main`` (the thread whose id is the pid: the event loop), the store's threads by their
    OS name (``capture-store-w``: the writer, ``capture-store-r``: the reader; names are cut
    to 15 characters and set only when the process runs under ``named_threads.py``), and
    ``other``. Threads that ended are missing: take the process total for them."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            head, rest = (task / "stat").read_text().rsplit(")", 1)
        except OSError:
            continue  # the thread ended
        comm = head.split("(", 1)[1]
        fields = rest.split()
        role = "main" if task.name == str(pid) else comm
        if role != "main" and not role.startswith("capture-store-"):
            role = "other"
        user, system = out.get(role, (0.0, 0.0))
        out[role] = (user + int(fields[11]) / tick, system + int(fields[12]) / tick)
    return out


def start_py_spy(out: str, pid: int) -> subprocess.Popen[bytes]:
    """``py-spy record`` on ``pid`` (all threads, native frames off) until stopped."""
    argv = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--threads"]
    argv += ["--rate", "250", "--output", out]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_py_spy(proc: subprocess.Popen[bytes], out: str) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    print(f"  py-spy samples of the proxy during this phase: {out}")
