"""Qwen3-Coder output parser: ``<think>`` reasoning, text, XML tool calls. Pure.

The generation layout it inverts (Qwen3-Coder / Qwen3.5 XML tool calls, and our
``templates/qwen3_coder.jinja``)::

    [ "<think>\\n" REASONING "\\n</think>\\n\\n" ] CONTENT
    [ ("\\n\\n" if CONTENT) TOOL_CALL ("\\n" TOOL_CALL)* ]
    TOOL_CALL = "<tool_call>\\n<function=" NAME ">\\n" PARAMETER* "</function>\\n</tool_call>"
    PARAMETER = "<parameter=" KEY ">\\n" VALUE "\\n</parameter>\\n"

As vLLM's ``qwen3coder`` tool parser does: one newline on each side of a value is markup;
a value is converted by the type its tool's JSON schema gives the parameter (string kept as
written, integer, number, boolean, ``null``, object / array as JSON), a parameter the schema
does not know stays a string; the arguments are ``json.dumps(..., ensure_ascii=False)`` of the
parameters in the order written. A ``</parameter>`` or ``</function>`` counts only where the
layout puts one (followed by a newline and the next parameter or the function's end), so a
value may contain those words. A block that does not parse stays in the content as text.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from capture_proxy.families.parsing import ParsesByStream, content_text
from capture_proxy.families.qwen3 import QwenHermesStream

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})


def tool_properties(tools: Sequence[Any] | None, name: str) -> dict[str, Any]:
    """The JSON-schema ``properties`` of the tool ``name`` among ``tools`` (OpenAI shape)."""
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function", tool)
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            return dict(props) if isinstance(props, Mapping) else {}
    return {}


def _schema_type(schema: Any) -> tuple[str, bool]:
    """(the first non-null type, whether null is allowed) of a parameter's schema."""
    if not isinstance(schema, Mapping):
        return "string", False
    if "type" in schema:
        kind = schema["type"]
        kinds = [str(k).lower() for k in kind] if isinstance(kind, list) else [str(kind).lower()]
        non_null = [k for k in kinds if k != "null"]
        return (non_null[0] if non_null else "null"), "null" in kinds
    for option in schema.get("anyOf") or ():
        if isinstance(option, Mapping) and str(option.get("type", "")).lower() not in ("", "null"):
            nullable = any(
                isinstance(o, Mapping) and o.get("type") == "null" for o in schema["anyOf"]
            )
            return str(option["type"]).lower(), nullable
    return "string", False


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type says (vLLM's conversion rules)."""
    if schema is None:
        return value
    kind, nullable = _schema_type(schema)
    if nullable and value.lower() in ("null", "none"):
        return None
    if kind in _STRING_TYPES:
        return value
    if value.lower() in ("null", "none"):
        return None
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _param_end(text: str, start: int) -> int:
    """Index of the ``</parameter>`` that ends the value starting at ``start``: one followed
    by a newline and the next parameter or ``</function>`` (or the end); -1 if none."""
    pos = start
    while True:
        idx = text.find(PARAM_CLOSE, pos)
        if idx < 0:
            return -1
        after = text[idx + len(PARAM_CLOSE) :].lstrip("\n")
        if not after or after.startswith((PARAM_OPEN, FUNCTION_CLOSE)):
            return idx
        pos = idx + 1


def parse_xml_call(body: str, tools: Sequence[Any] | None) -> tuple[str, str] | None:
    """(name, arguments JSON) of ``<function=NAME>...</function>``; None if it is not one."""
    body = body.strip("\n")
    if not body.startswith(FUNCTION_OPEN) or not body.endswith(FUNCTION_CLOSE):
        return None
    head_end = body.find(">")
    name = body[len(FUNCTION_OPEN) : head_end]
    if head_end < 0 or not name or any(c in name for c in "<>{}\"' \t\n"):
        return None
    props = tool_properties(tools, name)
    inner = body[head_end + 1 : -len(FUNCTION_CLOSE)]
    params: dict[str, Any] = {}
    pos = 0
    while True:
        rest = inner[pos:].lstrip("\n")
        if not rest:
            break
        if not rest.startswith(PARAM_OPEN):
            return None
        start = len(inner) - len(rest)
        key_end = inner.find(">", start)
        if key_end < 0:
            return None
        key = inner[start + len(PARAM_OPEN) : key_end]
        end = _param_end(inner, key_end + 1)
        if end < 0:
            return None
        value = inner[key_end + 1 : end]
        value = value.removeprefix("\n").removesuffix("\n")
        params[key] = convert_value(value, props.get(key) if props else None)
        pos = end + len(PARAM_CLOSE)
    return name, json.dumps(params, ensure_ascii=False)


class Qwen3CoderStream(QwenHermesStream):
    """Incremental parser for one generation (see the module docstring)."""

    CONTENT_SEPARATOR = "\n\n"

    def __init__(
        self, id_seed: str, tools: Sequence[Any] | None, *, in_reasoning: bool = False
    ) -> None:
        super().__init__(id_seed, in_reasoning=in_reasoning)
        self.tools = tools

    def parse_call(self, body: str) -> tuple[str, str] | None:
        return parse_xml_call(body, self.tools)


class Qwen3CoderParser(ParsesByStream):
    family = "qwen3_coder"

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> Qwen3CoderStream:
        return Qwen3CoderStream(id_seed, tools, in_reasoning=in_reasoning)



def _xml_value(value: Any) -> str:
    """A parameter value as the template renders it: JSON for objects and arrays, else
    jinja's ``| string`` (Python ``str``: ``True``, ``None``, ``1.5``)."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def xml_tool_call(call: Mapping[str, Any]) -> str:
    """``<tool_call>\\n<function=N>\\n(<parameter=K>\\nV\\n</parameter>\\n)*</function>\\n
    </tool_call>``. Arguments: a JSON object, as a string or parsed."""
    fn = call.get("function", call)
    args = fn.get("arguments")
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    params = "".join(
        f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in (args or {}).items()
    )
    return f"<tool_call>\n<function={fn['name']}>\n{params}</function>\n</tool_call>"


def write_qwen3_coder(message: Mapping[str, Any]) -> str:
    """The exact text a Qwen3-Coder-layout model writes for an assistant turn (after
    ``<|im_start|>assistant\\n``, without ``<|im_end|>``); matches ``qwen3_coder.jinja``."""
    out = ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        out += f"<think>\n{reasoning}\n</think>\n\n"
    content = content_text(message.get("content"))
    out += content
    for i, call in enumerate(message.get("tool_calls") or []):
        out += "\n" if i else ("\n\n" if content else "")
        out += xml_tool_call(call)
    return out
