"""A Messages request's ``tools`` and ``tool_choice``, as the canonical chat request's.

Owns the validation of those fields (errors name the field, ``checks``) and their mapping:

- ``tools``: custom tools -> chat function tools (``parameters`` = ``input_schema``); server
  tools (a ``type`` other than ``custom``, e.g. ``web_search_20250305``) cannot run behind an
  engine: left out of the chat tools, listed in ``MessagesOptions.server_tools`` and named by
  the call's ``tools_not_rendered`` diagnostic.
- ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` -> ``"auto"`` / ``"required"`` /
  ``{"type": "function", ...}`` / ``"none"``; ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``.

Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capture_proxy.core.conversation import ChatFunction, ChatNamedToolChoice, ChatRequest, ChatTool
from capture_proxy.core.fronts.base import Api, ConvertedTools, convert_tools
from capture_proxy.core.fronts.messages.checks import as_bool, as_list, as_object, as_str, fail
from capture_proxy.core.known_tools import KnownTools


def _tools(raw: Any) -> tuple[list[ChatTool], tuple[dict[str, Any], ...]]:
    """(chat function tools, server tools)."""
    chat: list[ChatTool] = []
    server: list[dict[str, Any]] = []
    for i, tool in enumerate(as_list(raw, "tools")):
        p = f"tools.{i}"
        as_object(tool, p)
        kind = tool.get("type")
        if kind is not None and as_str(kind, f"{p}.type") != "custom":
            server.append(tool)
            continue
        fn: ChatFunction = {"name": as_str(tool.get("name"), f"{p}.name")}
        if tool.get("description") is not None:
            fn["description"] = as_str(tool["description"], f"{p}.description")
        fn["parameters"] = as_object(tool.get("input_schema"), f"{p}.input_schema")
        chat.append({"type": "function", "function": fn})
    return chat, tuple(server)


def _tool_choice(raw: Any, tool_names: Sequence[str], out: ChatRequest) -> None:
    choice = as_object(raw, "tool_choice")
    kind = as_str(choice.get("type"), "tool_choice.type")
    if kind == "auto":
        value: str | ChatNamedToolChoice = "auto"
    elif kind == "any":
        value = "required"
    elif kind == "tool":
        name = as_str(choice.get("name"), "tool_choice.name")
        if name not in tool_names:
            raise fail("tool_choice.name", f"{name!r} is not one of the (custom) tools")
        value = {"type": "function", "function": {"name": name}}
    elif kind == "none":
        value = "none"
    else:
        raise fail("tool_choice.type", f"must be auto, any, tool or none, not {kind!r}")
    if kind == "any" and not tool_names:
        raise fail("tool_choice.type", "any needs at least one (custom) tool")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and as_bool(disable, "tool_choice.disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    if tool_names:
        out["tool_choice"] = value


def tool_fields(
    body: dict[str, Any], chat: ChatRequest, known_tools: KnownTools | None
) -> ConvertedTools[tuple[dict[str, Any], ...]]:
    """Sets ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of ``chat``; returns the
    tools as converted (``extra``: the server tools, left out)."""
    converted: ConvertedTools[tuple[dict[str, Any], ...]] = ConvertedTools([], ())
    if body.get("tools") is not None:
        converted = convert_tools(body["tools"], Api.MESSAGES, _tools, known_tools)
        if converted.chat:
            chat["tools"] = converted.chat
    if body.get("tool_choice") is not None:
        names = [t["function"]["name"] for t in converted.chat]
        _tool_choice(body["tool_choice"], names, chat)
    return converted
