"""Proxy settings: built once at startup, validated, frozen, passed down.

Sources, highest priority first: command-line flags, environment variables
(``CAPTURE_PROXY_<FIELD>``, e.g. ``CAPTURE_PROXY_BACKEND``), a TOML config file (``--config``
or ``CAPTURE_PROXY_CONFIG``), then the fields' defaults. Validation is pydantic's: a bad value
stops startup with a message naming the field.

Defaults that bite a proxy are set explicitly (see STYLE.md): the request body limit
(64 MiB, long agent histories), no total upstream timeout (long generations), a large
upstream connection pool, and an upstream keep-alive shorter than the engines' so the proxy
never reuses a connection the engine is about to close.
"""

from capture_proxy.config.loading import ENV_NOT_SETTINGS, ConfigError, load_settings
from capture_proxy.config.settings import Settings

__all__ = ["ENV_NOT_SETTINGS", "ConfigError", "Settings", "load_settings"]
