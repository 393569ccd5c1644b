"""The settings model, ``Settings``: the fields of ``fields.SettingsFields`` with their
validators (a value's form, the files it names, the rules across fields: tokens, backend URLs,
the read API off loopback, the families' tokenizers) and the values derived from them (engine
URLs and labels, the engine's credential, per-model modes); ``loading.load_settings`` builds
it from its sources."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from pydantic import AnyHttpUrl, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from capture_proxy.config.cgroups import usable_cpus, usable_memory_bytes
from capture_proxy.config.fields import SettingsFields
from capture_proxy.config.memory_budget import default_cache_mb, default_workers
from capture_proxy.core.redact import basic_auth_header, redact_url, split_credentials

#: How many engines the start-up line names (``Settings.backends_label``); more are counted.
NAMED_BACKENDS = 3


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ``::1``); False for every
    other name or address, including the wildcards ``0.0.0.0`` and ``::``."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(SettingsFields):
    """All proxy settings. Times in seconds, sizes in bytes."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("store", mode="before")
    @classmethod
    def _store_path_or_url(cls, value: Any) -> Any:
        """A postgresql:// URL stays a string; anything else is a directory path."""
        if isinstance(value, str):
            if value.startswith(("postgresql://", "postgres://")):
                return value
            return Path(value)
        return value

    def sizing(self) -> tuple[int, int, int | None]:
        """(workers, the MB each process's caches may hold, the memory both were sized by in
        bytes or None: unknown), from one reading of the CPUs and the memory: ``workers``, or
        the CPUs this process may use (``cgroups.usable_cpus``: its affinity mask capped by
        its cgroup's CPU quota) at most as many as its memory holds
        (``memory_budget.default_workers``); ``cache_memory_mb``, or their share of the memory
        (``memory_budget.default_cache_mb``). ``serve`` decides by it once and hands both to
        every process it runs."""
        memory = usable_memory_bytes()
        count = self.workers
        if count is None:
            count = default_workers(usable_cpus(), memory, self.loads_tokenizers)
        cache_mb = self.cache_memory_mb
        if cache_mb is None:
            cache_mb = default_cache_mb(memory, count, self.loads_tokenizers)
        return count, cache_mb, memory

    def cache_mb_for(self, processes: int) -> int:
        """``cache_memory_mb``, or the share of one of ``processes`` proxy processes (1: a
        process serving alone: ``demo``, ``replay``, ``serve`` with one worker)."""
        if self.cache_memory_mb is not None:
            return self.cache_memory_mb
        return default_cache_mb(usable_memory_bytes(), processes, self.loads_tokenizers)

    @property
    def loads_tokenizers(self) -> bool:
        """Whether each process may load a tokenizer: a local ``tokenizer`` (``exact_tokens``
        loads it at start, ``app.make_exact_tokens``; the viewer on its first page showing
        token text, in any prompt mode and in ``serve --read-only``:
        ``viewer.detokenize.LocalDetokenizer``), or ``model_families`` with ``exact_tokens``
        for some model (each family loads its own; without either the engine's ``/tokenize``
        renders). Hundreds of MB of its own (``memory_budget.BASE_MB_TOKENIZER``)."""
        return self.tokenizer is not None or (self.uses_exact_tokens and bool(self.model_families))

    @property
    def store_label(self) -> str:
        """The store for logs: a directory, or the URL without its password."""
        if isinstance(self.store, Path):
            return str(self.store)
        return redact_url(self.store)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_is_a_directory(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():
            raise ValueError(f"{value} is not a directory (a local HF tokenizer directory)")
        return value

    @model_validator(mode="after")
    def _exact_tokens_can_run(self) -> Settings:
        if (
            self.uses_exact_tokens
            and self.tokens_in_dialect == "vllm_generate"
            and self.tokenizer is None
        ):
            raise ValueError(
                "tokens_in_dialect vllm_generate answers carry no text: set tokenizer "
                "(a local HF tokenizer directory) to decode them"
            )
        return self

    @field_validator("image_processors")
    @classmethod
    def _image_processor_known(cls, value: dict[str, str]) -> dict[str, str]:
        for model, name in value.items():
            if name not in ("qwen3_vl", "qwen2_5_vl") and not Path(name).exists():
                raise ValueError(
                    f"{model}: {name!r} is neither qwen3_vl, qwen2_5_vl nor an existing "
                    "preprocessor_config.json (or model directory)"
                )
        return value

    @model_validator(mode="after")
    def _llama3_has_a_tokenizer(self) -> Settings:
        if "llama3" in self.model_families.values() and "llama3" not in self.family_tokenizers:
            models = sorted(m for m, f in self.model_families.items() if f == "llama3")
            raise ValueError(
                f"model_families names llama3 for {', '.join(models)}: set "
                "family_tokenizers.llama3 to the model's tokenizer directory (tokenizer.json "
                "and its chat template; there is no built-in Llama template)"
            )
        return self

    @model_validator(mode="after")
    def _read_api_is_guarded_off_loopback(self) -> Settings:
        if (
            self.captures_token is None
            and not self.allow_unauthenticated_read_api
            and not is_loopback(self.host)
        ):
            raise ValueError(
                f"host {self.host} is not a loopback address and captures_token is unset, so "
                "anyone who reaches the port could read and delete captures (DELETE "
                "/captures/...): set captures_token (CAPTURE_PROXY_CAPTURES_TOKEN), or, to run "
                "the read API open on purpose, allow_unauthenticated_read_api = true "
                "(--insecure-read-api)"
            )
        return self

    @field_validator("captures_token", "proxy_token", "backend_api_key")
    @classmethod
    def _token_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty token (CAPTURE_PROXY_CAPTURES_TOKEN="") is not unset: no request could
        # ever match it (every /captures read a 401), and it is not "open" either.
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("the token is empty: set one, or leave it unset")
        return value

    @field_validator("backend", "extra_backends", mode="before")
    @classmethod
    def _backend_has_a_scheme(cls, value: Any) -> Any:
        # A bare host:port (``--backend localhost:8000``) reads to pydantic as a URL of scheme
        # "localhost": "URL scheme should be 'http' or 'https'" says nothing of the fix.
        for url in value if isinstance(value, list) else [value]:
            if isinstance(url, str) and "//" not in url and url.strip() == url and url:
                raise ValueError(f"{url!r} has no scheme: write http://{url} (or https://)")
        return value

    @field_validator("backend")
    @classmethod
    def _no_path_query(cls, value: AnyHttpUrl) -> AnyHttpUrl:
        if value.query or value.fragment:
            raise ValueError("backend URL must not carry a query or fragment")
        return value

    @field_validator("extra_backends")
    @classmethod
    def _extra_backends_plain(cls, value: list[AnyHttpUrl]) -> list[AnyHttpUrl]:
        for url in value:
            if url.query or url.fragment or url.username or url.password:
                raise ValueError("extra backend URLs must not carry a query, fragment or user info")
        return value

    @model_validator(mode="after")
    def _backends_distinct(self) -> Settings:
        # Checked here, not first by the engine pool at start-up (a traceback, and with
        # several workers "worker N exited during start-up"): one line, exit 2.
        bases = self.backend_bases
        repeated = sorted({url for url in bases if bases.count(url) > 1})
        if repeated:
            raise ValueError(
                f"backend URLs repeat: {', '.join(repeated)} given more than once (backend "
                "and extra_backends, serve --backend repeated; a trailing / is the same URL): "
                "give each engine once"
            )
        return self

    @model_validator(mode="after")
    def _one_engine_credential(self) -> Settings:
        if self.backend_api_key is not None and split_credentials(str(self.backend))[1:] != (
            None,
            None,
        ):
            raise ValueError(
                "backend URL carries user info and backend_api_key is set: give the engine's "
                "credential one way"
            )
        return self

    def prompt_mode_for(self, model: str | None) -> str:
        """The prompt mode for a request's ``model``."""
        return self.prompt_mode_by_model.get(model or "", self.prompt_mode)

    def routed_experts_for(self, model: str | None) -> str:
        """The routed-experts expectation for a request's ``model``."""
        return self.routed_experts_by_model.get(model or "", self.routed_experts)

    @property
    def uses_exact_tokens(self) -> bool:
        return (
            self.prompt_mode == "exact_tokens"
            or "exact_tokens" in self.prompt_mode_by_model.values()
        )

    @property
    def backend_base(self) -> str:
        """Backend URL without a trailing slash and without user info, e.g.
        ``http://127.0.0.1:8000``: the URL every engine request and message is built from, so
        no credential of ``http://user:password@host`` can reach an answer, a record or a log
        (they go to the engine as ``backend_auth_header``)."""
        return split_credentials(str(self.backend))[0].rstrip("/")

    @property
    def backend_bases(self) -> list[str]:
        """Every engine's base URL (``backend_base`` first, then ``extra_backends``)."""
        extra = [str(url).rstrip("/") for url in self.extra_backends]
        return [self.backend_base, *extra]

    @property
    def backend_label(self) -> str:
        """The backend URL for people (start-up line): its password masked."""
        return redact_url(str(self.backend)).rstrip("/")

    @property
    def backends_label(self) -> str:
        """Every engine for people (start-up line): ``backend_label`` and the others, joined
        by `` + ``; past ``NAMED_BACKENDS`` engines, the first and how many more."""
        labels = [self.backend_label, *(str(u).rstrip("/") for u in self.extra_backends)]
        if len(labels) <= NAMED_BACKENDS:
            return " + ".join(labels)
        return f"{labels[0]} + {len(labels) - 1} more engines"

    @property
    def backend_auth_header(self) -> str | None:
        """The ``Authorization`` value every request to the engine carries: ``Bearer
        <backend_api_key>``, or ``Basic`` of the backend URL's user info; None: the harness's
        own header goes through."""
        if self.backend_api_key is not None:
            return f"Bearer {self.backend_api_key.get_secret_value()}"
        _, user, password = split_credentials(str(self.backend))
        if user is None and password is None:
            return None
        return basic_auth_header(user or "", password)

    @property
    def server_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for aiohttp's server (``AppRunner``): ``keepalive_timeout`` is
        how long a connection may wait for a complete request head, the first one included
        (aiohttp arms it when the connection opens); ``shutdown_timeout`` how long a stop
        waits for the calls in flight (``proxy.stopping``)."""
        return {
            "keepalive_timeout": self.client_header_timeout_s,
            "shutdown_timeout": self.shutdown_timeout_s,
        }

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # init (CLI flags and the file's values merged by load_settings) > env.
        return (init_settings, env_settings)
