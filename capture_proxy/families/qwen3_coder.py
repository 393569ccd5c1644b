"""Qwen3-Coder output parser: text and XML tool calls, read as vLLM 0.32 reads them. Pure.

The generation layout the family writes (Qwen3-Coder / Qwen3.5 XML tool calls, and our
``templates/qwen3_coder.jinja``)::

    [ "<think>\n" REASONING "\n</think>\n\n" ] CONTENT
    [ ("\n\n" if CONTENT) TOOL_CALL ("\n" TOOL_CALL)* ]
    TOOL_CALL = "<tool_call>\n<function=" NAME ">\n" PARAMETER* "</function>\n</tool_call>"
    PARAMETER = "<parameter=" KEY ">\n" VALUE "\n</parameter>\n"

Parsing is vLLM 0.32's ``qwen3_coder`` tool parser (``vllm/parser/qwen3.py`` on the parser
engine of ``vllm/parser/engine/``, non-streaming, with the serving layer around it), which
Qwen3-Coder is served with and no reasoning parser (the model has no thinking mode): a
``<think>`` block is content. The rules:

- markup: a call opens at ``<tool_call>`` or at a bare ``<function=``; its name runs to the
  next ``>`` (the name is stripped; a ``>`` that ends another tag belongs to the name), its
  parameters to ``</function>``; ``</tool_call>`` closes the wrapper. A call left open at the
  end of the generation still counts (no ``</function>`` or ``</tool_call>`` needed). Text
  inside ``<tool_call>`` outside ``<function=...>`` and between calls is not content.
- parameters: every ``<parameter=KEY>VALUE`` up to the first ``</parameter>`` (so a value ends
  at a ``</parameter>`` written inside it) or up to the next ``<parameter=``; one newline on
  each side of a value is markup; a parameter open at ``</function>`` is dropped. Arguments are
  ``json.dumps(..., ensure_ascii=False)`` of the parameters in the order written.
- values: a parameter the tool's JSON schema types (``type``, a list of types, ``enum`` values'
  types, ``anyOf``/``oneOf``/``allOf``) is converted by the first of null, integer, number,
  boolean, object, array, string that the text is (``null``; ``int()``; a finite ``float()``,
  integral ones as integers; ``true``/``false``/``1``/``0``; JSON); when none is, the text's
  JSON value if it has one, else the text (so an integer ``5.0`` is ``5.0``, a boolean ``yes``
  stays ``"yes"``, an object written as a Python literal stays a string). A parameter the
  schema does not know, and every value of a tool the request does not offer, stays a string.
- content: the text before the first call, stripped when a call is made; text after or
  between calls is dropped when a call is made; a call without a name is no call.

A stream emits the content as it is decided (holding back only a partial tag and trailing
whitespace, which a call would strip) and each call when it ends; each piece of text is looked
at a bounded number of times. Deliberate differences from vLLM (docs/families.md): leading
whitespace of content before a call is kept (vLLM's own stream keeps it too; its non-streamed
answer strips it, which a stream cannot know when it sends the text).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from capture_proxy.families.parsing import (
    MessageDelta,
    ParsesByStream,
    content_text,
    tool_call_deltas,
)

TC_OPEN, TC_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
#: every tag vLLM's Qwen3 grammar lexes (a ``>`` that ends one of them is that tag's)
TAGS = (
    "<think>",
    "</think>",
    TC_OPEN,
    TC_CLOSE,
    FUNCTION_OPEN,
    FUNCTION_CLOSE,
    PARAM_OPEN,
    PARAM_CLOSE,
)
#: one parameter: its key and its value, which ends at the first ``</parameter>`` or before
#: the next ``<parameter=`` (spaces allowed inside the tags, as vLLM's pattern allows them)
_PARAMETER = re.compile(
    r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))",
    re.DOTALL,
)
_JSON_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')
_TYPE_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(
        ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
        "integer",
    ),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")


def _held_suffix(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``markers``."""
    for k in range(min(max(len(m) for m in markers) - 1, len(buf)), 0, -1):
        tail = buf[-k:]
        if any(len(m) > k and m.startswith(tail) for m in markers):
            return k
    return 0


def _find_first(buf: str, markers: Sequence[str]) -> tuple[int, str]:
    """(index, marker) of the earliest of ``markers`` in ``buf``; (-1, "") if none."""
    best, which = -1, ""
    for m in markers:
        idx = buf.find(m)
        if idx >= 0 and (best < 0 or idx < best):
            best, which = idx, m
    return best, which


# ---------------------------------------------------------------------- values
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


