"""``capture-proxy serve`` as a child process: it says it serves only once it listens,
``--port 0`` binds a free port and ``--port-file`` names it, and start-up errors come alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

START_DEADLINE_S = 60.0


def _serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capture_proxy.cli",
            "serve",
            "--backend",
            "http://127.0.0.1:9",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_port_0_binds_a_free_port_and_the_port_file_names_it(tmp_path: Path):
    port_file = tmp_path / "port"
    port_file.write_text("1\n")  # stale, from an earlier run
    proc = _serve("--port", "0", "--port-file", str(port_file), "--store", str(tmp_path / "s"))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the child prints (or exits)
        assert line.startswith("capture-proxy: serving on http://127.0.0.1:"), (
            line,
            proc.stderr.read() if proc.poll() is not None and proc.stderr else "",
        )
        port = int(line.split("127.0.0.1:", 1)[1].split(" ", 1)[0])
        assert port != 0
        # Written before the line was printed, and the socket already listens.
        assert port_file.read_text() == f"{port}\n"
        # No engine on port 9: /health says so (503), not "ok".
        with pytest.raises(urllib.error.HTTPError) as down:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        assert down.value.code == 503
        assert json.load(down.value)["status"] == "engine_unreachable"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=START_DEADLINE_S)
    assert proc.returncode == 0
    assert "WARNING capture_proxy: the engine at http://127.0.0.1:9 does not answer" in err, err


def test_the_serving_line_names_every_backend(tmp_path: Path):
    """A new-user trial: with several ``--backend``s the line named the first only."""
    store = tmp_path / "s"
    proc = _serve("--backend", "http://127.0.0.1:10", "--port", "0", "--store", str(store),
                  "--workers", "1")  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the child prints (or exits)
        port = int(line.split("127.0.0.1:", 1)[1].split(" ", 1)[0])
        assert line == (
            f"capture-proxy: serving on http://127.0.0.1:{port} -> http://127.0.0.1:9 + "
            f"http://127.0.0.1:10, store {store}; viewer at http://127.0.0.1:{port}/captures/ui/\n"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=START_DEADLINE_S)
    assert proc.returncode == 0


def test_a_busy_port_is_reported_without_a_serving_line(tmp_path: Path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _serve("--port", str(port), "--store", str(tmp_path / "s"))
        out, err = proc.communicate(timeout=START_DEADLINE_S)
    assert proc.returncode == 2
    assert "serving on" not in out
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_a_bad_store_is_reported_without_a_serving_line(tmp_path: Path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    port_file = tmp_path / "port"
    proc = _serve("--port", "0", "--port-file", str(port_file), "--store", str(not_a_dir))
    out, err = proc.communicate(timeout=START_DEADLINE_S)
    assert proc.returncode == 2, err
    assert "serving on" not in out
    assert str(not_a_dir) in err
    assert not port_file.exists()


def test_a_public_host_without_a_read_api_token_is_refused(tmp_path: Path):
    proc = _serve("--host", "0.0.0.0", "--port", "0", "--store", str(tmp_path / "s"))
    out, err = proc.communicate(timeout=START_DEADLINE_S)
    assert proc.returncode == 2
    assert "serving on" not in out
    assert "captures_token" in err and "--insecure-read-api" in err
    assert "allow_unauthenticated_read_api" in err


def test_a_port_file_in_a_missing_directory_is_a_clear_error(tmp_path: Path):
    proc = _serve("--port", "0", "--port-file", str(tmp_path / "nodir" / "p"),
                  "--store", str(tmp_path / "s"))  # fmt: skip
    out, err = proc.communicate(timeout=START_DEADLINE_S)
    assert proc.returncode == 2 and out == ""
    assert "--port-file" in err and "nodir" in err and "Traceback" not in err


def test_a_second_proxy_on_the_same_store_refuses_to_start(tmp_path: Path):
    first = _serve("--port", "0", "--store", str(tmp_path / "s"))
    try:
        assert first.stdout is not None
        assert first.stdout.readline().startswith("capture-proxy: serving on")
        second = _serve("--port", "0", "--store", str(tmp_path / "s"))
        out, err = second.communicate(timeout=START_DEADLINE_S)
        assert second.returncode == 2 and "serving on" not in out
        assert f"is in use by pid {first.pid}" in err and "postgresql://" in err
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=START_DEADLINE_S)


def test_a_misspelt_environment_variable_stops_start_up(tmp_path: Path):
    import os

    env = {**os.environ, "CAPTURE_PROXY_PROXY_TOKN": "secret"}
    proc = subprocess.run(
        [sys.executable, "-m", "capture_proxy.cli", "serve", "--backend", "http://127.0.0.1:9",
         "--port", "0", "--store", str(tmp_path / "s")],
        capture_output=True, text=True, env=env, timeout=START_DEADLINE_S,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert "CAPTURE_PROXY_PROXY_TOKN" in proc.stderr


def test_serve_masks_the_engine_password_and_cuts_off_a_stalled_request_head(tmp_path: Path):
    """Issue 26: the start-up line, the log and a 502 say ``user:***``; a client that never
    finishes its headers is disconnected after ``--client-header-timeout``."""
    import socket
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capture_proxy.cli",
            "serve",
            "--backend",
            "http://user:PASSWORD@127.0.0.1:9",
            "--port",
            "0",
            "--store",
            str(tmp_path / "s"),
            "--client-header-timeout",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "-> http://user:***@127.0.0.1:9," in line, line
        port = int(line.split("127.0.0.1:", 1)[1].split(" ", 1)[0])
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/ng-rollout/r1/training-token-capture/v1/chat/completions",
            data=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
            headers={"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(request, timeout=30)
        except urllib.error.HTTPError as exc:
            assert exc.code == 502
            assert b"PASSWORD" not in exc.read()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
            started = time.monotonic()
            assert sock.recv(100) == b""  # closed by the server, not by our timeout
            assert time.monotonic() - started < 8
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=START_DEADLINE_S)
    assert "PASSWORD" not in err
    assert "engine_unreachable" in err or "-> 502" in err


def test_a_backend_ending_in_v1_is_warned_about_once(tmp_path: Path):
    """A new-user trial: ``--backend http://127.0.0.1:8000/v1`` (the OpenAI SDK's base URL
    habit) served, and every call got the engine's 404 for /v1/v1/... with no hint."""
    proc = _serve("--backend", "http://127.0.0.1:10/v1/", "--port", "0",
                  "--store", str(tmp_path / "s"), "--workers", "2")  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the child prints (or exits)
        assert line.startswith("capture-proxy: serving on"), line
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=START_DEADLINE_S)
    assert proc.returncode == 0
    warnings = [w for w in err.splitlines() if "ends in /v1" in w]
    assert len(warnings) == 1, err
    assert warnings[0].endswith(
        "WARNING capture_proxy: backend http://127.0.0.1:10/v1 ends in /v1: the backend is the "
        "engine's base URL (e.g. http://127.0.0.1:10) and the proxy adds /v1/... itself, so "
        "/v1 is likely doubled (http://127.0.0.1:10/v1/v1/chat/completions: the engine's "
        "404); drop /v1 unless the engine serves under it"
    )
