"""Generated texts the output-parser goldens are made of, and how vLLM serves each family.

Each case is one generation (the text after ``<|im_start|>assistant\\n`` or Llama's assistant
header, without the closing token) with the request's tools, for one way of serving a model
with vLLM 0.32 (``SERVINGS``: the tool-call parser and reasoning parser a user starts vLLM with
for that family, and the proxy families whose exact-token parser must give the same answer).
``tests/support/vllm_parser_oracle.py`` (run with vLLM's own Python by
``scripts/parser-goldens``) parses every case with vLLM's own parsers, whole and streamed, into
``tests/fixtures/parser_goldens/<serving>.json``; ``tests/families/test_parser_goldens.py``
compares the proxy's parsers with them.

A case the proxy answers differently on purpose carries ``deviation``: why (for a user), and
``proxy``, the proxy's exact answer; the test checks that answer and that vLLM's differs, and
docs/families.md lists the deviation.

``python -m tests.support.parser_cases OUT.json`` writes ``{"servings", "cases"}`` for the
oracle. Pure data: imports nothing of capture_proxy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: the request's tools (OpenAI shape): schema types for Qwen3-Coder's XML values
AGENT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout": {"type": "integer"},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                    "replace_all": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string"},
                    "max": {"type": "number"},
                    "opts": {"type": "object"},
                    "paths": {"type": "array", "items": {"type": "string"}},
                    "mode": {"enum": ["fast", "full"]},
                    "limit": {"type": ["integer", "null"]},
                    "note": {"type": ["string", "null"]},
                    "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                    "level": {"type": "int32"},
                    "blob": {"type": "whatever"},
                },
            },
        },
    },
]

#: serving name -> how vLLM is started for it, and the proxy families it checks
SERVINGS: dict[str, dict[str, Any]] = {
    "hermes": {
        "tool_parser": "hermes",
        "reasoning_parser": None,
        "tokenizer": "qwen2_5",
        "families": ["qwen2_5", "qwen3_vl"],
        "served_as": "Qwen2.5 / Qwen2.5-Coder / Qwen3-VL Instruct: "
        "--enable-auto-tool-choice --tool-call-parser hermes",
    },
    "hermes_qwen3": {
        "tool_parser": "hermes",
        "reasoning_parser": "qwen3",
        "tokenizer": "qwen3",
        "families": ["qwen3"],
        "served_as": "Qwen3 hybrid / 2507: --enable-auto-tool-choice --tool-call-parser "
        "hermes --reasoning-parser qwen3",
    },
    "qwen3_coder": {
        "tool_parser": "qwen3_coder",
        "reasoning_parser": None,
        "tokenizer": "qwen3",
        "families": ["qwen3_coder"],
        "served_as": "Qwen3-Coder (no thinking mode): --enable-auto-tool-choice "
        "--tool-call-parser qwen3_coder",
    },
    "llama3_json": {
        "tool_parser": "llama3_json",
        "reasoning_parser": None,
        "tokenizer": "llama3",
        "families": ["llama3"],
        "served_as": "Llama 3.1 / 3.3 Instruct: --enable-auto-tool-choice "
        "--tool-call-parser llama3_json",
    },
}


def _hermes(name: str, args: str) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + "}\n</tool_call>"


LS = _hermes("bash", '{"command": "ls"}')
PWD = _hermes("bash", '{"command": "pwd"}')

HERMES: dict[str, str] = {
    "plain": "Hello there.",
    "empty": "",
    "call_only": LS,
    "content_then_call": "Running.\n" + LS,
    "content_two_newlines_call": "Running.\n\n" + LS,
    "content_no_newline_call": "Running." + LS,
    "whitespace_only_before_call": "\n \n" + LS,
    "leading_whitespace_content_call": "\n Running.\n" + LS,
    "unclosed_call": '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}',
    "unclosed_call_newline": '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n',
    "text_after_call": LS + "\nDone.",
    "two_calls": LS + "\n" + PWD,
    "two_calls_text_between": LS + "\nand\n" + PWD,
    "second_call_unclosed": LS + '\n<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}',
    "bad_json_call": 'Try.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"'
    "\n</tool_call>",
    "second_call_bad_json": LS + '\n<tool_call>\n{"name": "bash", "arguments": {}\n</tool_call>',
    "cut_inside_call": 'Do.\n<tool_call>\n{"name": "bash", "argu',
    "args_json_string": _hermes("bash", '"{\\"command\\": \\"ls\\"}"'),
    "args_null": _hermes("bash", "null"),
    "args_list": _hermes("bash", "[1, 2]"),
    "missing_arguments": '<tool_call>\n{"name": "bash"}\n</tool_call>',
    "parameters_not_arguments": '<tool_call>\n{"name": "bash", "parameters": {}}\n</tool_call>',
    "name_not_string": '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
    "body_not_object": "<tool_call>\n[1, 2]\n</tool_call>",
    "empty_call": "<tool_call></tool_call>",
    "noncompact_args": '<tool_call>\n{"name":"bash","arguments":{"command":"caf\\u00e9","n":1.0}}'
    "\n</tool_call>",
    "unicode_nested_args": _hermes(
        "search", '{"pattern": "ü\\n日本", "opts": {"a": [1, 2.5, null, true]}}'
    ),
    "extra_keys": '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}, "id": 3}'
    "\n</tool_call>",
    "close_tag_inside_string": _hermes("bash", '{"command": "echo </tool_call> x"}'),
    "open_tag_inside_string": _hermes("bash", '{"command": "echo <tool_call> x"}'),
    "no_space_around_body": '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}'
    "</tool_call>",
    "markup_like_text": "Use <tool or <think a bit; x < y\n\n",
    "partial_open_tag_at_end": "Use <tool_",
    "close_tag_only": "Done </tool_call> here.",
    "think_as_text": "<think>\nhmm\n</think>\n\nAnswer.",
}

_THINK = "<think>\nplan it\n</think>\n\n"
HERMES_QWEN3: dict[str, str] = {
    "think_then_text": _THINK + "Answer.",
    "think_then_call": _THINK + LS,
    "think_content_call": _THINK + "Running.\n" + LS,
    "think_two_calls_text_between": _THINK + LS + "\nand\n" + PWD,
    "think_unclosed_call": _THINK + '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}',
    "think_text_after_call": _THINK + LS + "\nDone.",
    "think_args_json_string": _THINK + _hermes("bash", '"{\\"command\\": \\"ls\\"}"'),
    "think_bad_json_call": _THINK + '<tool_call>\n{"name": "bash"\n</tool_call>',
    "think_multiline": "<think>\nStep 1.\n\nStep 2.\n</think>\n\nDone.",
    "think_cut": "<think>\nhalf a thou",
    "no_think_block": "Hello there.",
    "call_inside_think": "<think>\nplan it " + LS,
}
#: Qwen3-2507 Thinking: the generation prompt opened ``<think>\n``
HERMES_QWEN3_OPENED: dict[str, str] = {
    "opened_think_then_text": "plan it\n</think>\n\nAnswer.",
    "opened_think_then_call": "plan it\n</think>\n\n" + LS,
}

_F = "<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _xml(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return _F.format(name=name, params=body)


XLS = _xml("bash", ("command", "ls"))
XPWD = _xml("bash", ("command", "pwd"))
QWEN3_CODER: dict[str, str] = {
    "plain": "Hello there.",
    "empty": "",
    "call_only": XLS,
    "content_then_call": "Running.\n\n" + XLS,
    "content_one_newline_call": "Running.\n" + XLS,
    "content_no_newline_call": "Running." + XLS,
    "whitespace_only_before_call": "\n \n" + XLS,
    "leading_whitespace_content_call": "\n Running.\n\n" + XLS,
    "trailing_whitespace_no_call": "Running.\n\n",
    "whitespace_only_text": "\n\n",
    "two_calls": XLS + "\n" + XPWD,
    "first_call_unnamed": "<tool_call>\n<function=>\n</function>\n</tool_call>\nThen.\n" + XLS,
    "unnamed_call_then_text": "Hi.\n<tool_call>\n<function=>\n</function>\n</tool_call>\nThen.",
    "text_after_call": XLS + "\nDone.",
    "text_between_calls": XLS + "\nand\n" + XPWD,
    "int_value": _xml("bash", ("command", "ls"), ("timeout", "5")),
    "int_as_float": _xml("bash", ("command", "ls"), ("timeout", "5.0")),
    "int_garbage": _xml("bash", ("command", "ls"), ("timeout", "abc")),
    "int_padded": _xml("bash", ("command", "ls"), ("timeout", " 7 ")),
    "number_int": _xml("search", ("pattern", "x"), ("max", "7")),
    "number_float": _xml("search", ("pattern", "x"), ("max", "2.5")),
    "number_exp": _xml("search", ("pattern", "x"), ("max", "1e3")),
    "number_inf": _xml("search", ("pattern", "x"), ("max", "inf")),
    "bool_true": _xml("edit", ("path", "a"), ("replace_all", "true")),
    "bool_True": _xml("edit", ("path", "a"), ("replace_all", "True")),
    "bool_yes": _xml("edit", ("path", "a"), ("replace_all", "yes")),
    "bool_one": _xml("edit", ("path", "a"), ("replace_all", "1")),
    "bool_false": _xml("edit", ("path", "a"), ("replace_all", "false")),
    "object_json": _xml("search", ("pattern", "x"), ("opts", '{"a": 1, "b": null}')),
    "object_pylit": _xml("search", ("pattern", "x"), ("opts", "{'a': 1, 'b': None}")),
    "object_bad": _xml("search", ("pattern", "x"), ("opts", "{not json")),
    "array_json": _xml("search", ("paths", '["a", "b"]')),
    "array_pylit": _xml("search", ("paths", "['a', 'b']")),
    "enum_value": _xml("search", ("mode", "fast")),
    "nullable_int_null": _xml("search", ("limit", "null")),
    "nullable_int_None": _xml("search", ("limit", "None")),
    "nullable_string_null": _xml("search", ("note", "null")),
    "anyof_string_int": _xml("search", ("either", "5")),
    "alias_type_int32": _xml("search", ("level", "12")),
    "unknown_type": _xml("search", ("blob", "42")),
    "string_null": _xml("bash", ("command", "null")),
    "string_json_looking": _xml("bash", ("command", '{"a": 1}')),
    "unknown_param": _xml("bash", ("command", "ls"), ("cwd", "42")),
    "unknown_tool": _xml("deploy", ("target", "prod"), ("n", "3")),
    "value_extra_newlines": _xml("bash", ("command", "\nls\n")),
    "value_multiline": _xml("bash", ("command", "cat <<EOF\na > b\nEOF")),
    "value_with_param_close": _xml("bash", ("command", "echo </parameter> done")),
    "value_with_function_close": _xml("bash", ("command", "echo </function> done")),
    "value_with_tool_call_close": _xml("bash", ("command", "echo </tool_call> done")),
    "value_unicode": _xml("bash", ("command", "echo 'ünï ✓ 日本' \\n \"q\"")),
    "param_no_newlines": "<tool_call>\n<function=bash>\n<parameter=command>ls</parameter>\n"
    "</function>\n</tool_call>",
    "param_unclosed_next_param": "<tool_call>\n<function=bash>\n<parameter=command>\nls\n"
    "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>",
    "param_unclosed_at_end": "<tool_call>\n<function=bash>\n<parameter=command>\nls\n"
    "</function>\n</tool_call>",
    "duplicate_param": _xml("bash", ("command", "ls"), ("command", "pwd")),
    "no_params": "<tool_call>\n<function=bash>\n</function>\n</tool_call>",
    "unclosed_call": "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n"
    "</function>",
    "missing_function_close": "<tool_call>\n<function=bash>\n<parameter=command>\nls\n"
    "</parameter>\n</tool_call>",
    "missing_function_close_text_after": "<tool_call>\n<function=bash>\n<parameter=command>\n"
    "ls\n</parameter>\n</tool_call>\nDone.",
    "bare_function": "<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>",
    "bare_function_after_text": "Running.\n<function=bash>\n<parameter=command>\nls\n"
    "</parameter>\n</function>",
    "cut_inside_value": "Do.\n\n<tool_call>\n<function=bash>\n<parameter=command>\nls -l",
    "cut_inside_name": "Do.\n\n<tool_call>\n<function=ba",
    "cut_after_open": "Do.\n\n<tool_call>\n",
    "empty_name": "<tool_call>\n<function=>\n<parameter=command>\nls\n</parameter>\n"
    "</function>\n</tool_call>",
    "name_with_spaces": "<tool_call>\n<function= bash >\n<parameter=command>\nls\n</parameter>\n"
    "</function>\n</tool_call>",
    "json_body_in_tool_call": 'Hi <tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call> bye',
    "think_then_call": "<think>\nplan it\n</think>\n\n" + XLS,
    "think_then_text": "<think>\nplan it\n</think>\n\nAnswer.",
    "close_think_only": "Done.</think> more",
    "markup_like_text": "Use <tool or <function a bit; x < y > z\n\n",
    "partial_open_tag_at_end": "Use <tool_",
}

LLAMA3: dict[str, str] = {
    "call_parameters": '{"name": "bash", "parameters": {"command": "ls -la"}}',
    "call_arguments": '{"name": "bash", "arguments": {"command": "ls"}}',
    "python_tag": '<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}',
    "two_calls_semicolon": '{"name": "bash", "parameters": {"command": "ls"}}; '
    '{"name": "bash", "parameters": {"command": "pwd"}}',
    "text_before_call": 'Sure: {"name": "bash", "parameters": {"command": "ls"}}',
    "text_after_call": '{"name": "bash", "parameters": {"command": "ls"}} done',
    "leading_ws": '\n {"name": "bash", "parameters": {"command": "ls"}}',
    "params_string": '{"name": "bash", "parameters": "{\\"command\\": \\"ls\\"}"}',
    "unicode_nested": '{"name": "search", "parameters": {"pattern": "ü\\n日本", '
    '"opts": {"a": [1, 2.5, null, true]}}}',
    "not_a_call_json": '{"answer": 42}',
    "plain": "Hello there.",
    "name_only": '{"name": "bash"}',
    "int_float": '{"name": "bash", "parameters": {"command": "ls", "timeout": 5.0}}',
    "escaped_unicode": '{"name": "bash", "parameters": {"command": "caf\\u00e9"}}',
    "broken_json": '{"name": "bash", "parameters": {"command": }',
    "two_calls_text_between": '{"name": "bash", "parameters": {"command": "ls"}}\nthen '
    '{"name": "bash", "parameters": {"command": "pwd"}}',
    "later_object_not_a_call": '{"name": "bash", "parameters": {"command": "ls"}}; {"x": 1}',
    "braces_in_prose": "Use {} for sets and {a: 1} for dicts.",
    "python_tag_builtin": '<|python_tag|>brave_search.call(query="x")',
}

#: thinking switched off for a Qwen3 hybrid request (its prompt closes an empty think block)
NO_THINKING = {"enable_thinking": False}
#: serving -> case name -> the case without its tools
_CASES: dict[str, dict[str, dict[str, Any]]] = {
    "hermes": {name: {"text": text} for name, text in HERMES.items()},
    "hermes_qwen3": {
        **{
            f"no_thinking_{name}": {"text": text, "chat_template_kwargs": NO_THINKING}
            for name, text in HERMES.items()
        },
        **{name: {"text": text} for name, text in HERMES_QWEN3.items()},
        **{
            name: {"text": text, "in_reasoning": True} for name, text in HERMES_QWEN3_OPENED.items()
        },
    },
    "qwen3_coder": {name: {"text": text} for name, text in QWEN3_CODER.items()},
    "llama3_json": {name: {"text": text} for name, text in LLAMA3.items()},
}


def _answer(content: str | None, reasoning: str | None, *calls: tuple[str, str]) -> dict:
    return {
        "content": content,
        "reasoning": reasoning,
        "tool_calls": [{"name": n, "arguments": a} for n, a in calls],
    }


#: why the qwen3 family reads a think block as it does (docs/families.md, "Parsing")
REASONING_LAYOUT = (
    "vLLM's answer depends on the reasoning parser it was started with and on enable_thinking, "
    "which the proxy does not know: with --reasoning-parser qwen3 it keeps the think block's "
    "newlines in the reasoning and the two after </think> in the content, and answers a "
    "generation without a think block as reasoning while thinking is on; without a reasoning "
    "parser the block is content. The proxy reads the think block the model wrote, without "
    "the layout's newlines (the message the Qwen3 templates render back to the same text); "
    "the tool calls are vLLM's either way."
)
#: why a Llama 3 call counts only at the start of the generation
LLAMA3_CALL_AT_START = (
    "vLLM's two paths disagree: its stream answers text before a JSON call as content (the "
    "proxy's answer); its non-streamed parser takes the object out of the text and drops the "
    "text around it. A stream can follow that only by holding back every answer's text to "
    "the end of the generation, since a later object could still make it a call."
)
#: why Qwen3-Coder's content keeps its leading whitespace before a call
CODER_LEADING_SPACE = (
    "vLLM's non-streamed parser strips the content when a call follows; a stream sends the "
    "content before it knows whether a call follows, so the proxy strips only the whitespace "
    "before the call (vLLM's own stream keeps the leading whitespace too)."
)
LS_CALL = ("bash", '{"command": "ls"}')
PWD_CALL = ("bash", '{"command": "pwd"}')
#: deliberate differences: serving -> case -> {"why", "proxy": the proxy's exact answer}
DEVIATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "hermes_qwen3": {
        name: {"why": REASONING_LAYOUT, "proxy": answer}
        for name, answer in {
            "no_thinking_think_as_text": _answer("Answer.", "hmm"),
            "think_then_text": _answer("Answer.", "plan it"),
            "think_then_call": _answer(None, "plan it", LS_CALL),
            "think_content_call": _answer("Running.\n", "plan it", LS_CALL),
            "think_two_calls_text_between": _answer(None, "plan it", LS_CALL, PWD_CALL),
            "think_unclosed_call": _answer(None, "plan it", LS_CALL),
            "think_text_after_call": _answer(None, "plan it", LS_CALL),
            "think_args_json_string": _answer(
                None, "plan it", ("bash", '"{\\"command\\": \\"ls\\"}"')
            ),
            "think_bad_json_call": _answer('<tool_call>\n{"name": "bash"\n</tool_call>', "plan it"),
            "think_multiline": _answer("Done.", "Step 1.\n\nStep 2."),
            "think_cut": _answer(None, "half a thou"),
            "no_think_block": _answer("Hello there.", None),
            "call_inside_think": _answer(None, "plan it ", LS_CALL),
            "opened_think_then_text": _answer("Answer.", "plan it"),
            "opened_think_then_call": _answer(None, "plan it", LS_CALL),
        }.items()
    },
    "qwen3_coder": {
        "leading_whitespace_content_call": {
            "why": CODER_LEADING_SPACE,
            "proxy": _answer("\n Running.", None, LS_CALL),
        },
    },
    "llama3_json": {
        "text_before_call": {
            "why": LLAMA3_CALL_AT_START,
            "proxy": _answer('Sure: {"name": "bash", "parameters": {"command": "ls"}}', None),
        },
    },
}


def cases() -> dict[str, dict[str, dict[str, Any]]]:
    """serving -> case name -> ``{"text", "tools", "chat_template_kwargs"?, "in_reasoning"?,
    "deviation"?}`` (tools: the agent's; ``in_reasoning``: the prompt opened ``<think>``)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for serving, named in _CASES.items():
        out[serving] = {}
        for name, base in named.items():
            case: dict[str, Any] = {**base, "tools": AGENT_TOOLS}
            deviation = DEVIATIONS.get(serving, {}).get(name)
            if deviation is not None:
                case["deviation"] = deviation
            out[serving][name] = case
    return out


def main(argv: list[str]) -> None:
    Path(argv[1]).write_text(
        json.dumps({"servings": SERVINGS, "cases": cases()}, ensure_ascii=False, indent=1),
        encoding="utf-8",
    )


if __name__ == "__main__":
    main(sys.argv)
