"""``capture-proxy scripted-engine``: its options, and running the scripted engine.

Owns the flags only; the engine is ``scripted_engine`` (it needs the ``scripted`` extra, imported
when the command runs).
"""

from __future__ import annotations

import argparse
import logging


def run(args: argparse.Namespace) -> int:
    """Serve the scripted engine until stopped; its process exit code."""
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
