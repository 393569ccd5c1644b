"""The Qwen families' output layouts: what a Qwen3 (Hermes JSON) or Qwen3-Coder (XML) model
writes for an assistant turn, consistent with our templates (``templates/*.jinja``).

Pure text; tokenizing is the caller's (the family's tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from capture_proxy.tokenizer import content_text, render_assistant_generation

#: Qwen3 with Hermes JSON tool calls (the keep_reasoning template)
write_qwen3 = render_assistant_generation


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
