"""``capture-proxy scripted-engine``: its options, and running the scripted engine.

Owns turning the flags into the engine's config (``engine_config``); the engine is
``scripted_engine`` (it needs the ``scripted`` extra, imported when the command runs). A file
flag that cannot be read or does not hold what it should, a family that cannot be loaded and an
address that cannot be bound are ``CommandError``s naming the flag or address. Must not: build
the app or answer a request.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from capture_proxy.cli.errors import CommandError

if TYPE_CHECKING:
    from capture_proxy.scripted_engine.policy import Policy
    from capture_proxy.scripted_engine.state import ScriptedEngineConfig

#: How many of a policy's validation errors the message lists.
SHOWN_POLICY_ERRORS = 3


def _read_text(flag: str, path: Path) -> str:
    """The text of ``flag``'s file. Raises CommandError naming the flag, file and problem."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot read {flag} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise CommandError(f"{flag} {path}: not UTF-8 text ({exc.reason})") from exc


def _policy_problem(exc: ValidationError) -> str:
    """What is wrong with a policy file's text, in one line (the first few errors)."""
    errors = exc.errors()
    if errors[0]["type"] == "json_invalid":
        return f"not JSON: {errors[0]['msg']}"
    shown = "; ".join(
        f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" if err["loc"] else err["msg"]
        for err in errors[:SHOWN_POLICY_ERRORS]
    )
    more = len(errors) - SHOWN_POLICY_ERRORS
    return f"not a policy: {shown}" + (f" (and {more} more)" if more > 0 else "")


def load_policy(path: Path) -> Policy:
    """The policy in ``--policy``'s file. Raises CommandError naming the file and what is
    wrong: it cannot be read, is not JSON, or does not validate as a policy."""
    from capture_proxy.scripted_engine.policy import Policy

    text = _read_text("--policy", path)
    try:
        return Policy.model_validate_json(text)
    except ValidationError as exc:
        raise CommandError(f"--policy {path}: {_policy_problem(exc)}") from exc


def engine_config(args: argparse.Namespace) -> ScriptedEngineConfig:
    """The engine's config from ``scripted-engine``'s ``args``: the policy file (or the built-in
    policy) and chat template file read. Raises CommandError (a file that cannot be read, a
    policy that is not JSON or does not validate)."""
    from capture_proxy.scripted_engine.policy import Policy
    from capture_proxy.scripted_engine.state import ScriptedEngineConfig

    policy = load_policy(args.policy) if args.policy is not None else Policy.default()
    chat_template = None
    if args.chat_template is not None:
        chat_template = _read_text("--chat-template", args.chat_template)
    return ScriptedEngineConfig(
        policy=policy,
        tokenizer_template=args.template,
        max_model_len=args.max_model_len,
        family=args.family,
        chat_template=chat_template,
        tokenizer_dir=args.tokenizer_dir,
        enable_scale_out=args.enable_scale_out,
        dev_mode=args.dev_mode,
    )


def run(args: argparse.Namespace) -> int:
    """Serve the scripted engine until stopped; its process exit code. Raises CommandError
    (see ``engine_config``; a family or tokenizer directory that cannot be loaded; an address
    that cannot be bound)."""
    from capture_proxy.scripted_engine.app import build_scripted_engine_app, run_scripted_engine

    config = engine_config(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = build_scripted_engine_app(config)
    except ValueError as exc:  # it names the family, template or tokenizer directory
        raise CommandError(str(exc)) from exc
    try:
        run_scripted_engine(args.host, args.port, config, app)
    except OSError as exc:  # the address is in use, unknown, or not ours to bind
        raise CommandError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
        ) from exc
    return 0
