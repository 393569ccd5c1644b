"""Loading the settings: defaults < config file < environment < CLI flags, merged, checked
for names that are no setting (a misspelt key or variable must not pass unnoticed) and
validated into a frozen ``Settings``; every failure a ``ConfigError`` naming its field or
file."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from capture_proxy.config.settings import Settings


class ConfigError(ValueError):
    """Settings are invalid or the config file cannot be read; the message names the field."""


#: CAPTURE_PROXY_* variables that are not settings: the config file's path, and the ones the
#: test suite and tools read (the e2e tier's engine URL, a harness binary override), and
#: CAPTURE_PROXY_NO_COMPILED (streamed chunks on the Python path alone: ``core.chunk_scan``).
ENV_NOT_SETTINGS = frozenset(
    {
        "CAPTURE_PROXY_CONFIG",
        "CAPTURE_PROXY_CACHE",
        "CAPTURE_PROXY_VLLM_URL",
        "CAPTURE_PROXY_VLLM_MODEL",
        "CAPTURE_PROXY_VIEWER_DOCS",
        "CAPTURE_PROXY_PG_BIN",
        "CAPTURE_PROXY_HAPROXY",
        "CAPTURE_PROXY_CODEX_KEY",
        "CAPTURE_PROXY_BASE_IMAGE",
        "CAPTURE_PROXY_IMAGE",
        "CAPTURE_PROXY_NO_COMPILED",
    }
)


def load_settings(cli_values: dict[str, Any], config_file: Path | None = None) -> Settings:
    """Merge defaults < config file < environment < CLI values, validate, and freeze.

    ``cli_values`` holds only flags the user gave (None values are ignored).
    Raises ConfigError naming the offending field or file.
    """
    file_values: dict[str, Any] = {}
    config_file = config_file or (
        Path(os.environ["CAPTURE_PROXY_CONFIG"]) if os.environ.get("CAPTURE_PROXY_CONFIG") else None
    )
    if config_file is not None:
        try:
            file_values = tomllib.loads(config_file.read_text())
        except OSError as exc:
            raise ConfigError(f"config file {config_file}: {exc.strerror or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_file}: invalid TOML: {exc}") from exc
        unknown = sorted(set(file_values) - set(Settings.model_fields))
        if unknown:
            raise ConfigError(f"config file {config_file}: unknown setting(s) {', '.join(unknown)}")
    known_env = {f"CAPTURE_PROXY_{name.upper()}" for name in Settings.model_fields}
    # A misspelt variable (CAPTURE_PROXY_PROXY_TOKN) must not quietly leave a setting unset.
    unknown_env = sorted(
        k
        for k in os.environ
        if k.startswith("CAPTURE_PROXY_") and k not in known_env and k not in ENV_NOT_SETTINGS
    )
    if unknown_env:
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown_env)}: CAPTURE_PROXY_<NAME> "
            "must name a setting (see configs/capture-proxy.toml)"
        )
    env_names = {
        name for name in Settings.model_fields if f"CAPTURE_PROXY_{name.upper()}" in os.environ
    }
    # Environment beats the file: drop file values that the environment sets.
    merged = {k: v for k, v in file_values.items() if k not in env_names}
    merged.update({k: v for k, v in cli_values.items() if v is not None})
    try:
        return Settings(**merged)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: "
            f"{err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc
