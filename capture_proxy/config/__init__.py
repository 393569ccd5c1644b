"""Proxy settings: built once at startup, validated, frozen, passed down.

Sources, highest priority first: command-line flags, environment variables
(``CAPTURE_PROXY_<FIELD>``, e.g. ``CAPTURE_PROXY_BACKEND``), a TOML config file (``--config``
or ``CAPTURE_PROXY_CONFIG``), then the fields' defaults. Validation is pydantic's: a bad value
stops startup with a message naming the field.

``fields.py`` declares every setting (type, bounds, default, description; the configuration
reference is generated from it), ``settings.py`` makes them ``Settings`` (their validators,
the values derived from them), ``loading.py`` merges the sources (``load_settings``),
``cgroups.py`` reads the CPUs and memory this process may use, and ``memory_budget.py`` turns
the memory into ``workers``' and ``cache_memory_mb``'s defaults.
"""

from capture_proxy.config.loading import ENV_NOT_SETTINGS, ConfigError, load_settings
from capture_proxy.config.settings import Settings

__all__ = ["ENV_NOT_SETTINGS", "ConfigError", "Settings", "load_settings"]
