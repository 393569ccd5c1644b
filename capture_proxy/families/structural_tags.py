"""The constraint vLLM 0.32 puts on a generation for a request's tools and ``tool_choice``. Pure.

Owns what exact-token mode sends the engine as ``structured_outputs`` so that a generation is
constrained as vLLM's own chat completions constrain it (``vllm/parser/abstract_parser.py``,
``DelegatingParser._apply_structural_tag``, with ``VLLM_ENFORCE_STRICT_TOOL_CALLING`` on, its
default): for the tool-call parsers the families follow (``hermes``, ``llama3_json``,
``qwen3_coder``, whose ``structural_tag_model`` is ``hermes``, ``llama`` and ``qwen_3_coder``)
vLLM does not build the JSON schema of older versions (a list of ``{name, parameters}``); it
builds an xgrammar structural tag in the model's own tool-call format and sends it as
``structured_outputs.structural_tag`` (the JSON text of ``StructuralTag.model_dump()``):

- a tag applies when the request has tools and ``tool_choice`` is ``required``, a named
  function, or ``auto`` with a tool marked ``strict: true`` or ``parallel_tool_calls: false``
  (vLLM's strict level ``auto``, raised to ``function`` by a single call); ``none`` or no tools:
  no constraint;
- each tool's arguments are constrained by its ``parameters`` only when the tool is strict,
  else any JSON value (``true``): the envelope (``<tool_call>``, the name) is constrained;
- ``required``: one or more calls; a named function: one call of that function; ``auto``: text
  with calls where the model opens one; ``parallel_tool_calls: false``: at most one call
  (``stop_after_first``);
- the tag replaces the request's own ``structured_outputs`` / ``response_format`` (vLLM warns
  and ignores them for ``required`` and a named function; ``auto`` with both is refused here,
  ``ToolConstraintError``, since vLLM then builds a union of the two this module does not).

The builders are vLLM's ``tool_parsers/structural_tag_registry.py`` (``hermes``) and
xgrammar 0.2's ``builtin_structural_tag.py`` (``llama``, ``qwen_3_coder``, reasoning
``disabled``); the text is checked byte for byte against the goldens vLLM's own
``adjust_request`` writes (``tests/fixtures/parser_goldens/tool_choice/constraints.json``).
Must not import anything of the proxy's I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from capture_proxy.families.tool_choice import ToolChoice

#: the tool-call formats a tag is built for (vLLM's ``structural_tag_model``)
FORMATS = ("hermes", "llama", "qwen_3_coder")
_THINK = ["<think>", "</think>"]


class ToolConstraintError(ValueError):
    """The request's tools and ``tool_choice`` ask for a constraint this module cannot build
    as vLLM would; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    return fn if isinstance(fn, Mapping) else {}


def _schema(fn: Mapping[str, Any], strict: bool) -> Any:
    """A tool's arguments' schema in the tag: its parameters when strict, else any JSON."""
    if not strict or fn.get("parameters") is None:
        return True
    return fn["parameters"]


def _json_schema(schema: Any, style: str = "json") -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": style,
        "any_order": False,
        "max_whitespace_cnt": None,
        "excludes": [],
    }


def _tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _triggered(triggers: list[str], tags: list[Any], *, at_least_one: bool, excludes: list[str]):
    return {
        "type": "triggered_tags",
        "triggers": triggers,
        "tags": tags,
        "at_least_one": at_least_one,
        "stop_after_first": False,
        "excludes": excludes,
    }


def _hermes(calls: list[tuple[str, Any]], mode: str) -> dict[str, Any]:
    tags = [
        _tag(f'{begin}{{"name": "{name}", "arguments": ', _json_schema(schema), end)
        for name, schema in calls
        for begin, end in (("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>"))
    ]
    if mode == "auto":
        return _triggered(["<tool_call>"], tags, at_least_one=False, excludes=[])
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": mode == "named",
    }


def _llama(calls: list[tuple[str, Any]], mode: str) -> dict[str, Any]:
    tags = [
        _tag(f'{{"name": "{name}", "parameters": ', _json_schema(schema), "}")
        for name, schema in calls
    ]
    if mode == "named":
        return tags[0]
    return _triggered(['{"name": '], tags, at_least_one=mode == "required", excludes=_THINK)


def _qwen_3_coder(calls: list[tuple[str, Any]], mode: str) -> dict[str, Any]:
    tags = [
        _tag(
            f"<tool_call>\n<function={name}>\n",
            _json_schema(schema, "qwen_xml"),
            "\n</function>\n</tool_call>",
        )
        for name, schema in calls
    ]
    if mode == "named":
        return tags[0]
    return _triggered(
        ["<tool_call>\n<function="], tags, at_least_one=mode == "required", excludes=_THINK
    )


_BUILDERS = {"hermes": _hermes, "llama": _llama, "qwen_3_coder": _qwen_3_coder}


def _stop_after_first(node: Any) -> None:
    """vLLM's ``limit_to_single_tool_call``: every list of calls stops after its first."""
    if isinstance(node, dict):
        if node.get("type") in ("triggered_tags", "tags_with_separator"):
            node["stop_after_first"] = True
        for value in node.values():
            _stop_after_first(value)
    elif isinstance(node, list):
        for item in node:
            _stop_after_first(item)


def tool_constraint(
    fmt: str | None, tools: Sequence[Any] | None, choice: ToolChoice, body: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The ``structured_outputs`` vLLM sends the engine for this request (``{"structural_tag":
    JSON text}``), or None when it sends its request's own (no tag applies). ``fmt``: the
    family's tool-call format (None: a family vLLM constrains otherwise, e.g. harmony, whose
    ``required`` and named choices are refused). Raises ToolConstraintError."""
    if choice.mode == "none" or not tools:
        return None
    single = not choice.parallel
    own = body.get("structured_outputs") is not None or body.get("response_format") is not None
    functions = [_function(t) for t in tools]
    any_strict = any(fn.get("strict") is True for fn in functions)
    if choice.mode == "auto" and not any_strict and not (single and not own):
        return None
    if fmt not in _BUILDERS:
        raise ToolConstraintError(
            f"tool_choice {choice.describe()} is not enforced in exact_tokens mode for this "
            "model family (its tool-call format has no constraint here)",
            "tool_choice",
        )
    if choice.mode == "auto" and own:
        raise ToolConstraintError(
            "tools that constrain their calls (strict, or parallel_tool_calls false) together "
            "with structured_outputs or response_format are not supported in exact_tokens mode",
            "response_format" if body.get("response_format") is not None else "structured_outputs",
        )
    # vLLM's strict level: auto, raised to "function" by a single call; an argument schema
    # applies only to a tool marked strict
    calls = [
        (str(fn.get("name")), _schema(fn, fn.get("strict") is True))
        for fn in functions
        if choice.mode != "named" or fn.get("name") == choice.name
    ]
    if not calls:
        raise ToolConstraintError(
            f"tool_choice names {choice.name!r}, which is not one of the tools", "tool_choice"
        )
    fmt_node = _BUILDERS[fmt](calls, choice.mode)
    if single:
        _stop_after_first(fmt_node)
    tag = {"type": "structural_tag", "format": fmt_node}
    return {"structural_tag": json.dumps(tag)}
