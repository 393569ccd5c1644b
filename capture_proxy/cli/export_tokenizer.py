"""``capture-proxy export-tokenizer``: write the scripted engine's tokenizer as an HF directory.

Owns the flags and the write; the tokenizer is ``families.qwen_vocab``'s (the ``scripted``
extra, imported when the command runs).
"""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    """Write the tokenizer (and chat template) to ``args.directory``; 0."""
    from capture_proxy.families.qwen_vocab import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer(template=args.template)
    which = args.template
    if args.chat_template is not None:
        tokenizer.chat_template = args.chat_template.read_text(encoding="utf-8")
        which = str(args.chat_template)
    tokenizer.save_pretrained(str(args.directory))
    print(f"wrote the scripted engine's Qwen tokenizer ({which}) to {args.directory}")
    return 0
