"""What the tool-choice goldens ask vLLM 0.32: the answer per ``tool_choice``, and the constraint.

Two sets, both made by ``tests/support/vllm_tool_choice_oracle.py`` (run with vLLM's own Python
by ``scripts/parser-goldens``):

- answers: every generated text of ``tests.support.parser_cases`` answered by vLLM's chat
  serving (its own ``chat_completion_full_generator`` and ``chat_completion_stream_generator``)
  for each request shape of ``CHOICES`` (no ``tools``, ``tool_choice`` none, auto, required,
  a named function, auto with ``parallel_tool_calls: false``), into
  ``tests/fixtures/parser_goldens/tool_choice/<serving>.json``;
- constraints: the ``structured_outputs`` (and ``response_format``) vLLM's serving puts on the
  engine request (``Parser.adjust_request``, as ``renderers/online_renderer.py`` calls it) for
  each serving, ``CHOICES`` entry and tool list of ``CONSTRAINT_TOOLS``, into
  ``tests/fixtures/parser_goldens/tool_choice/constraints.json``.

``python -m tests.support.tool_choice_cases OUT.json`` writes ``{"servings", "cases",
"choices", "constraint_tools"}`` for the oracle. Pure data: imports nothing of capture_proxy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.support.parser_cases import AGENT_TOOLS, SERVINGS, cases

#: the request fields of each tool-choice shape (beside ``model`` and one user message);
#: ``"tools": True`` stands for the case's tools
CHOICES: dict[str, dict[str, Any]] = {
    "no_tools": {},
    "none": {"tools": True, "tool_choice": "none"},
    "auto": {"tools": True, "tool_choice": "auto"},
    "required": {"tools": True, "tool_choice": "required"},
    "named": {"tools": True, "tool_choice": {"type": "function", "function": {"name": "bash"}}},
    "auto_single": {"tools": True, "tool_choice": "auto", "parallel_tool_calls": False},
    "required_single": {"tools": True, "tool_choice": "required", "parallel_tool_calls": False},
}

_STRICT_BASH = {
    "type": "function",
    "function": {**AGENT_TOOLS[0]["function"], "strict": True},
}
_NO_PARAMETERS = {"type": "function", "function": {"name": "bash", "description": None}}
_NULL_INSIDE = {
    "type": "function",
    "function": {
        "name": "bash",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "default": None, "title": "é"}},
        },
        "strict": True,
    },
}

#: tool lists whose constraint vLLM builds (each with every ``CHOICES`` entry that has tools)
CONSTRAINT_TOOLS: dict[str, list[dict[str, Any]]] = {
    "agent": AGENT_TOOLS,
    "strict_bash": [_STRICT_BASH, *AGENT_TOOLS[1:]],
    "no_parameters": [_NO_PARAMETERS],
    "null_inside": [_NULL_INSIDE],
}


def main(argv: list[str]) -> None:
    Path(argv[1]).write_text(
        json.dumps(
            {
                "servings": SERVINGS,
                "cases": cases(),
                "choices": CHOICES,
                "constraint_tools": CONSTRAINT_TOOLS,
            },
            ensure_ascii=False,
            indent=1,
        ),
        encoding="utf-8",
    )


if __name__ == "__main__":
    main(sys.argv)
