"""The conversations the published-template goldens are rendered for.

Each case is one chat-completions request in the canonical form the proxy renders (the
recorded OpenCode, Codex and Claude Code calls mapped by their front codecs, plus small
synthetic sessions: an OpenAI SDK echo with ``content: null``, reasoning on and off, content
parts, a developer message), with ``turn_index``: the continued assistant turn (the parent's
output) when the call continues one, else None.

``python -m tests.support.golden_cases OUT.json`` writes them for ``tests/support/vllm_oracle``
(run with vLLM's own Python), which renders them as vLLM does. Tests import ``cases()``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from capture_proxy.core.fronts import front_for
from capture_proxy.harnesses.recorded import load_recording

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["path"],
        },
    },
}
BASH_TOOL = {  # no description: vLLM renders it as null
    "type": "function",
    "function": {
        "name": "bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}
_SYSTEM = {"role": "system", "content": "You are a coding agent."}
_USER = {"role": "user", "content": "Read notes.txt, then list the files."}
_CALL_1 = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "read", "arguments": '{"path": "notes.txt", "limit": 3}'},
}
_CALL_2 = {"id": "call_2", "type": "function", "function": {"name": "bash", "arguments": "{}"}}


def _synthetic() -> list[dict[str, Any]]:
    """Small sessions in the shapes harnesses send back (the OpenAI SDK's echo of an answer:
    ``content: null`` or no ``content`` beside ``tool_calls``)."""
    tools = [READ_TOOL, BASH_TOOL]
    null_echo = {"role": "assistant", "content": None, "tool_calls": [_CALL_1]}
    absent_echo = {"role": "assistant", "tool_calls": [_CALL_2]}
    reasoned = {
        "role": "assistant",
        "content": "Reading it.",
        "reasoning_content": "The user wants the notes first.",
        "tool_calls": [_CALL_1],
    }
    tool_1 = {"role": "tool", "tool_call_id": "call_1", "content": "TODO: ship\nDONE: test"}
    tool_2 = {
        "role": "tool",
        "tool_call_id": "call_2",
        "content": [{"type": "text", "text": "a.txt"}, {"type": "text", "text": "notes.txt"}],
    }
    final = {"role": "assistant", "content": "Two files: a.txt and notes.txt."}
    out = []

    def session(name: str, turns: list[list[dict[str, Any]]], **extra: Any) -> None:
        messages: list[dict[str, Any]] = [_SYSTEM, _USER]
        for k, turn in enumerate([[], *turns]):
            messages = [*messages, *turn]
            j = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            out.append(
                {
                    "name": f"{name}/{k}",
                    "messages": messages,
                    "tools": tools,
                    "turn_index": j,
                    **extra,
                }
            )

    session("null_content_echo", [[null_echo, tool_1], [absent_echo, tool_2]])
    session("reasoning_echo", [[reasoned, tool_1], [final, {"role": "user", "content": "Thanks."}]])
    session(
        "no_thinking",
        [[null_echo, tool_1], [final, {"role": "user", "content": "Again."}]],
        chat_template_kwargs={"enable_thinking": False},
    )
    parts_user = {
        "role": "user",
        "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}],
    }
    out.append(
        {
            "name": "content_parts_and_developer",
            "messages": [{"role": "developer", "content": "Be brief."}, parts_user],
            "tools": None,
            "turn_index": None,
        }
    )
    return out


_PATHS = {
    "chat_completions": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def _recorded() -> list[dict[str, Any]]:
    """Every recorded call of the fixtures, as its front codec maps it."""
    paths = sorted((FIXTURES / "opencode" / "logs").glob("*.jsonl"))
    paths += sorted((FIXTURES / "codex").glob("*.jsonl"))
    paths += sorted((FIXTURES / "claude_code").glob("*.jsonl"))
    out = []
    for path in paths:
        for rec in load_recording(path):
            front = front_for(_PATHS[str(rec.api)])
            assert front is not None
            chat = front.parse(dict(rec.body)).chat
            messages = chat["messages"]
            if messages and messages[-1]["role"] == "assistant":
                # OpenCode's step-limit note: the proxy forwards it as a user message
                messages = [*messages[:-1], {**messages[-1], "role": "user"}]
            j = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            out.append(
                {
                    "name": f"{path.parent.name}/{path.stem}/{rec.seq}",
                    "messages": messages,
                    "tools": chat.get("tools"),
                    "turn_index": j,
                }
            )
    return out


def cases() -> list[dict[str, Any]]:
    """All cases, synthetic first; names are unique."""
    out = _synthetic() + _recorded()
    assert len({c["name"] for c in out}) == len(out)
    return out


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(cases(), ensure_ascii=False), encoding="utf-8")
