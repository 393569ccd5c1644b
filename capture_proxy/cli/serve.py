"""``capture-proxy serve``: its options, and starting the proxy (or the read-only app).

Owns turning the flags into settings (``config.load_settings``: flags over the TOML file over
the environment), binding the socket, opening the store and handing both to
``proxy.server.run``. Errors in settings, the socket or the store exit with status 2 and a
message naming what failed. Must not: build the app itself (``app`` does) or serve a request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from capture_proxy.cli.errors import ServeExit
from capture_proxy.config import ConfigError, Settings, load_settings
from capture_proxy.config.memory_budget import FULL_CACHE_MB, MIB
from capture_proxy.core import chunk_scan

log = logging.getLogger("capture_proxy")

#: The backend of ``serve --read-only`` without ``--backend``: never contacted.
READ_ONLY_BACKEND = "http://no-backend.invalid"

#: Settings fields set by a flag of the same meaning: field name -> ``args`` attribute. Every
#: ``serve`` flag is here or in SERVE_FLAGS_NOT_SETTINGS (tests/test_cli.py checks both ways), so
#: a flag cannot be parsed and then dropped.
SETTING_FLAGS = {
    "backend": "backend",
    "routing_key": "routing_key",
    "routing_key_header": "routing_key_header",
    "host": "host",
    "port": "port",
    "store": "store",
    "store_synchronous": "store_synchronous",
    "store_failure": "store_failure",
    "store_pool_size": "store_pool_size",
    "workers": "workers",
    "max_request_body_bytes": "max_request_body_bytes",
    "log_level": "log_level",
    "parent_resolution": "parent_resolution",
    "late_calls": "late_calls",
    "uncaptured_generation": "uncaptured_generation",
    "prompt_mode": "prompt_mode",
    "tokenizer": "tokenizer",
    "tokens_in_dialect": "tokens_in_dialect",
    "max_model_len": "max_model_len",
    "exact_prompt_full_render": "exact_prompt_full_render",
    "allow_unauthenticated_read_api": "insecure_read_api",
    "record_dir": "record_dir",
    "captures_token": "captures_token",
    "proxy_token": "proxy_token",
    "allowed_hosts": "allowed_hosts",
    "client_header_timeout_s": "client_header_timeout_s",
    "client_body_timeout_s": "client_body_timeout_s",
    "read_api_timeout_s": "read_api_timeout_s",
    "read_send_timeout_s": "read_send_timeout_s",
    "weight_version_poll_s": "weight_version_poll_s",
    "engine_pause_wait_s": "engine_pause_wait_s",
}

#: ``serve``'s ``args`` attributes that are no setting: how to start, not how to proxy.
SERVE_FLAGS_NOT_SETTINGS = frozenset({"port_file", "read_only", "config"})


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """uvloop (libuv) for ``uvloop``, and for ``auto`` when installed; else asyncio's loop.
    Measured with benchmarks/load.py: about 10% less proxy CPU per streamed call."""
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one), not yet listening: aiohttp
    starts listening on it once the app has started (store open). Raises OSError (address in
    use, unknown host, no permission)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def write_port_file(path: Path, port: int) -> None:
    """Write ``port`` and a newline to ``path`` atomically (a reader never sees half a
    number)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def _is_store_to_read(store: str | None) -> bool:
    """Whether ``--read-only`` has a store to read: an existing directory or a PostgreSQL URL."""
    if store is None:
        return False
    return store.startswith(("postgresql://", "postgres://")) or Path(store).is_dir()


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings of ``args`` (flags over ``--config`` over the environment). Raises
    ServeExit (``--read-only`` without a store, a setting that does not validate)."""
    cli_values: dict[str, Any] = {
        field: getattr(args, attribute) for field, attribute in SETTING_FLAGS.items()
    }
    backends = args.backend or []
    cli_values["backend"] = backends[0] if backends else None
    if len(backends) > 1:
        cli_values["extra_backends"] = backends[1:]
    if args.read_only:
        if not _is_store_to_read(args.store):
            raise ServeExit(
                "--read-only needs --store DIR (an existing store) or a postgresql:// URL"
            )
        # No engine: the backend setting is required by the settings model but never used
        # (a --backend given is only asked to /detokenize for the viewer).
        cli_values["backend"] = cli_values["backend"] or READ_ONLY_BACKEND
    try:
        return load_settings(cli_values, args.config)
    except ConfigError as exc:
        raise ServeExit(str(exc)) from exc


def _configure_logging(settings: Settings) -> None:
    from capture_proxy.core.redact import RedactingFilter

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The format names no caller, thread or process: skip collecting them for every record
    # (the logging HOWTO's "Optimization"; a quarter of the cost of each call's access line).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())


def _warn_of_a_v1_backend(settings: Settings) -> None:
    """A WARNING for each backend URL whose path ends in ``/v1`` (the OpenAI SDK's base URL
    habit): the proxy adds ``/v1/...`` itself, so its calls would go to ``/v1/v1/...`` and
    get the engine's bare 404. Not refused: an engine may really serve under such a prefix."""
    for url in settings.backend_bases:
        if urlsplit(url).path.rstrip("/").endswith("/v1"):
            log.warning(
                "backend %s ends in /v1: the backend is the engine's base URL (e.g. %s) and "
                "the proxy adds /v1/... itself, so /v1 is likely doubled (%s/v1/chat/"
                "completions: the engine's 404); drop /v1 unless the engine serves under it",
                url,
                url.rstrip("/").removesuffix("/v1"),
                url,
            )


