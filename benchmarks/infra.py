"""Throwaway infrastructure for tests and benchmarks: a PostgreSQL server and HAProxy, from
Debian's packages (``scripts/install-postgres``, ``scripts/install-haproxy``), on loopback.

``PostgresServer``: ``initdb`` into a temporary directory, ``postgres`` on a free loopback port
(its socket in that directory too), trust authentication for the one superuser ``capture``.
PostgreSQL refuses to run as root; when this process is root (CI), the data directory is given
to the ``postgres`` system user (created by Debian's package; else ``nobody``) and the server
is exec'd as that user with ``setpriv``, so the pid we hold is the server's own.

``HAProxy``: ``haproxy -f configs/haproxy.cfg`` with the listen port and the replicas' ports
passed as environment variables (the shipped file reads them), in the foreground (``-db``).

Every wait has a deadline; stopping is SIGINT/SIGUSR1 then SIGKILL, by the pid we started.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HAPROXY_CONFIG = ROOT / "configs" / "haproxy.cfg"


def free_port() -> int:
    """A loopback port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def postgres_bin_dir() -> Path | None:
    """``$CAPTURE_PROXY_PG_BIN``, else the newest ``/usr/lib/postgresql/<v>/bin`` (Debian)."""
    env = os.environ.get("CAPTURE_PROXY_PG_BIN")
    if env:
        return Path(env)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/postgres"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return Path(found[-1]).parent if found else None


def _run_as() -> str | None:
    """The user to run the server as when we are root, else None (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and no 'postgres' or 'nobody' user to run PostgreSQL as")


@dataclass
class PostgresServer:
    """A PostgreSQL server in a temporary directory. ``url`` is its superuser DSN."""

    bin_dir: Path
    port: int = field(default_factory=free_port)
    user: str = "capture"
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="capture-pg-")))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        return self.base / "data"

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, database: str, *, schema: str | None = None) -> str:
        url = f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"
        if schema is not None:
            url += f"?options=-csearch_path%3D{schema}"
        return url

    def _argv(self, tool: str, *args: str) -> list[str]:
        argv = [str(self.bin_dir / tool), *args]
        who = _run_as()
        if who is None:
            return argv
        return ["setpriv", f"--reuid={who}", f"--regid={who}", "--init-groups", "--", *argv]

    def start(self, deadline_s: float = 60.0) -> None:
        who = _run_as()
        self.base.mkdir(parents=True, exist_ok=True)
        if who is not None:
            os.chmod(self.base, 0o755)  # the user must reach its data directory
            shutil.chown(self.base, who, who)
        log = self.base / "postgres.log"
        subprocess.run(
            self._argv(
                "initdb",
                "-D",
                str(self.data_dir),
                "-U",
                self.user,
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            ),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=deadline_s,
            cwd=self.base,
        )
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.base),
            "max_connections": "300",
            "shared_buffers": "128MB",
        }
        argv = self._argv("postgres", "-D", str(self.data_dir))
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.base
            )
        self.wait_ready(deadline_s)

    def wait_ready(self, deadline_s: float) -> None:
        """Until ``pg_isready`` says the server accepts connections (bounded)."""
        assert self.proc is not None
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: {self.tail()}")
            ready = subprocess.run(
                [str(self.bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=10,
            )
            if ready.returncode == 0:
                return
            time.sleep(0.05)
        raise TimeoutError(f"postgres not ready after {deadline_s} s: {self.tail()}")

    def tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.base / "postgres.log").read_text(errors="replace")[-n:]
        return ""

    def create_database(self) -> str:
        """A new, empty database; its DSN."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url_for(name)

    def create_schema(self, database: str = "postgres") -> str:
        """A new, empty schema in ``database``; a DSN whose search path is that schema (much
        cheaper than a database per test)."""
        import psycopg

        name = "s_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url_for(database), autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return self.url_for(database, schema=name)

    def stop(self, deadline_s: float = 30.0) -> None:
        """Fast shutdown (SIGINT), SIGKILL past the deadline; then remove the directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=deadline_s)
        shutil.rmtree(self.base, ignore_errors=True)


def haproxy_binary() -> str | None:
    return os.environ.get("CAPTURE_PROXY_HAPROXY") or shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )


@dataclass
class HAProxy:
    """HAProxy in the foreground with ``configs/haproxy.cfg``, listening on ``port`` and
    balancing over the replicas on ``replica_ports`` (at most ``MAX_REPLICAS``)."""

    binary: str
    replica_ports: list[int]
    work: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    MAX_REPLICAS = 4

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        if not 1 <= len(self.replica_ports) <= self.MAX_REPLICAS:
            raise ValueError(f"1 to {self.MAX_REPLICAS} replicas, got {len(self.replica_ports)}")
        env = dict(os.environ, CAPTURE_LB_BIND=f"127.0.0.1:{self.port}")
        for i in range(self.MAX_REPLICAS):
            # Absent replicas point at the first one, disabled (see the config).
            port = self.replica_ports[i] if i < len(self.replica_ports) else self.replica_ports[0]
            env[f"CAPTURE_REPLICA{i + 1}"] = f"127.0.0.1:{port}"
            env[f"CAPTURE_REPLICA{i + 1}_STATE"] = (
                "enabled" if i < len(self.replica_ports) else "disabled"
            )
        env["CAPTURE_LB_CHECK_INTER"] = "500ms"
        return env

    def start(self, deadline_s: float = 30.0) -> None:
        log = self.work / "haproxy.log"
        subprocess.run(
            [self.binary, "-c", "-q", "-f", str(HAPROXY_CONFIG)],
            check=True,
            env=self.environment(),
            timeout=deadline_s,
        )
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [self.binary, "-db", "-f", str(HAPROXY_CONFIG)],
                env=self.environment(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {log.read_text(errors='replace')[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=1
            ):
                return
            time.sleep(0.05)
        raise TimeoutError(f"haproxy not listening after {deadline_s} s")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, deadline_s: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=deadline_s)