def schema_types(schema: Any) -> set[str]:
    """The types a parameter's schema allows (``string`` when it names none)."""
    if not isinstance(schema, Mapping):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    for k in kind if isinstance(kind, list) else [kind]:
        if isinstance(k, str):
            types.add(k)
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            types.add(_json_type(value))
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list):
            for option in options:
                types |= schema_types(option)
    return types or {"string"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for kind, name in ((int, "integer"), (float, "number"), (str, "string"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "object"


def _finite_json(text: str) -> tuple[bool, Any]:
    """(True, value) when ``text`` is JSON whose value has no infinity or NaN."""
    try:
        value = json.loads(text)
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False, None
    return True, value


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's types make of it (the module docstring)."""
    kinds = {_TYPE_ALIASES.get(k.strip().lower(), k.strip().lower()) for k in schema_types(schema)}
    for kind in _TYPE_ORDER:
        if kind not in kinds:
            continue
        if kind == "null":
            if value.lower() == "null":
                return None
        elif kind == "string":
            return value
        elif kind == "integer":
            try:
                return int(value)
            except ValueError:
                pass
        elif kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        elif kind == "boolean":
            word = value.lower().strip()
            if word in ("true", "1", "false", "0"):
                return word in ("true", "1")
        else:  # object, array: any JSON value
            ok, parsed = _finite_json(value)
            if ok:
                return parsed
    ok, parsed = _finite_json(value)
    return parsed if ok else value


def _trim_newline(value: str) -> str:
    return value.removeprefix("\n").removesuffix("\n")


def xml_arguments(raw: str, props: Mapping[str, Any]) -> str:
    """The arguments JSON of a call's parameter text (between its name's ``>`` and
    ``</function>``), values converted by ``props`` (the tool's schema properties)."""
    params: dict[str, Any] = {}
    for m in _PARAMETER.finditer(raw):
        params[m.group(1)] = _trim_newline(m.group(2))
    for key, text in params.items():
        schema = props.get(key)
        if isinstance(schema, Mapping):
            params[key] = convert_value(text, schema)
    return json.dumps(params, ensure_ascii=False)


def _json_call(raw: str) -> tuple[str, str]:
    """A call without a name whose body is JSON: (its ``name``, its ``arguments`` or
    ``parameters``, a string kept, else dumped; or the object without its name)."""
    try:
        obj = json.loads(raw.strip())
    except (ValueError, RecursionError):
        return "", raw
    if not isinstance(obj, dict):
        return "", raw
    name = obj.get("name", "")
    for key in ("arguments", "parameters"):
        if key in obj:
            value = obj[key]
            args = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            return (name if isinstance(name, str) else ""), args
    rest = {k: v for k, v in obj.items() if k != "name"}
    return (name if isinstance(name, str) else ""), json.dumps(rest, ensure_ascii=False)


def xml_call(name_text: str, raw: str, tools: Sequence[Any] | None) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call from its name text and its parameter text; None
    when it has no name (vLLM makes no call of it)."""
    name = name_text.strip()
    if not name and raw.strip():
        name, arguments = _json_call(raw)
    elif raw.strip():
        arguments = xml_arguments(raw, tool_properties(tools, name) if tools else {})
    else:
        arguments = "{}"
    return (name, arguments) if name else None


# ---------------------------------------------------------------------- stream
#: the tags that change each state (others are the state's text)
_MARKERS: dict[str, tuple[str, ...]] = {
    "content": (TC_OPEN, FUNCTION_OPEN),
    "preamble": (TC_CLOSE, FUNCTION_OPEN),
    "args": (FUNCTION_CLOSE,),
    "between": (TC_CLOSE, TC_OPEN, FUNCTION_OPEN),
}


class Qwen3CoderStream:
    """Incremental parser for one generation (the module docstring)."""

    def __init__(self, id_seed: str, tools: Sequence[Any] | None) -> None:
        self.id_seed = id_seed
        self.tools = tools
        self.state = "content"  # content | preamble | name | args | between
        self.buf = ""  # undecided text: a partial tag
        self.space = ""  # whitespace at the end of the content so far (a call strips it)
        self.spoke = False  # content other than whitespace was emitted
        self.slots = 0  # calls opened
        self.name: list[str] = []
        self.args: list[str] = []
        self.called = False  # a call was made: later text is not content
        self.after: list[str] = []  # text after the first call opened, while none was made
        self.num_calls = 0

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        self.buf += text
        out: list[MessageDelta] = []
        while self.buf and self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[MessageDelta]:
        out: list[MessageDelta] = []
        while self.buf and self._step(out, final=True):
            pass
        if self.state != "content" and self.state != "between":
            self._end_call(out)
        self.state = "content"
        if self.called:
            return out
        rest = self.space + "".join(self.after)
        if self.slots and not self.spoke and not rest.strip():
            return out  # only whitespace beside a call that was none: no content
        if rest:
            out.append(MessageDelta(content=rest))
        return out

    def _step(self, out: list[MessageDelta], *, final: bool) -> bool:
        """One transition; True when it consumed a tag and may continue."""
        if self.state == "name":
            return self._name(out, final)
        markers = _MARKERS[self.state]
        buf = self.buf
        idx, tag = _find_first(buf, markers)
        end = idx if idx >= 0 else len(buf) - (0 if final else _held_suffix(buf, markers))
        self._text(out, buf[:end])
        if idx < 0:
            self.buf = buf[end:]
            return False
        self.buf = buf[idx + len(tag) :]
        if tag == FUNCTION_CLOSE:
            self._end_call(out)
            self.state = "between"
        elif tag == TC_CLOSE:
            if self.state == "preamble":
                self._end_call(out)
            self.state = "content"
        else:  # <tool_call> or <function=
            if self.state != "preamble":
                self._open_call()
            self.state = "preamble" if tag == TC_OPEN else "name"
        return True

    def _name(self, out: list[MessageDelta], final: bool) -> bool:
        """The name runs to a ``>`` that ends no other tag, or ``</function>`` ends the call."""
        buf, i = self.buf, 0
        while i < len(buf):
            ch = buf[i]
            if ch == ">":
                self.name.append(buf[:i])
                self.buf, self.state = buf[i + 1 :], "args"
                return True
            if ch == "<":
                tag = next((t for t in TAGS if buf.startswith(t, i)), None)
                if tag == FUNCTION_CLOSE:
                    self.name.append(buf[:i])
                    self.buf = buf[i + len(tag) :]
                    self._end_call(out)
                    self.state = "between"
                    return True
                if tag is not None:
                    i += len(tag)
                    continue
                if not final and any(t.startswith(buf[i:]) for t in TAGS):
                    break
            i += 1
        self.name.append(buf[:i])
        self.buf = buf[i:]
        return False

    def _text(self, out: list[MessageDelta], text: str) -> None:
        """Text of the current state: content, a call's parameters, or nothing."""
        if not text:
            return
        if self.state == "args":
            self.args.append(text)
        elif self.state == "content":
            if self.slots:
                if not self.called:
                    self.after.append(text)
                return
            body = text.rstrip()
            if not body:
                self.space += text
                return
            out.append(MessageDelta(content=self.space + body))
            self.space, self.spoke = text[len(body) :], True

    def _open_call(self) -> None:
        self.slots += 1
        self.name, self.args = [], []

    def _end_call(self, out: list[MessageDelta]) -> None:
        call = xml_call("".join(self.name), "".join(self.args), self.tools)
        self.name, self.args = [], []
        if call is None:
            return
        if not self.called:
            self.called, self.after, self.space = True, [], ""
        out += tool_call_deltas(self.id_seed, self.num_calls, *call)
        self.num_calls += 1


#: a call's markup as vLLM's parser engine removes it from the text when the request's
#: ``tool_choice`` is none: an XML call through ``</function>`` and its ``</tool_call>``, a
#: ``<tool_call>`` wrapping a JSON body, a bare ``<function=`` call, or an open one to the end
_CALL_MARKUP = re.compile(
    r"<tool_call>(?:(?!<tool_call>).)*?</function>\s*</tool_call>"
    r"|<tool_call>\s*\{.*?</tool_call>|<tool_call>.*\Z|<function=.*?</function>|<function=.*\Z",
    re.DOTALL,
)


class _CallsRemoved:
    """``tool_choice`` none with tools: the text as content without the calls' markup
    (``_CALL_MARKUP``). The text before the first call's opening tag is sent as it comes;
    from that tag on it is held and its markup removed at the end (once)."""

    def __init__(self) -> None:
        self.buf = ""
        self.held = False

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        self.buf += text
        if self.held:
            return []
        idx, _ = _find_first(self.buf, (TC_OPEN, FUNCTION_OPEN))
        if idx >= 0:
            self.held = True
            out, self.buf = self.buf[:idx], self.buf[idx:]
        else:
            keep = _held_suffix(self.buf, (TC_OPEN, FUNCTION_OPEN))
            out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return [MessageDelta(content=out)] if out else []

    def finish(self) -> list[MessageDelta]:
        rest, self.buf = _CALL_MARKUP.sub("", self.buf), ""
        return [MessageDelta(content=rest)] if rest else []


class _CallsDropped:
    """No tools: the answer of ``auto`` without its calls (vLLM parses them, then drops
    them)."""

    def __init__(self, inner: Qwen3CoderStream) -> None:
        self.inner = inner

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        return [d for d in self.inner.feed(text, token_ids) if d.tool_call is None]

    def finish(self) -> list[MessageDelta]:
        return [d for d in self.inner.finish() if d.tool_call is None]


class Qwen3CoderParser(ParsesByStream):
    """vLLM's ``qwen3_coder`` tool parser without a reasoning parser (the module docstring):
    ``in_reasoning`` is ignored (Qwen3-Coder has no thinking mode, its prompts open none)."""

    family = "qwen3_coder"
    #: vLLM's ``structural_tag_model`` of the tool parser (``families.structural_tags``)
    tool_call_format = "qwen_3_coder"

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> Qwen3CoderStream:
        return Qwen3CoderStream(id_seed, tools)

    def stream_without_calls(
        self,
        id_seed: str,
        tools: Sequence[Any] | None = None,
        *,
        in_reasoning: bool = False,
        offered: bool = False,
    ) -> _CallsRemoved | _CallsDropped:
        """No tools (``offered`` false): ``auto``'s content, no calls; ``tool_choice`` none
        with tools: the text without the calls' markup (``families.tool_choice``)."""
        if offered:
            return _CallsRemoved()
        return _CallsDropped(Qwen3CoderStream(id_seed, tools))


# ---------------------------------------------------------------------- writer
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