def _say_memory(settings: Settings, count: int, cache_mb: int, memory: int | None) -> None:
    """An INFO line when the memory this process may use (a container's limit, a small
    machine) made the caches smaller than their default: the worker count and caches it gave
    (``Settings.sizing``)."""
    if settings.cache_memory_mb is not None or cache_mb >= FULL_CACHE_MB:
        return
    log.info(
        "memory this process may use: %s MB (the machine's, capped by its cgroup's limit): "
        "%d worker(s), caches at most %d MB each (settings workers, cache_memory_mb)",
        f"{memory // MIB:,}" if memory is not None else "unknown",
        count,
        cache_mb,
    )


def _clear_port_file(port_file: Path | None) -> None:
    """Remove a stale port file (an earlier run's number must not be read as this run's).
    Raises ServeExit when its directory does not exist."""
    if port_file is None:
        return
    if not port_file.parent.is_dir():
        raise ServeExit(f"--port-file {port_file}: no directory {port_file.parent}")
    port_file.unlink(missing_ok=True)


def _bind(settings: Settings) -> socket.socket:
    try:
        return bind_socket(settings.host, settings.port)
    except OSError as exc:  # address in use, unknown host, no permission
        raise ServeExit(
            f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}"
        ) from exc


def _open_store(settings: Settings, *, read_only: bool) -> Any:
    from capture_proxy.store import open_store
    from capture_proxy.store.base import StoreError

    try:
        return open_store(
            settings.store,
            synchronous=settings.store_synchronous,
            pool_size=settings.store_pool_size,
            read_only=read_only,
        )
    except StoreError as exc:
        raise ServeExit(str(exc)) from exc


def _listening_banner(
    settings: Settings, port: int, target: str, port_file: Path | None, workers: int = 1
) -> Callable[[], None]:
    relays = target != "read-only"
    def listening() -> None:
        # Called once the store is open and the socket listens. What start-up built (modules,
        # settings, templates, tokenizers) lives as long as the process: out of the cyclic
        # collector's way, so its full collections walk only what calls made since.
        gc.freeze()
        if port_file is not None:
            write_port_file(port_file, port)
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        print(
            f"capture-proxy: serving on http://{host}:{port} -> "
            f"{target}, store {settings.store_label}"
            f"{f', {workers} workers' if workers > 1 else ''}; viewer at "
            f"http://{host}:{port}/captures/ui/",
            flush=True,
        )
        if relays and chunk_scan.SCAN is None:
            print(
                "capture-proxy: streamed chunks take the Python path (the compiled chunk "
                "scan is not built, or built from another source: run scripts/setup; or "
                "CAPTURE_PROXY_NO_COMPILED is set): the same data, more CPU per token",
                flush=True,
            )

    return listening


def _run_app(args: argparse.Namespace, settings: Settings, sock: socket.socket) -> None:
    """Build the app over the opened store and serve it on ``sock`` until stopped. Raises
    ServeExit (the store cannot open, start or render)."""
    from capture_proxy.app import build_proxy_app, build_read_only_app
    from capture_proxy.families.base import RenderError
    from capture_proxy.proxy import server
    from capture_proxy.store.base import StoreError

    store = _open_store(settings, read_only=args.read_only)
    if args.read_only:
        app = build_read_only_app(settings, store, backend=(args.backend or [None])[0])
        target = "read-only"
    else:
        app = build_proxy_app(settings, store)
        target = settings.backends_label
    port = sock.getsockname()[1]
    try:
        server.run(
            app,
            sock,
            backlog=settings.listen_backlog,
            on_listening=_listening_banner(settings, port, target, args.port_file),
            server_kwargs=settings.server_kwargs,
            loop=new_event_loop(settings.event_loop),
        )
    except (StoreError, RenderError) as exc:
        raise ServeExit(str(exc)) from exc


def _run_workers(
    args: argparse.Namespace, settings: Settings, sock: socket.socket, count: int
) -> int:
    """Serve with ``count`` worker processes (``cli.workers``): the exit status. ``settings``
    carry the count and the caches' share ``run`` decided (``workers``, ``cache_memory_mb``):
    a worker pinned to one CPU would count otherwise. Raises ServeExit (the store cannot
    open, a worker fails to start)."""
    from capture_proxy.cli.workers import WorkerPlan, run_workers

    plan = WorkerPlan(
        settings=settings,
        count=count,
        read_only=args.read_only,
        viewer_backend=(args.backend or [None])[0] if args.read_only else None,
        supervisor_pid=os.getpid(),
    )
    target = "read-only" if args.read_only else settings.backends_label
    port = sock.getsockname()[1]
    banner = _listening_banner(settings, port, target, args.port_file, plan.count)
    return run_workers(plan, sock, new_event_loop(settings.event_loop), banner)


def run(args: argparse.Namespace) -> int:
    """Serve until stopped: 0, or 2 with a message on stderr when start-up fails."""
    try:
        settings = settings_from_args(args)
        _configure_logging(settings)
        _warn_of_a_v1_backend(settings)
        # Read once (the CPUs, the memory): what is said, chosen by and run is one count and
        # one cache budget, a process serving alone's as the workers'.
        count, cache_mb, memory = settings.sizing()
        _say_memory(settings, count, cache_mb, memory)
        settings = settings.model_copy(update={"workers": count, "cache_memory_mb": cache_mb})
        _clear_port_file(args.port_file)
        sock = _bind(settings)
        try:
            if count > 1:
                return _run_workers(args, settings, sock, count)
            _run_app(args, settings, sock)
        finally:
            sock.close()
    except ServeExit as exc:
        print(f"capture-proxy: {exc}", file=sys.stderr)
        return 2
    return 0
