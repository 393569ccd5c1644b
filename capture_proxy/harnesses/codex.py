"""Run the real Codex CLI offline against a Responses-API server (a fake or the proxy).

Codex is installed by ``scripts/install-harnesses`` into ``.cache/codex`` (pinned
``@openai/codex`` from npm, with its platform package).

Offline recipe: a scratch ``HOME`` and ``CODEX_HOME`` with a ``config.toml`` that selects one
custom provider, ``[model_providers.local]`` with ``wire_api = "responses"``, ``base_url`` =
the server (ending in ``/v1``; Codex appends ``/responses``) and ``env_key`` naming the variable
that holds the (dummy) key; then
``codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox "TASK"`` in the
project dir (the sandbox needs kernel features a container may lack).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

from capture_proxy.harnesses._process import HarnessResult, base_env, find_binary, run_bounded

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL_BINARY = REPO_ROOT / ".cache" / "codex" / "node_modules" / ".bin" / "codex"
CODEX_VERSION = "0.169.0"

PROVIDER_ID = "local"
MODEL_ID = "fake-model"
API_KEY_ENV = "CAPTURE_PROXY_CODEX_KEY"
API_KEY = "sk-codex-dummy-not-secret"


# Features that reach beyond the provider (plugin/app sync with GitHub and chatgpt.com, tool
# suggestions, hosted tools): off, so a run makes no DNS lookup or connection but to base_url.
OFFLINE_FEATURES: dict[str, bool] = {
    "plugins": False,
    "remote_plugin": False,
    "apps": False,
    "tool_suggest": False,
    "skill_mcp_dependency_install": False,
    "image_generation": False,
    "in_app_updates": False,
}


BASE_INSTRUCTIONS = (
    "You are Codex, a coding agent. Use the tools to inspect and change files in the "
    "workspace, then answer briefly."
)


def model_catalog(model: str = MODEL_ID) -> dict[str, Any]:
    """A one-model ``model_catalog_json``: without it Codex uses fallback metadata for an
    unknown model name (a warning on every turn, no ``apply_patch`` tool). With it Codex offers
    ``apply_patch`` as a freeform (``custom``) tool, asks for reasoning summaries
    (``reasoning: {"summary": "auto"}``) and uses ``BASE_INSTRUCTIONS`` as the base prompt (a
    short one: the request bodies stay ~10 KB instead of ~40 KB)."""
    return {
        "models": [
            {
                "slug": model,
                "display_name": model,
                "description": "A local model behind a Responses-API server",
                "base_instructions": BASE_INSTRUCTIONS,
                "apply_patch_tool_type": "freeform",
                "shell_type": "shell_command",
                "supported_reasoning_levels": [],
                "default_reasoning_level": None,
                "supports_reasoning_summaries": True,
                "default_reasoning_summary": "auto",
                "supports_parallel_tool_calls": True,
                "support_verbosity": False,
                "truncation_policy": {"mode": "tokens", "limit": 10000},
                "experimental_supported_tools": [],
                "input_modalities": ["text"],
                "context_window": 128000,
                "visibility": "list",
                "supported_in_api": True,
                "priority": 99,
            }
        ]
    }


def find_codex() -> Path | None:
    """The Codex binary: ``$CODEX_BIN``, else the project-local install, else PATH."""
    return find_binary("CODEX_BIN", LOCAL_BINARY, "codex")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is a JSON string for what we write
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def codex_config(
    base_url: str,
    *,
    model: str = MODEL_ID,
    catalog_path: Path | None = None,
    provider: dict[str, Any] | None = None,
    top_level: dict[str, Any] | None = None,
) -> str:
    """``config.toml`` text: one local Responses-API provider at ``base_url`` (``.../v1``).

    ``provider`` adds keys to ``[model_providers.local]`` (e.g. ``request_max_retries``,
    ``stream_max_retries``, ``stream_idle_timeout_ms``); ``top_level`` adds root keys.
    ``catalog_path``: a ``model_catalog_json`` file (see ``model_catalog``). The hosted
    ``web_search`` tool is disabled (the fake server and the proxy cannot serve it).
    """
    root: dict[str, Any] = {
        "model": model,
        "model_provider": PROVIDER_ID,
        "approval_policy": "never",
        "sandbox_mode": "danger-full-access",
        "check_for_update_on_startup": False,
        "web_search": "disabled",
    }
    if catalog_path is not None:
        root["model_catalog_json"] = str(catalog_path)
    root.update(top_level or {})
    prov: dict[str, Any] = {
        "name": "Local fake",
        "base_url": base_url,
        "wire_api": "responses",
        "env_key": API_KEY_ENV,
    }
    prov.update(provider or {})
    lines = [f"{k} = {_toml_value(v)}" for k, v in root.items()]
    lines += ["", "[analytics]", "enabled = false", "", "[features]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in OFFLINE_FEATURES.items()]
    lines += [""]
    lines += [f"[model_providers.{PROVIDER_ID}]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in prov.items()]
    return "\n".join(lines) + "\n"


def codex_command(
    binary: Path | str, prompt: str, extra_args: list[str] | None = None
) -> list[str]:
    return [
        str(binary),
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--color",
        "never",
        *(extra_args or []),
        prompt,
    ]


def run_codex(
    binary: Path | str,
    base_url: str,
    project_dir: Path | str,
    prompt: str,
    *,
    model: str = MODEL_ID,
    timeout_s: float = 120,
    home_dir: Path | str | None = None,
    use_catalog: bool = True,
    provider: dict[str, Any] | None = None,
    top_level: dict[str, Any] | None = None,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> HarnessResult:
    """Run ``codex exec ... <prompt>`` in ``project_dir`` against ``base_url`` (ending ``/v1``).

    State (config, sessions, logs) goes to ``home_dir/.codex`` (``CODEX_HOME``); without
    ``home_dir`` a temporary one is used and deleted. Blocking (call it via
    ``asyncio.to_thread`` when the server runs on the same loop); the process gets no stdin and
    its whole process group is killed after ``timeout_s``. ``use_catalog=False``: no model
    catalog, Codex's fallback metadata (no ``apply_patch``, its long default base prompt).
    """
    project = Path(project_dir)
    project.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if home_dir is None:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="codex-home-")))
        else:
            home = Path(home_dir)
            home.mkdir(parents=True, exist_ok=True)
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        catalog_path = None
        if use_catalog:
            catalog_path = codex_home / "model_catalog.json"
            catalog_path.write_text(json.dumps(model_catalog(model), indent=2), encoding="utf-8")
        (codex_home / "config.toml").write_text(
            codex_config(
                base_url,
                model=model,
                catalog_path=catalog_path,
                provider=provider,
                top_level=top_level,
            ),
            encoding="utf-8",
        )
        env = base_env(home, drop_prefixes=("CODEX_", "OPENAI_"))
        env.update(
            {
                "CODEX_HOME": str(codex_home),
                API_KEY_ENV: API_KEY,
                "RUST_LOG": env.get("RUST_LOG", "warn"),
            }
        )
        env.update(extra_env or {})
        cmd = codex_command(binary, prompt, extra_args)
        return run_bounded("codex", cmd, cwd=project, env=env, timeout_s=timeout_s)
