"""Command line: ``capture-proxy serve | show | scripted-engine | demo | replay | audit``.

Owns argument parsing and process start-up only; every command builds its settings once,
validates them, and hands them down. Errors in settings exit with status 2 and a message
naming the field.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from pathlib import Path

from capture_proxy.config import ConfigError, load_settings

#: The backend of ``serve --read-only`` without ``--backend``: never contacted.
READ_ONLY_BACKEND = "http://no-backend.invalid"


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


def _serve(args: argparse.Namespace) -> int:
    from capture_proxy.app import build_proxy_app, build_read_only_app
    from capture_proxy.families.base import RenderError
    from capture_proxy.proxy import server
    from capture_proxy.store import open_store
    from capture_proxy.store.base import StoreError

    cli_values = {
        "backend": args.backend,
        "host": args.host,
        "port": args.port,
        "store": args.store,
        "store_synchronous": args.store_synchronous,
        "store_pool_size": args.store_pool_size,
        "max_request_body_bytes": args.max_request_body_bytes,
        "log_level": args.log_level,
        "parent_resolution": args.parent_resolution,
        "late_calls": args.late_calls,
        "prompt_mode": args.prompt_mode,
        "tokenizer": args.tokenizer,
        "tokens_in_dialect": args.tokens_in_dialect,
        "max_model_len": args.max_model_len,
        "exact_prompt_full_render": args.exact_prompt_full_render,
        "allow_unauthenticated_read_api": args.insecure_read_api,
        "record_dir": args.record_dir,
        "captures_token": args.captures_token,
        "proxy_token": args.proxy_token,
        "allowed_hosts": args.allowed_hosts,
        "client_header_timeout_s": args.client_header_timeout_s,
        "client_body_timeout_s": args.client_body_timeout_s,
    }
    if args.read_only:
        if args.store is None or (
            not args.store.startswith(("postgresql://", "postgres://"))
            and not Path(args.store).is_dir()
        ):
            print(
                "capture-proxy: --read-only needs --store DIR (an existing store) or a "
                "postgresql:// URL",
                file=sys.stderr,
            )
            return 2
        # No engine: the backend setting is required by the settings model but never used
        # (a --backend given is only asked to /detokenize for the viewer).
        cli_values["backend"] = args.backend or READ_ONLY_BACKEND
    try:
        settings = load_settings(cli_values, args.config)
    except ConfigError as exc:
        print(f"capture-proxy: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from capture_proxy.core.redact import RedactingFilter

    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    port_file: Path | None = args.port_file
    if port_file is not None:
        if not port_file.parent.is_dir():
            print(
                f"capture-proxy: --port-file {port_file}: no directory {port_file.parent}",
                file=sys.stderr,
            )
            return 2
        # A stale number from an earlier run must not be read as this run's port.
        port_file.unlink(missing_ok=True)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:  # address in use, unknown host, no permission
        print(
            f"capture-proxy: cannot listen on {settings.host}:{settings.port}: "
            f"{exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    port = sock.getsockname()[1]
    try:
        store = open_store(
            settings.store,
            synchronous=settings.store_synchronous,
            pool_size=settings.store_pool_size,
            read_only=args.read_only,
        )
    except StoreError as exc:
        sock.close()
        print(f"capture-proxy: {exc}", file=sys.stderr)
        return 2
    if args.read_only:
        app = build_read_only_app(settings, store, backend=args.backend)
        target = "read-only"
    else:
        app = build_proxy_app(settings, store)
        target = settings.backend_label

    def listening() -> None:
        # Called once the store is open and the socket listens.
        if port_file is not None:
            write_port_file(port_file, port)
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        print(
            f"capture-proxy: serving on http://{host}:{port} -> "
            f"{target}, store {settings.store_label}; viewer at "
            f"http://{host}:{port}/captures/ui/",
            flush=True,
        )

    try:
        server.run(
            app,
            sock,
            backlog=settings.listen_backlog,
            on_listening=listening,
            server_kwargs=settings.server_kwargs,
            loop=new_event_loop(settings.event_loop),
        )
    except (StoreError, RenderError) as exc:
        print(f"capture-proxy: {exc}", file=sys.stderr)
        return 2
    finally:
        sock.close()
    return 0


def _show(args: argparse.Namespace) -> int:
    from capture_proxy.show import make_console, show

    if not args.store.is_dir():
        print(f"capture-proxy: no store at {args.store}", file=sys.stderr)
        return 2
    return asyncio.run(show(args.store, args.rollout, make_console()))


def _scripted_engine(args: argparse.Namespace) -> int:
    from capture_proxy.scripted_engine.app import run_scripted_engine_cli

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_scripted_engine_cli(
        host=args.host,
        port=args.port,
        policy_path=args.policy,
        template=args.template,
        max_model_len=args.max_model_len,
        family=args.family,
        chat_template_path=args.chat_template,
        tokenizer_dir=args.tokenizer_dir,
    )


def _demo(args: argparse.Namespace) -> int:
    from capture_proxy.demo import run_demo

    return asyncio.run(
        run_demo(store_dir=args.store, use_opencode=args.opencode, policy_path=args.policy)
    )


def _replay(args: argparse.Namespace) -> int:
    from capture_proxy.demo import run_replay

    return asyncio.run(
        run_replay(
            args.recording,
            proxy_url=args.proxy,
            rollout_id=args.rollout,
            template=args.template,
            parent_resolution=args.parent_resolution,
            store_dir=args.store,
        )
    )


def _export_tokenizer(args: argparse.Namespace) -> int:
    from capture_proxy.families.qwen_vocab import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer(template=args.template)
    which = args.template
    if args.chat_template is not None:
        tokenizer.chat_template = args.chat_template.read_text(encoding="utf-8")
        which = str(args.chat_template)
    tokenizer.save_pretrained(str(args.directory))
    print(f"wrote the scripted engine's Qwen tokenizer ({which}) to {args.directory}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="capture-proxy",
        description="Token-capture reverse proxy for agentic RL rollouts.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy in front of an engine")
    serve.add_argument("--backend", help="engine base URL, e.g. http://127.0.0.1:8000")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 8080; 0: a free port)")
    serve.add_argument(
        "--port-file",
        dest="port_file",
        type=Path,
        help="write the bound port to this file once the proxy listens (for --port 0)",
    )
    serve.add_argument(
        "--store",
        help="embedded store directory (default ./capture-store), or a postgresql:// URL "
        "(the shared store for replicas)",
    )
    serve.add_argument(
        "--store-synchronous",
        dest="store_synchronous",
        choices=["full", "normal"],
        help="full (default): fsync each call before its answer ends; normal: survives a "
        "proxy crash, not a power loss (see docs/configuration.md)",
    )
    serve.add_argument(
        "--store-pool-size",
        type=int,
        dest="store_pool_size",
        help="PostgreSQL store: pooled connections per process (default 8)",
    )
    serve.add_argument("--max-request-body-bytes", type=int, dest="max_request_body_bytes")
    serve.add_argument("--log-level", dest="log_level")
    serve.add_argument(
        "--parent-resolution",
        dest="parent_resolution",
        choices=["captured_tokens", "source_history"],
        help="how a call after a rewritten harness note is linked (default captured_tokens)",
    )
    serve.add_argument(
        "--late-calls",
        dest="late_calls",
        choices=["record", "refuse"],
        help="a call to a frozen rollout: record it as late (default) or refuse it with a 409",
    )
    serve.add_argument(
        "--prompt-mode",
        dest="prompt_mode",
        choices=["backend_template", "exact_tokens"],
        help="who renders the prompt (default backend_template: the engine)",
    )
    serve.add_argument(
        "--tokenizer", type=Path, help="local HF tokenizer dir for exact_tokens rendering"
    )
    serve.add_argument(
        "--tokens-in",
        dest="tokens_in_dialect",
        choices=["vllm_completions", "vllm_generate", "sglang_generate"],
        help="engine endpoint taking token ids in exact_tokens mode",
    )
    serve.add_argument("--max-model-len", dest="max_model_len", type=int)
    serve.add_argument(
        "--exact-full-render",
        dest="exact_prompt_full_render",
        action="store_const",
        const=True,
        help="exact_tokens: render every call's whole conversation (for comparison only)",
    )
    serve.add_argument(
        "--record-dir",
        dest="record_dir",
        type=Path,
        help="record capture-path traffic to DIR/<rollout_id>.jsonl (the replay format)",
    )
    serve.add_argument(
        "--read-only",
        dest="read_only",
        action="store_true",
        help="serve only the read API and the viewer over --store (no engine needed)",
    )
    serve.add_argument(
        "--captures-token",
        dest="captures_token",
        help="token for /captures and the viewer (better: CAPTURE_PROXY_CAPTURES_TOKEN)",
    )
    serve.add_argument(
        "--proxy-token",
        dest="proxy_token",
        help="token harnesses must send (Authorization: Bearer, or x-api-key) on proxied "
        "paths; stripped before forwarding (better: CAPTURE_PROXY_PROXY_TOKEN)",
    )
    serve.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        metavar="NAME",
        help="a Host name the proxy answers besides loopback names, --host and IP addresses "
        "(repeat for more; '*': any); other names get a 421 (DNS-rebinding guard)",
    )
    serve.add_argument(
        "--client-header-timeout",
        dest="client_header_timeout_s",
        type=float,
        metavar="SECONDS",
        help="close a connection without a complete request head after this long (default 60)",
    )
    serve.add_argument(
        "--client-body-timeout",
        dest="client_body_timeout_s",
        type=float,
        metavar="SECONDS",
        help="answer 408 to a request body not received within this long (default 60)",
    )
    serve.add_argument(
        "--insecure-read-api",
        dest="insecure_read_api",
        action="store_const",
        const=True,
        help="allow a non-loopback host without captures_token: anyone who reaches the port "
        "can read and delete captures (setting allow_unauthenticated_read_api)",
    )
    serve.add_argument("--config", type=Path, help="TOML file with the same settings")
    serve.set_defaults(func=_serve)

    show = sub.add_parser(
        "show", help="print a store's rollouts, or one rollout's chains, in the terminal"
    )
    show.add_argument("--store", type=Path, default=Path("capture-store"))
    show.add_argument("rollout", nargs="?", help="rollout id (default: list the rollouts)")
    show.set_defaults(func=_show)

    engine = sub.add_parser(
        "scripted-engine", help="run the scripted vLLM-dialect engine (tests, demos, harness CI)"
    )
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=8000)
    engine.add_argument("--policy", type=Path, help="policy JSON file (default: built-in)")
    engine.add_argument(
        "--template", default="keep_reasoning", choices=["keep_reasoning", "drop_reasoning"]
    )
    engine.add_argument("--max-model-len", type=int, default=32768)
    engine.add_argument(
        "--family",
        default="qwen3",
        choices=["qwen3", "qwen3_coder", "gpt_oss", "llama3", "qwen2_5"],
        help="model family it renders and writes as (the proxy's model_families)",
    )
    engine.add_argument(
        "--chat-template",
        type=Path,
        help="a jinja chat template file to render with (e.g. a model's published one) "
        "instead of --template",
    )
    engine.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=None,
        help="the family's tokenizer directory (tokenizer.json and chat template; required "
        "for llama3; a Qwen family's replaces the built-in tokenizer and template)",
    )
    engine.set_defaults(func=_scripted_engine)

    demo = sub.add_parser(
        "demo", help="run engine + proxy locally, drive a session, print the captured chain"
    )
    demo.add_argument(
        "--store",
        type=Path,
        default=None,
        help="store directory (default ./capture-store, serve's default, so that `capture-proxy "
        "serve` reads the demo's rollout afterwards)",
    )
    demo.add_argument(
        "--opencode",
        choices=["auto", "yes", "no"],
        default="auto",
        help="drive the session with the OpenCode CLI when installed (auto), always, or never",
    )
    demo.add_argument("--policy", type=Path, help="policy JSON for the scripted engine")
    demo.set_defaults(func=_demo)

    rep = sub.add_parser(
        "replay",
        help="replay a recorded harness session through the proxy and print the chains",
    )
    rep.add_argument(
        "recording", type=Path, help="JSONL recording (the format of tests/fixtures/opencode/logs)"
    )
    rep.add_argument(
        "--proxy",
        help="send to this running proxy (e.g. http://127.0.0.1:8080) instead of an in-process "
        "proxy + scripted engine that answers what the recording answered",
    )
    rep.add_argument("--rollout", default=None, help="rollout id (default: replay-<unix time>)")
    rep.add_argument(
        "--template", default="keep_reasoning", choices=["keep_reasoning", "drop_reasoning"]
    )
    rep.add_argument(
        "--parent-resolution",
        default="captured_tokens",
        choices=["captured_tokens", "source_history"],
    )
    rep.add_argument("--store", type=Path, default=None, help="store directory (default: temp)")
    rep.set_defaults(func=_replay)

    exp = sub.add_parser(
        "export-tokenizer",
        help="write the scripted engine's tokenizer + chat template as an HF directory "
        "(for serve --tokenizer in exact_tokens mode)",
    )
    exp.add_argument("directory", type=Path)
    exp.add_argument(
        "--template", default="keep_reasoning", choices=["keep_reasoning", "drop_reasoning"]
    )
    exp.add_argument(
        "--chat-template", type=Path, help="a jinja chat template file to write instead"
    )
    exp.set_defaults(func=_export_tokenizer)

    # Its arguments only: the audit's torch side is imported when the command runs.
    from capture_proxy.audit.command import add_parser as add_audit_parser

    add_audit_parser(sub)
    return parser


#: Commands that need the tokenizer stack (the ``scripted`` extra); ``serve`` does not.
SCRIPTED_COMMANDS = frozenset({"scripted-engine", "demo", "replay", "export-tokenizer"})


def main(argv: list[str] | None = None) -> int:
    # transformers announces at import that PyTorch is absent; we only use its tokenizers.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ModuleNotFoundError as exc:
        if args.command not in SCRIPTED_COMMANDS or exc.name not in _SCRIPTED_MODULES:
            raise
        print(
            f"capture-proxy {args.command}: needs {exc.name}, which this installation lacks: "
            "pip install 'capture-proxy[scripted]' (serve does not need it)",
            file=sys.stderr,
        )
        return 2


_SCRIPTED_MODULES = frozenset(
    {"transformers", "tokenizers", "jinja2", "tiktoken", "qwen_tokenizer"}
)


if __name__ == "__main__":
    sys.exit(main())
