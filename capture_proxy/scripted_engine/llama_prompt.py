"""A prompt rendered by the Llama 3.x template, read back into a conversation.

Owns the layout of the published Llama 3.3 template (``<|start_header_id|>ROLE
<|end_header_id|>\\n\\n BODY <|eot_id|>``, the system preamble, the tool list put into the
first user message, ``ipython`` tool results, ``{"name": ..., "parameters": ...}`` tool calls)
as far as the scripted engine's policy needs it to answer a token-id prompt: roles, text, tool
calls and whether tools were offered. Pure text in, messages out. Must not: tokenize or
render.
"""

from __future__ import annotations

import json
import re
from typing import Any

from capture_proxy.families.llama3 import Llama3JsonParser

_TURN = re.compile(
    r"<\|start_header_id\|>(.*?)<\|end_header_id\|>\n\n(.*?)(<\|eot_id\|>|<\|eom_id\|>|$)", re.S
)
#: what the template writes before the tools in the first user message
TOOLS_PREAMBLE = "Given the following functions, please respond with a JSON for a function call"
_TOOLS_LEAD = "Do not use variables.\n\n"
_SYSTEM_PREAMBLE = re.compile(
    r"(?:Environment: ipython\n)?(?:Tools: [^\n]*\n\n)?Cutting Knowledge Date: [^\n]*\n"
    r"Today Date: [^\n]*\n\n",
)
_DECODER = json.JSONDecoder()
_PARSER = Llama3JsonParser()


def _split_tools(body: str) -> tuple[list[Any], str]:
    """(tool names, the user's own text) of a first user message that lists the tools."""
    rest = body.partition(_TOOLS_LEAD)[2]
    names: list[Any] = []
    while rest.startswith("{"):
        try:
            tool, end = _DECODER.raw_decode(rest)
        except ValueError:
            break
        if not isinstance(tool, dict) or ("function" not in tool and "name" not in tool):
            break
        fn = tool.get("function", tool)
        names.append(fn.get("name") if isinstance(fn, dict) else None)
        rest = rest[end:].removeprefix("\n\n")
    return names, rest


def parse_llama3_prompt(text: str) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """Messages (role + content; assistant tool calls; ``ipython`` results as tool messages)
    and the offered tools (their names) of a prompt the Llama 3.x template rendered; the open
    assistant header at the end (the generation prompt) is dropped, and so is the empty
    system turn the template always writes."""
    messages: list[dict[str, Any]] = []
    tools: list[Any] | None = None
    for match in _TURN.finditer(text):
        role, body, close = match.group(1), match.group(2), match.group(3)
        if role == "assistant" and not close and not body:
            continue  # the generation prompt
        if role == "system":
            if body.startswith("Environment: ipython\n"):
                tools = tools if tools is not None else []
            body = _SYSTEM_PREAMBLE.sub("", body, count=1)
            if body:
                messages.append({"role": "system", "content": body})
        elif role == "user" and body.startswith(TOOLS_PREAMBLE) and not _has_user(messages):
            tools, body = _split_tools(body)
            messages.append({"role": "user", "content": body})
        elif role == "ipython":
            messages.append({"role": "tool", "content": body})
        elif role == "assistant":
            parsed = _PARSER.parse(body, "prompt")
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
            messages.append(message)
        else:
            messages.append({"role": role, "content": body})
    return messages, tools


def _has_user(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "user" for m in messages)
