"""``capture-proxy scripted-engine``: its options, and running the scripted engine.

Owns turning the flags into the engine's config (``engine_config``); the engine is
``scripted_engine`` (it needs the ``scripted`` extra, imported when the command runs). Must
not: build the app or answer a request.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from capture_proxy.scripted_engine.state import ScriptedEngineConfig


def engine_config(args: argparse.Namespace) -> ScriptedEngineConfig:
    """The engine's config from ``scripted-engine``'s ``args``: the policy file (or the built-in
    policy) and chat template file read. Raises OSError (a file cannot be read) and pydantic's
    ValidationError (a policy that does not validate)."""
    from capture_proxy.scripted_engine.policy import Policy
    from capture_proxy.scripted_engine.state import ScriptedEngineConfig

    policy = Policy.load(args.policy) if args.policy is not None else Policy.default()
    chat_template = None
    if args.chat_template is not None:
        chat_template = args.chat_template.read_text(encoding="utf-8")
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
    """Serve the scripted engine until stopped; its process exit code."""
    from capture_proxy.scripted_engine.app import run_scripted_engine

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_scripted_engine(args.host, args.port, engine_config(args))
    return 0
