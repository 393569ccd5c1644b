"""Run the real Claude Code CLI offline against an Anthropic-Messages server (a fake or the proxy).

Claude Code is installed by ``scripts/install-harnesses`` into ``.cache/claude-code`` (pinned
``@anthropic-ai/claude-code`` from npm, with its platform package).

Offline recipe: a private ``HOME`` (settings, sessions, ``.claude.json``), the server in
``ANTHROPIC_BASE_URL`` (without ``/v1``: Claude Code appends ``/v1/messages?beta=true``), a
dummy ``ANTHROPIC_API_KEY``, and the variables in ``OFFLINE_ENV`` (no telemetry, error
reporting, auto-update, feedback survey or other non-essential traffic); then
``claude -p "TASK" --model NAME --allowedTools "Bash,Read,Edit,Write"`` in the project dir
(tools named there run without asking, also as root).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

from capture_proxy.harnesses._process import HarnessResult, base_env, find_binary, run_bounded

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL_BINARY = REPO_ROOT / ".cache" / "claude-code" / "node_modules" / ".bin" / "claude"
CLAUDE_CODE_VERSION = "2.1.328"

MODEL_ID = "fake-model"
API_KEY = "sk-ant-dummy-not-secret"
ALLOWED_TOOLS = "Bash,Read,Edit,Write"

#: What keeps Claude Code quiet offline: no telemetry, error reporting, auto-updater, feedback
#: survey, release-notes or model-list fetches (the *NONESSENTIAL* switch covers most of them).
OFFLINE_ENV: dict[str, str] = {
    "DISABLE_TELEMETRY": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
    "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
}


def find_claude() -> Path | None:
    """The Claude Code binary: ``$CLAUDE_BIN``, else the project-local install, else PATH."""
    return find_binary("CLAUDE_BIN", LOCAL_BINARY, "claude")


def claude_command(
    binary: Path | str,
    prompt: str,
    *,
    model: str = MODEL_ID,
    allowed_tools: str = ALLOWED_TOOLS,
    extra_args: list[str] | None = None,
) -> list[str]:
    return [
        str(binary),
        "-p",
        prompt,
        "--model",
        model,
        "--allowedTools",
        allowed_tools,
        *(extra_args or []),
    ]


def claude_env(
    home: Path, base_url: str, extra_env: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of one offline run: ``base_env`` without any ``ANTHROPIC_*`` or
    ``CLAUDE*`` setting of the caller, plus the server, the dummy key and ``OFFLINE_ENV``."""
    env = base_env(home, drop_prefixes=("ANTHROPIC_", "CLAUDE", "DISABLE_"))
    env.update(OFFLINE_ENV)
    env.update({"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": API_KEY})
    env.update(extra_env or {})
    return env


def write_home_state(home: Path, project: Path) -> None:
    """Settings that keep a print-mode run from prompting or phoning home: onboarding done,
    the project trusted, the dummy key approved, auto-updates off."""
    claude_dir = home / ".claude"
    claude_dir.mkdir(parents=True, exist_ok=True)
    settings = {"autoUpdates": False, "includeCoAuthoredBy": False, "env": OFFLINE_ENV}
    (claude_dir / "settings.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    state = {
        "hasCompletedOnboarding": True,
        "autoUpdates": False,
        "customApiKeyResponses": {"approved": [API_KEY[-20:]], "rejected": []},
        "projects": {
            str(project.resolve()): {
                "hasTrustDialogAccepted": True,
                "hasCompletedProjectOnboarding": True,
                "allowedTools": [],
            }
        },
    }
    (home / ".claude.json").write_text(json.dumps(state, indent=2), encoding="utf-8")


def run_claude(
    binary: Path | str,
    base_url: str,
    project_dir: Path | str,
    prompt: str,
    *,
    model: str = MODEL_ID,
    allowed_tools: str = ALLOWED_TOOLS,
    timeout_s: float = 120,
    home_dir: Path | str | None = None,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> HarnessResult:
    """Run ``claude -p <prompt>`` in ``project_dir`` against ``base_url`` (no ``/v1``).

    State goes to ``home_dir`` (``HOME``); without it a temporary one is used and deleted.
    Blocking (call it via ``asyncio.to_thread`` when the server runs on the same loop); the
    process gets no stdin and its whole process group is killed after ``timeout_s``.
    """
    project = Path(project_dir)
    project.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if home_dir is None:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="claude-home-")))
        else:
            home = Path(home_dir)
            home.mkdir(parents=True, exist_ok=True)
        write_home_state(home, project)
        env = claude_env(home, base_url, extra_env)
        env["PWD"] = str(project.resolve())
        cmd = claude_command(
            binary, prompt, model=model, allowed_tools=allowed_tools, extra_args=extra_args
        )
        return run_bounded("claude", cmd, cwd=project, env=env, timeout_s=timeout_s)
