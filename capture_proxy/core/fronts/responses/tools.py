"""A Responses request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, as the
canonical chat request's.

Owns the validation of those fields (errors name the field, ``checks``) and their mapping:
``function`` tools pass; ``custom`` (freeform) tools become a function with one string
parameter ``input``; ``namespace`` and hosted tools (``web_search``, ...) cannot be rendered by
a local engine and are left out (``ResponsesOptions.unrendered_tools``, named by the call's
``tools_not_rendered`` diagnostic). Pure.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from capture_proxy.core.conversation import ChatFunction, ChatNamedToolChoice, ChatRequest, ChatTool
from capture_proxy.core.fronts.base import Api, ConvertedTools, convert_tools
from capture_proxy.core.fronts.responses.checks import as_list, as_object, fail, string_member
from capture_proxy.core.known_tools import KnownTools

#: The chat parameters a freeform (``custom``) tool is offered under.
CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}
_TOOL_CHOICES = frozenset({"auto", "none", "required"})


#: What the Responses front keeps of its tools beside the chat tools: the names of freeform
#: tools, the tools left out.
_ToolsExtra = tuple[frozenset[str], tuple[Mapping[str, Any], ...]]


def _tools(raw: Any) -> tuple[list[ChatTool], _ToolsExtra]:
    """Chat function tools, and (the names of freeform tools, the tools left out)."""
    tools: list[ChatTool] = []
    custom: set[str] = set()
    unrendered: list[Mapping[str, Any]] = []
    for i, entry in enumerate(as_list(raw, "tools")):
        path = f"tools.{i}"
        tool = as_object(entry, path)
        kind = tool.get("type")
        if not isinstance(kind, str):
            fail(f"{path}.type", "is required (a string)")
        if kind in ("function", "custom"):
            name = string_member(tool, "name", path) or ""
            function: ChatFunction = {"name": name}
            description = string_member(tool, "description", path, required=False)
            if description is not None:
                function["description"] = description
            if kind == "function":
                parameters = tool.get("parameters")
                if parameters is None:
                    parameters = {"type": "object", "properties": {}}
                function["parameters"] = dict(as_object(parameters, f"{path}.parameters"))
                strict = tool.get("strict")
                if strict is not None:
                    if not isinstance(strict, bool):
                        fail(f"{path}.strict", "must be a boolean")
                    function["strict"] = strict
            else:
                function["parameters"] = copy.deepcopy(CUSTOM_TOOL_PARAMETERS)
                custom.add(name)
            tools.append({"type": "function", "function": function})
        else:
            unrendered.append(tool)
    return tools, (frozenset(custom), tuple(unrendered))


def _tool_choice(value: Any) -> str | ChatNamedToolChoice:
    if isinstance(value, str):
        if value not in _TOOL_CHOICES:
            fail("tool_choice", "must be 'auto', 'none', 'required' or a function choice")
        return value
    choice = as_object(value, "tool_choice")
    if choice.get("type") in ("function", "custom"):
        return {
            "type": "function",
            "function": {"name": string_member(choice, "name", "tool_choice")},
        }
    fail(
        "tool_choice.type",
        f"is {choice.get('type')!r}: only a function or custom tool can be forced "
        "(hosted tools are not run by the engine)",
    )


def tool_fields(
    body: Mapping[str, Any], chat: ChatRequest, known_tools: KnownTools | None
) -> ConvertedTools[_ToolsExtra]:
    """Sets ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of ``chat`` (the last two
    only when a tool is rendered); returns the tools as converted (``extra``: the freeform
    tools' names and the tools left out)."""
    converted: ConvertedTools[_ToolsExtra] = ConvertedTools([], (frozenset(), ()))
    if body.get("tools") is not None:
        converted = convert_tools(body["tools"], Api.RESPONSES, _tools, known_tools)
        if converted.chat:
            chat["tools"] = converted.chat
    if body.get("tool_choice") is not None:
        choice = _tool_choice(body["tool_choice"])
        if "tools" in chat:
            chat["tool_choice"] = choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            fail("parallel_tool_calls", "must be a boolean")
        if "tools" in chat:
            chat["parallel_tool_calls"] = parallel
    return converted
