"""Run the real OpenCode CLI offline against an OpenAI-compatible server (a stub or the proxy).

Used by the ``opencode``-marked tests and by ``capture-proxy demo``. OpenCode is installed by
``scripts/install-opencode`` into ``.cache/opencode`` (pinned ``opencode-ai`` from npm).

Offline recipe (see tests/fixtures/opencode/README.md): a scratch ``HOME`` and ``XDG_*`` dirs,
``OPENCODE_DISABLE_MODELS_FETCH=1`` and ``OPENCODE_DISABLE_AUTOUPDATE=1``, a project-level
``opencode.json`` that defines one custom provider (``@ai-sdk/openai-compatible``) whose
``options.baseURL`` is the server, and ``opencode run "<prompt>"`` (``-c`` continues the last
session, which lives in the scratch HOME's data dir: pass the same ``home_dir`` to both runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture_proxy.harnesses._process import run_bounded

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL_BINARY = REPO_ROOT / ".cache" / "opencode" / "node_modules" / ".bin" / "opencode"
OPENCODE_VERSION = "1.18.33"

PROVIDER_ID = "stub"
MODEL_ID = "stub-model"
API_KEY = "sk-stub-not-secret"


@dataclass(frozen=True)
class OpencodeResult:
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
            f"opencode returncode={self.returncode} timed_out={self.timed_out} "
            f"duration={self.duration_s:.1f}s\n--- stdout ---\n{self.stdout[-4000:]}"
            f"\n--- stderr ---\n{self.stderr[-4000:]}"
        )


def find_opencode() -> Path | None:
    """The OpenCode binary: ``$OPENCODE_BIN``, else the project-local install, else PATH."""
    override = os.environ.get("OPENCODE_BIN")
    if override:
        p = Path(override)
        return p if p.is_file() and os.access(p, os.X_OK) else None
    if LOCAL_BINARY.is_file() and os.access(LOCAL_BINARY, os.X_OK):
        return LOCAL_BINARY
    found = shutil.which("opencode")
    return Path(found) if found else None


def opencode_config(
    base_url: str,
    *,
    steps: int | None = None,
    model_reasoning: bool = False,
    interleaved_reasoning: bool = False,
) -> dict[str, Any]:
    """The config the fixtures were recorded with, pointed at ``base_url`` (``.../v1``)."""
    model: dict[str, Any] = {
        "name": "Stub Model",
        "tool_call": True,
        "reasoning": bool(model_reasoning or interleaved_reasoning),
        "limit": {"context": 128000, "output": 8192},
    }
    if interleaved_reasoning:
        model["interleaved"] = {"field": "reasoning_content"}
    cfg: dict[str, Any] = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "snapshot": False,
        "lsp": False,
        "formatter": False,
        "enabled_providers": [PROVIDER_ID],
        "model": f"{PROVIDER_ID}/{MODEL_ID}",
        "small_model": f"{PROVIDER_ID}/{MODEL_ID}",
        "provider": {
            PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Local stub",
                "options": {"baseURL": base_url, "apiKey": API_KEY},
                "models": {MODEL_ID: model},
            }
        },
    }
    if steps is not None:
        cfg["agent"] = {"build": {"steps": int(steps)}}
    return cfg


def scratch_env(home_dir: Path, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for an offline, non-interactive run with all state under ``home_dir``."""
    env = {
        k: v
        for k, v in os.environ.items()
        # no user OpenCode settings, no real provider keys, no proxies to the outside
        if not k.startswith(("OPENCODE", "XDG_"))
        and not k.endswith("_API_KEY")
        and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    dirs = {
        "HOME": home_dir,
        "XDG_CONFIG_HOME": home_dir / ".config",
        "XDG_DATA_HOME": home_dir / ".local" / "share",
        "XDG_STATE_HOME": home_dir / ".local" / "state",
        "XDG_CACHE_HOME": home_dir / ".cache",
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    env.update({k: str(v) for k, v in dirs.items()})
    env.update(
        {
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            "NO_COLOR": "1",
            "TERM": "dumb",
            "CI": "true",
        }
    )
    if extra_env:
        env.update(extra_env)
    return env


def run_opencode(
    binary: Path | str,
    base_url: str,
    project_dir: Path | str,
    prompt: str,
    *,
    continue_session: bool = False,
    steps: int | None = None,
    timeout_s: float = 180,
    model_reasoning: bool = False,
    interleaved_reasoning: bool = False,
    home_dir: Path | str | None = None,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> OpencodeResult:
    """Run ``opencode run <prompt>`` in ``project_dir`` against ``base_url`` (ending in ``/v1``).

    Writes ``project_dir/opencode.json``. OpenCode state (sessions, logs, plugin cache) goes to
    ``home_dir``; pass the same ``home_dir`` for a later ``continue_session=True`` run so that
    ``-c`` finds the session. Without ``home_dir`` a temporary one is used and deleted.
    Blocking (call it via ``asyncio.to_thread`` when the server runs on the same loop). The
    process gets no stdin and its whole process group is killed after ``timeout_s``.
    """
    if continue_session and home_dir is None:
        raise ValueError("continue_session=True needs the home_dir of the earlier run")
    project = Path(project_dir)
    project.mkdir(parents=True, exist_ok=True)
    cfg = opencode_config(
        base_url,
        steps=steps,
        model_reasoning=model_reasoning,
        interleaved_reasoning=interleaved_reasoning,
    )
    (project / "opencode.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")

    cmd = [str(binary), "run"]
    if continue_session:
        cmd.append("-c")
    cmd += list(extra_args or [])
    cmd.append(prompt)

    with contextlib.ExitStack() as stack:
        if home_dir is None:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="opencode-home-")))
        else:
            home = Path(home_dir)
            home.mkdir(parents=True, exist_ok=True)
        env = scratch_env(home, extra_env)
        # OpenCode takes its working directory from $PWD when set, not from getcwd()
        env["PWD"] = str(project.resolve())
        return _run_bounded(cmd, cwd=project, env=env, timeout_s=timeout_s)


def _run_bounded(
    cmd: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float
) -> OpencodeResult:
    """One bounded run (``_process.run_bounded``: own process group, killed on timeout)."""
    done = run_bounded("opencode", cmd, cwd=cwd, env=env, timeout_s=timeout_s)
    return OpencodeResult(
        returncode=done.returncode,
        stdout=done.stdout,
        stderr=done.stderr,
        duration_s=done.duration_s,
        timed_out=done.timed_out,
    )
