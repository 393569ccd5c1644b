"""A prompt rendered by our ChatML + Hermes templates, read back into a conversation.

Owns the layout the scripted engine's Qwen families render (``<|im_start|>role ...
<|im_end|>``, the ``# Tools`` system block, ``<tool_call>`` / ``<tool_response>``,
``<think>``) as far as the policy needs it to answer a token-id prompt: roles, text, reasoning,
tool calls and the offered tools. Pure text in, messages out. Must not: tokenize or render.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOLS_HEADER = "# Tools\n\nYou may call one or more functions"
_TOOL_RESPONSES = re.compile(r"(?:\n<tool_response>\n.*?\n</tool_response>)+", re.S)
_TOOL_RESPONSE = re.compile(r"\n<tool_response>\n(.*?)\n</tool_response>", re.S)
_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)
_THINK = re.compile(r"<think>\n(.*?)\n</think>\n\n", re.S)


#: what follows ``<|im_start|>assistant\n`` in a generation prompt: nothing, the think block
#: Qwen3-2507 Thinking opens, or the empty one Qwen3 closes with enable_thinking=false
_GENERATION_PROMPTS = frozenset({"", "<think>\n", "<think>\n\n</think>\n\n"})


def parse_chatml(text: str) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """Messages (role + content; assistant reasoning and tool calls; tool results) and the
    offered tools of a prompt rendered by our ChatML + Hermes templates. Text outside ChatML
    turns becomes a user message; the open ``<|im_start|>assistant\\n`` at the end is the
    generation prompt and is dropped."""
    head, *turns = text.split("<|im_start|>")
    messages: list[dict[str, Any]] = []
    tools: list[Any] | None = None
    if head.strip():
        messages.append({"role": "user", "content": head})
    for turn in turns:
        closed = "<|im_end|>" in turn
        body = turn.split("<|im_end|>", 1)[0]
        role, _, content = body.partition("\n")
        if not closed and role == "assistant" and content in _GENERATION_PROMPTS:
            continue
        if role == "system" and "<tools>" in content:
            system, _, rest = content.partition(TOOLS_HEADER)
            tools = _parse_tools(rest)
            if system.endswith("\n\n"):
                messages.append({"role": "system", "content": system[:-2]})
            elif system:
                messages.append({"role": "system", "content": system})
        elif role == "user" and _TOOL_RESPONSES.fullmatch("\n" + content):
            messages += [
                {"role": "tool", "content": c} for c in _TOOL_RESPONSE.findall("\n" + content)
            ]
        elif role == "assistant":
            messages.append(_parse_assistant(content))
        else:
            messages.append({"role": role, "content": content})
    return messages, tools


def _parse_tools(text: str) -> list[Any]:
    inner = text.partition("\n<tools>")[2].partition("\n</tools>")[0]
    out = []
    for line in inner.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append(line)
    return out


def _parse_assistant(text: str) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant"}
    m = _THINK.match(text)
    if m:
        msg["reasoning_content"] = m.group(1)
        text = text[m.end() :]
    calls = []
    first = text.find("<tool_call>")
    if first >= 0:
        for i, block in enumerate(_TOOL_CALL.findall(text[first:])):
            try:
                obj = json.loads(block)
                name, args = str(obj["name"]), obj.get("arguments", {})
            except (ValueError, KeyError, TypeError):
                name, args = "", block
            calls.append(
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {
                        "name": name,
                        "arguments": args
                        if isinstance(args, str)
                        else json.dumps(args, ensure_ascii=False),
                    },
                }
            )
        text = text[:first].removesuffix("\n") if calls else text
    msg["content"] = text
    if calls:
        msg["tool_calls"] = calls
    return msg
