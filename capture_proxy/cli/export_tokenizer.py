"""``capture-proxy export-tokenizer``: write the scripted engine's tokenizer as an HF directory.

Owns the flags' checks and the write; the tokenizer is ``families.qwen_vocab``'s (the
``scripted`` extra, imported when the command runs). Must not: write over anything. The target
is a directory that does not exist yet (it is made, with its parents) or is empty; anything else
(a file, a directory holding files) is refused before the tokenizer is built, because the
tokenizer's own ``save_pretrained`` overwrites its file names in a directory and writes nothing,
without failing, to a path that is a file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from capture_proxy.cli.errors import CommandError

#: Why a target is refused, after what it is.
NOT_A_TARGET = "the target must be a new or empty directory (nothing is overwritten)"


def prepare_target(directory: Path) -> None:
    """Make ``directory`` (and its parents) unless it is an empty directory already. Raises
    CommandError: it exists and is not a directory, is a directory that is not empty, or cannot
    be made."""
    if directory.is_dir():
        if any(directory.iterdir()):
            raise CommandError(f"{directory} is a directory that is not empty: {NOT_A_TARGET}")
        return
    if directory.exists() or directory.is_symlink():
        raise CommandError(f"{directory} exists and is not a directory: {NOT_A_TARGET}")
    try:
        directory.mkdir(parents=True)
    except OSError as exc:
        raise CommandError(f"cannot create {directory}: {exc.strerror or exc}") from exc


def run(args: argparse.Namespace) -> int:
    """Write the tokenizer (and chat template) to ``args.directory``; 0. Raises CommandError
    (a target that is not a new or empty directory, an unreadable ``--chat-template``, a failed
    write)."""
    directory: Path = args.directory
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = args.chat_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise CommandError(
                f"cannot read --chat-template {args.chat_template}: {reason}"
            ) from exc
    prepare_target(directory)

    from capture_proxy.families.qwen_vocab import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer(template=args.template)
    which = args.template
    if chat_template is not None:
        tokenizer.chat_template = chat_template
        which = str(args.chat_template)
    try:
        tokenizer.save_pretrained(str(directory))
    except OSError as exc:
        raise CommandError(f"cannot write {directory}: {exc.strerror or exc}") from exc
    print(f"wrote the scripted engine's Qwen tokenizer ({which}) to {directory}")
    return 0
