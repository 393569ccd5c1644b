"""The command line's arguments: one parser function per subcommand, and ``build_parser``.

Owns the flags, their help and defaults, and which function runs each subcommand. Each
command's module (``serve``, ``show``, ``demo``, ``replay``, ``engine``, ``export_tokenizer``,
``audit.command``) is imported only when that command runs, so ``serve`` never imports the
tokenizer stack the ``scripted`` commands need. Must not: validate settings or start anything.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

#: ``--template`` of the commands that render with the scripted engine's tokenizer.
_TEMPLATE_HELP = (
    "the built-in ChatML template: keep_reasoning keeps every assistant turn's reasoning in "
    "the prompt, drop_reasoning drops it, as Qwen3's does (default keep_reasoning)"
)


def _run_serve(args: argparse.Namespace) -> int:
    from capture_proxy.cli.serve import run

    return run(args)


def _run_show(args: argparse.Namespace) -> int:
    from capture_proxy.cli.show import run

    return run(args)


def _run_scripted_engine(args: argparse.Namespace) -> int:
    from capture_proxy.cli.engine import run

    return run(args)


def _run_demo(args: argparse.Namespace) -> int:
    from capture_proxy.cli.demo import run

    return run(args)


def _run_replay(args: argparse.Namespace) -> int:
    from capture_proxy.cli.replay import run

    return run(args)


def _run_export_tokenizer(args: argparse.Namespace) -> int:
    from capture_proxy.cli.export_tokenizer import run

    return run(args)


def _add_serve_listen_and_store(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--backend",
        action="append",
        help="engine base URL, e.g. http://127.0.0.1:8000 (no /v1: the proxy adds it); "
        "repeat for several engines "
        "(rollout-affine with bounded load, health-checked)",
    )
    serve.add_argument(
        "--routing-key",
        dest="routing_key",
        choices=["rollout", "episode", "none"],
        help="routing key sent to the engine or its router (default rollout: the rollout id)",
    )
    serve.add_argument(
        "--routing-key-header",
        dest="routing_key_header",
        help="header of the routing key (default x-smg-routing-key; X-Session-ID for vLLM "
        "production stack's session router)",
    )
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
        "--store-failure",
        dest="store_failure",
        choices=["refuse", "answer"],
        help="a call whose record cannot be stored: refuse (default): a retryable error "
        "instead of its answer; answer: answered anyway, the loss counted and marked",
    )
    serve.add_argument(
        "--store-pool-size",
        type=int,
        dest="store_pool_size",
        help="PostgreSQL store: pooled connections per process (default 8)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        dest="workers",
        help="worker processes serving the port (default: one per CPU this process may use, "
        "a container's CPU limit counted; 1: one process)",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        dest="max_request_body_bytes",
        help="largest request body accepted, 413 above it (default 67108864: 64 MiB)",
    )
    serve.add_argument(
        "--log-level",
        dest="log_level",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL, any case (default INFO)",
    )


def _add_serve_capture(serve: argparse.ArgumentParser) -> None:
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
        "--uncaptured-generation",
        dest="uncaptured_generation",
        choices=["forward", "refuse"],
        help="a generation call outside a capture path: forward it uncaptured with a warning "
        "(default) or refuse it with a 400 naming the capture path",
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
        help="engine endpoint taking token ids in exact_tokens mode (default vllm_completions)",
    )
    serve.add_argument(
        "--max-model-len",
        dest="max_model_len",
        type=int,
        help="the model's context length in tokens (default: the engine's /v1/models)",
    )
    serve.add_argument(
        "--weight-version-poll",
        dest="weight_version_poll_s",
        type=float,
        metavar="SECONDS",
        help="read each engine's GET /weight_info this often, off the calls' path (default 1)",
    )
    serve.add_argument(
        "--engine-pause-wait",
        dest="engine_pause_wait_s",
        type=float,
        metavar="SECONDS",
        help="after an engine abort (a weight update), wait this long for it to serve again "
        "before the call ends with a retryable error (default 900)",
    )
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


def _add_serve_access(serve: argparse.ArgumentParser) -> None:
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
        "--read-api-timeout",
        dest="read_api_timeout_s",
        type=float,
        metavar="SECONDS",
        help="answer 503 (read_timeout) to a read API read not answering within this long "
        "(default 30)",
    )
    serve.add_argument(
        "--read-send-timeout",
        dest="read_send_timeout_s",
        type=float,
        metavar="SECONDS",
        help="cut a started read API answer whose client takes none of its bytes for this "
        "long (default 60; each wait, not the whole answer)",
    )
    serve.add_argument(
        "--insecure-read-api",
        dest="insecure_read_api",
        action="store_const",
        const=True,
        help="allow a non-loopback host without captures_token: anyone who reaches the port "
        "can read and delete captures (setting allow_unauthenticated_read_api)",
    )


def _add_serve(sub: Any) -> None:
    """Add ``serve`` to ``sub`` (an ``argparse`` subparsers action)."""
    serve = sub.add_parser("serve", help="run the proxy in front of an engine")
    _add_serve_listen_and_store(serve)
    _add_serve_capture(serve)
    _add_serve_access(serve)
    serve.add_argument("--config", type=Path, help="TOML file with the same settings")
    serve.set_defaults(func=_run_serve)


def _add_show(sub: Any) -> None:
    """Add ``show`` to ``sub`` (an ``argparse`` subparsers action)."""
    show_parser = sub.add_parser(
        "show", help="print a store's rollouts, or one rollout's chains, in the terminal"
    )
    show_parser.add_argument(
        "--store",
        type=Path,
        default=Path("capture-store"),
        help="store directory (default ./capture-store, serve's default)",
    )
    show_parser.add_argument("rollout", nargs="?", help="rollout id (default: list the rollouts)")
    show_parser.set_defaults(func=_run_show)


def _add_scripted_engine(sub: Any) -> None:
    """Add ``scripted-engine`` to ``sub`` (an ``argparse`` subparsers action)."""
    engine = sub.add_parser(
        "scripted-engine", help="run the scripted vLLM-dialect engine (tests, demos, harness CI)"
    )
    engine.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    engine.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    engine.add_argument("--policy", type=Path, help="policy JSON file (default: built-in)")
    engine.add_argument(
        "--template",
        default="keep_reasoning",
        choices=["keep_reasoning", "drop_reasoning"],
        help=_TEMPLATE_HELP,
    )
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=32768,
        help="context length in tokens: a prompt as long is refused (default 32768)",
    )
    engine.add_argument(
        "--family",
        default="qwen3",
        choices=["qwen3", "qwen3_coder", "gpt_oss", "llama3", "qwen2_5"],
        help="model family it renders and writes as (the proxy's model_families; default qwen3)",
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
    engine.add_argument(
        "--enable-scale-out",
        dest="enable_scale_out",
        action="store_true",
        help="serve vLLM's tokens-in /inference/v1/generate (vLLM's --enable-scale-out; "
        "else 404, like vLLM)",
    )
    engine.add_argument(
        "--dev-mode",
        dest="dev_mode",
        action="store_true",
        help="serve vLLM's weight-update endpoints (/pause, /resume, /is_paused, /weight_info, "
        "/update_weight_version, /finish_weight_update: vLLM's VLLM_SERVER_DEV_MODE=1)",
    )
    engine.set_defaults(func=_run_scripted_engine)


def _add_demo(sub: Any) -> None:
    """Add ``demo`` to ``sub`` (an ``argparse`` subparsers action)."""
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
        help="drive the session with the OpenCode CLI when installed (auto, the default), "
        "always (yes), or never (no)",
    )
    demo.add_argument("--policy", type=Path, help="policy JSON for the scripted engine")
    demo.set_defaults(func=_run_demo)


def _add_replay(sub: Any) -> None:
    """Add ``replay`` to ``sub`` (an ``argparse`` subparsers action)."""
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
        "proxy + scripted engine that answers what the recording answered; in front of a live "
        "engine the recorded chains are not reproduced (the engine answers anew, the recorded "
        "histories carry the recorded answers)",
    )
    rep.add_argument("--rollout", default=None, help="rollout id (default: replay-<unix time>)")
    rep.add_argument(
        "--template",
        default="keep_reasoning",
        choices=["keep_reasoning", "drop_reasoning"],
        help=_TEMPLATE_HELP,
    )
    rep.add_argument(
        "--parent-resolution",
        default="captured_tokens",
        choices=["captured_tokens", "source_history"],
        help="how a call after a rewritten harness note is linked (default captured_tokens)",
    )
    rep.add_argument("--store", type=Path, default=None, help="store directory (default: temp)")
    rep.set_defaults(func=_run_replay)


def _add_export_tokenizer(sub: Any) -> None:
    """Add ``export-tokenizer`` to ``sub`` (an ``argparse`` subparsers action)."""
    exp = sub.add_parser(
        "export-tokenizer",
        help="write the scripted engine's tokenizer + chat template as an HF directory "
        "(for serve --tokenizer in exact_tokens mode)",
    )
    exp.add_argument(
        "directory",
        type=Path,
        help="where to write; it must not exist or be an empty directory (a file or a "
        "directory holding files is refused: nothing is overwritten)",
    )
    exp.add_argument(
        "--template",
        default="keep_reasoning",
        choices=["keep_reasoning", "drop_reasoning"],
        help=_TEMPLATE_HELP,
    )
    exp.add_argument(
        "--chat-template", type=Path, help="a jinja chat template file to write instead"
    )
    exp.set_defaults(func=_run_export_tokenizer)


def build_parser() -> argparse.ArgumentParser:
    """``capture-proxy``'s parser: each subcommand sets ``func``, the function that runs it
    (``args`` -> process exit code)."""
    parser = argparse.ArgumentParser(
        prog="capture-proxy",
        description="Token-capture reverse proxy for agentic RL rollouts.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_show(sub)
    _add_scripted_engine(sub)
    _add_demo(sub)
    _add_replay(sub)
    _add_export_tokenizer(sub)
    # Its arguments only: the audit's torch side is imported when the command runs.
    from capture_proxy.audit.command import add_parser as add_audit_parser

    add_audit_parser(sub)
    return parser
