"""The Anthropic Messages front codec: parse, encode, stream events, errors, count_tokens."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from capture_proxy.core.fronts.base import (
    Answer,
    Api,
    InvalidFrontRequest,
    open_reasoning,
    seal_reasoning,
)
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.fronts.messages.encode import encode_count_tokens
from capture_proxy.core.fronts.messages.options import MessagesOptions
from capture_proxy.core.fronts.messages.parse import parse_count_tokens
from capture_proxy.core.linking.digests import canonical_turn, history_digest

CODEC = MessagesCodec()
CALL_ID = "call-0123456789abcdef0123456789abcdef"
EARLIER_CALL_ID = "call-ffffffffffffffffffffffffffffffff"

BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
    "required": ["command"],
}
READ_SCHEMA = {
    "type": "object",
    "properties": {"file_path": {"type": "string"}},
    "required": ["file_path"],
}


def claude_code_body() -> dict[str, Any]:
    """A body shaped like Claude Code 2.1.328's second request of a tool loop."""
    earlier_signature = seal_reasoning(EARLIER_CALL_ID, "The user wants the file list.")
    return {
        "model": "qwen3-8b",
        "max_tokens": 32000,
        "stream": True,
        "metadata": {"user_id": "user_abc_account__session_123"},
        "thinking": {"type": "enabled", "budget_tokens": 31999, "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {
                "type": "text",
                "text": "You are an interactive CLI tool that helps users.",
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "tools": [
            {"name": "Bash", "description": "Run a shell command.", "input_schema": BASH_SCHEMA},
            {"name": "Read", "description": "Read a file.", "input_schema": READ_SCHEMA},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<system-reminder>\nAs you answer, use the context.\n"
                        "</system-reminder>",
                    },
                    {
                        "type": "text",
                        "text": "<system-reminder>\ntoday is 2026-01-01\n</system-reminder>",
                    },
                    {
                        "type": "text",
                        "text": "List the files, then read README.md",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "", "signature": earlier_signature},
                    {"type": "text", "text": "I'll look."},
                    {
                        "type": "tool_use",
                        "id": "call_bash1",
                        "name": "Bash",
                        "input": {"command": "ls -la", "timeout": 10},
                    },
                    {
                        "type": "tool_use",
                        "id": "call_read1",
                        "name": "Read",
                        "input": {"file_path": "/w/READMÉ.md"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_bash1", "content": "a\nb"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_read1",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "File does not exist."},
                            {"type": "text", "text": "Did you mean README.md?"},
                        ],
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "<system-reminder>\nkeep going\n</system-reminder>"},
                ],
            },
        ],
    }


def test_parse_claude_code_body() -> None:
    body = claude_code_body()
    original = copy.deepcopy(body)
    request = CODEC.parse(body)
    assert body == original  # not changed in place
    assert request.api is Api.MESSAGES
    assert request.stream is True
    assert request.chat == {
        "model": "qwen3-8b",
        "max_tokens": 32000,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": True},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "Bash",
                    "description": "Run a shell command.",
                    "parameters": BASH_SCHEMA,
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "Read",
                    "description": "Read a file.",
                    "parameters": READ_SCHEMA,
                },
            },
        ],
        "messages": [
            {
                "role": "system",
                "content": "You are Claude Code, Anthropic's official CLI for Claude.\n"
                "You are an interactive CLI tool that helps users.",
            },
            {
                "role": "user",
                "content": "<system-reminder>\nAs you answer, use the context.\n"
                "</system-reminder>\n<system-reminder>\ntoday is 2026-01-01\n</system-reminder>\n"
                "List the files, then read README.md",
            },
            {
                "role": "assistant",
                "content": "I'll look.",
                "reasoning_content": "The user wants the file list.",
                "tool_calls": [
                    {
                        "id": "call_bash1",
                        "type": "function",
                        "function": {
                            "name": "Bash",
                            "arguments": '{"command": "ls -la", "timeout": 10}',
                        },
                    },
                    {
                        "id": "call_read1",
                        "type": "function",
                        "function": {"name": "Read", "arguments": '{"file_path": "/w/READMÉ.md"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_bash1", "content": "a\nb"},
            {
                "role": "tool",
                "tool_call_id": "call_read1",
                "content": "Error: File does not exist.\nDid you mean README.md?",
            },
            {"role": "user", "content": "<system-reminder>\nkeep going\n</system-reminder>"},
        ],
    }
    assert request.options == MessagesOptions(
        thinking={"type": "enabled", "budget_tokens": 31999, "display": "omitted"},
        omit_thinking=True,
        tool_errors=("call_read1",),
        reasoning_hints=(EARLIER_CALL_ID,),
    )
    assert request.received == {k: v for k, v in original.items() if k != "messages"}


def test_a_system_message_inside_messages_is_a_canonical_system_message() -> None:
    """Claude Code 2.1.328 puts its ``# Environment`` block in ``messages`` as ``role:
    "system"``, after the task: a one-block list with ``cache_control`` in the first request, a
    plain string from the second on. Both are the same canonical system message in its place,
    so the history digest (and the rendered prompt) does not change between the calls."""
    env = "# Environment\nYou have been invoked in the following environment:\n - cwd: /w"
    first = {
        "model": "m",
        "max_tokens": 5,
        "system": "You are Claude Code.",
        "messages": [
            {"role": "user", "content": "Do the task."},
            {
                "role": "system",
                "content": [{"type": "text", "text": env, "cache_control": {"type": "ephemeral"}}],
            },
        ],
    }
    later = copy.deepcopy(first)
    later["messages"][1]["content"] = env
    expected = [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "Do the task."},
        {"role": "system", "content": env},
    ]
    assert CODEC.parse(first).chat["messages"] == expected
    assert CODEC.parse(later).chat["messages"] == expected
    two_blocks = copy.deepcopy(first)
    two_blocks["messages"][1]["content"] = [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    assert CODEC.parse(two_blocks).chat["messages"][2] == {"role": "system", "content": "a\nb"}


def test_parse_small_shapes() -> None:
    request = CODEC.parse(
        {
            "model": "m",
            "max_tokens": 5,
            "system": "be brief",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ],
            "stop_sequences": ["\n\nHuman:", "END"],
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "service_tier": "auto",
            "stream": False,
            "thinking": {"type": "disabled"},
        }
    )
    assert request.stream is False
    assert request.chat == {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ],
        "stop": ["\n\nHuman:", "END"],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert request.options.thinking == {"type": "disabled"}
    assert request.options.prefill is False


def test_parse_adaptive_thinking_leaves_the_template_default() -> None:
    request = CODEC.parse(
        {
            "model": "m",
            "max_tokens": 5,
            "thinking": {"type": "adaptive"},
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    assert "chat_template_kwargs" not in request.chat
    assert request.options.thinking == {"type": "adaptive"}
    assert request.options.omit_thinking is False


def test_parse_tool_results_keep_their_order_and_empty_content() -> None:
    request = CODEC.parse(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "one"},
                        {"type": "tool_result", "tool_use_id": "t1"},
                        {"type": "text", "text": "two"},
                        {"type": "text", "text": "three"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t2",
                            "content": [],
                            "is_error": False,
                        },
                    ],
                }
            ],
        }
    )
    assert request.chat["messages"] == [
        {"role": "user", "content": "one"},
        {"role": "tool", "tool_call_id": "t1", "content": ""},
        {"role": "user", "content": "two\nthree"},
        {"role": "tool", "tool_call_id": "t2", "content": ""},
    ]
    assert request.options.tool_errors == ()


def test_parse_assistant_thinking_variants() -> None:
    sealed = seal_reasoning(EARLIER_CALL_ID, "hidden")
    request = CODEC.parse(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        # a foreign signature: the visible text is the reasoning
                        {"type": "thinking", "thinking": "visible", "signature": "EqQBCkYIBxgC"},
                        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va"},  # ignored
                        {"type": "redacted_thinking", "data": sealed},
                        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                        {"type": "text", "text": "b"},
                    ],
                },
                {"role": "user", "content": "next"},
                # a tampered value does not open: the (empty) visible text is all there is
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "", "signature": sealed[:-1] + "0"},
                        {"type": "tool_use", "id": "x", "name": "Bash", "input": {}},
                    ],
                },
            ],
        }
    )
    assert request.chat["messages"][1] == {
        "role": "assistant",
        # several blocks of a kind are one text (Anthropic's meaning; the stream splits so)
        "content": "ab",
        "reasoning_content": "visiblehidden",
    }
    assert request.chat["messages"][3] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}
        ],
    }
    assert request.options.reasoning_hints == (EARLIER_CALL_ID,)
    assert request.options.prefill is True


def test_parse_tools_server_tools_and_tool_choice() -> None:
    web_search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    bash = {"type": "bash_20250124", "name": "bash"}

    def parse(tool_choice: Any) -> Any:
        return CODEC.parse(
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [
                    web_search,
                    {"type": "custom", "name": "Bash", "input_schema": BASH_SCHEMA},
                    bash,
                ],
                "tool_choice": tool_choice,
            }
        )

    request = parse({"type": "auto"})
    assert request.chat["tools"] == [
        {"type": "function", "function": {"name": "Bash", "parameters": BASH_SCHEMA}}
    ]
    assert request.options.server_tools == (web_search, bash)
    [diagnostic] = request.diagnostics
    assert diagnostic.to_json() == {
        "kind": "tools_not_rendered",
        "details": {
            "tools": [
                {"type": "web_search_20250305", "name": "web_search"},
                {"type": "bash_20250124", "name": "bash"},
            ]
        },
    }
    assert request.chat["tool_choice"] == "auto"
    assert "parallel_tool_calls" not in request.chat

    request = parse({"type": "any", "disable_parallel_tool_use": True})
    assert request.chat["tool_choice"] == "required"
    assert request.chat["parallel_tool_calls"] is False

    request = parse({"type": "tool", "name": "Bash", "disable_parallel_tool_use": False})
    assert request.chat["tool_choice"] == {"type": "function", "function": {"name": "Bash"}}
    assert "parallel_tool_calls" not in request.chat

    assert parse({"type": "none"}).chat["tool_choice"] == "none"


def test_parse_only_server_tools_sends_no_tools() -> None:
    request = CODEC.parse(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "auto"},
        }
    )
    assert "tools" not in request.chat
    assert "tool_choice" not in request.chat
    assert [d.kind for d in request.diagnostics] == ["tools_not_rendered"]


def test_parse_without_server_tools_has_no_diagnostic() -> None:
    request = CODEC.parse(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "Bash", "input_schema": BASH_SCHEMA}],
        }
    )
    assert request.diagnostics == ()


BASE = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


def _with(**fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(BASE), **fields}


def _user(*blocks: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


def _assistant(*blocks: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": list(blocks)}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 5, "messages": BASE["messages"]}, "model"),
        (_with(model=""), "model"),
        (_with(model=3), "model"),
        ({"model": "m", "messages": BASE["messages"]}, "max_tokens"),
        (_with(max_tokens=0), "max_tokens"),
        (_with(max_tokens=True), "max_tokens"),
        (_with(max_tokens="5"), "max_tokens"),
        ({"model": "m", "max_tokens": 5}, "messages"),
        (_with(messages=[]), "messages"),
        (_with(messages={"role": "user"}), "messages"),
        (_with(messages=["hi"]), "messages.0"),
        (_with(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
        (_with(messages=[{"role": "system", "content": 3}]), "messages.0.content"),
        (
            _with(messages=[{"role": "system", "content": [{"type": "image"}]}]),
            "messages.0.content.0.type",
        ),
        (_with(messages=[{"role": "user"}]), "messages.0.content"),
        (_with(messages=[{"role": "user", "content": []}]), "messages.0.content"),
        (_with(messages=[{"role": "user", "content": 3}]), "messages.0.content"),
        (_with(messages=_user("text")), "messages.0.content.0"),
        (_with(messages=_user({"text": "x"})), "messages.0.content.0.type"),
        (_with(messages=_user({"type": "text"})), "messages.0.content.0.text"),
        # (parsed without image limits: images are refused, naming the image's data)
        (
            _with(messages=_user({"type": "text", "text": "x"}, IMAGE)),
            "messages.0.content.1.source.data",
        ),
        (
            _with(messages=_user({"type": "document", "source": {"type": "text", "data": "d"}})),
            "messages.0.content.0.type",
        ),
        (_with(messages=_user({"type": "tool_result"})), "messages.0.content.0.tool_use_id"),
        (
            _with(messages=_user({"type": "tool_result", "tool_use_id": "t", "content": 3})),
            "messages.0.content.0.content",
        ),
        (
            _with(
                messages=_user(
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "text", "text": "x"}, IMAGE],
                    }
                )
            ),
            "messages.0.content.0.content.1.source.data",
        ),
        (
            _with(messages=_user({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"})),
            "messages.0.content.0.is_error",
        ),
        (_with(messages=_assistant(IMAGE)), "messages.1.content.0.type"),
        (
            _with(
                messages=_assistant({"type": "server_tool_use", "id": "s", "name": "web_search"})
            ),
            "messages.1.content.0.type",
        ),
        (_with(messages=_assistant({"type": "thinking"})), "messages.1.content.0.thinking"),
        (
            _with(messages=_assistant({"type": "thinking", "thinking": "", "signature": 1})),
            "messages.1.content.0.signature",
        ),
        (_with(messages=_assistant({"type": "redacted_thinking"})), "messages.1.content.0.data"),
        (
            _with(messages=_assistant({"type": "tool_use", "name": "B", "input": {}})),
            "messages.1.content.0.id",
        ),
        (
            _with(messages=_assistant({"type": "tool_use", "id": "i", "input": {}})),
            "messages.1.content.0.name",
        ),
        (
            _with(messages=_assistant({"type": "tool_use", "id": "i", "name": "B", "input": "{}"})),
            "messages.1.content.0.input",
        ),
        (_with(system=3), "system"),
        (_with(system=[{"type": "image"}]), "system.0.type"),
        (_with(system=[{"type": "text", "text": None}]), "system.0.text"),
        (_with(tools={}), "tools"),
        (_with(tools=[{"input_schema": {}}]), "tools.0.name"),
        (_with(tools=[{"name": "B"}]), "tools.0.input_schema"),
        (_with(tools=[{"name": "B", "input_schema": {}, "description": 1}]), "tools.0.description"),
        (_with(tools=[{"type": 1, "name": "B"}]), "tools.0.type"),
        (_with(tool_choice="auto"), "tool_choice"),
        (_with(tool_choice={"type": "sometimes"}), "tool_choice.type"),
        (_with(tool_choice={"type": "any"}), "tool_choice.type"),
        (_with(tool_choice={"type": "tool"}), "tool_choice.name"),
        (_with(tool_choice={"type": "tool", "name": "Nope"}), "tool_choice.name"),
        (
            _with(tool_choice={"type": "auto", "disable_parallel_tool_use": "no"}),
            "tool_choice.disable_parallel_tool_use",
        ),
        (_with(stop_sequences="END"), "stop_sequences"),
        (_with(stop_sequences=["a", 2]), "stop_sequences.1"),
        (_with(stop_sequences=["a", ""]), "stop_sequences.1"),
        (_with(temperature="hot"), "temperature"),
        (_with(temperature=1.5), "temperature"),
        (_with(temperature=-0.1), "temperature"),
        (_with(top_p=True), "top_p"),
        (_with(top_p=0), "top_p"),
        (_with(top_p=1.01), "top_p"),
        (_with(top_k=0.5), "top_k"),
        (_with(top_k=-1), "top_k"),
        (_with(stream="yes"), "stream"),
        (_with(thinking=True), "thinking"),
        (_with(thinking={"type": "on"}), "thinking.type"),
        (_with(thinking={"type": "enabled"}), "thinking.budget_tokens"),
        (_with(thinking={"type": "enabled", "budget_tokens": 0}), "thinking.budget_tokens"),
        (
            _with(thinking={"type": "enabled", "budget_tokens": 2048, "display": 1}),
            "thinking.display",
        ),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidFrontRequest) as info:
        CODEC.parse(body)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: ")


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0, "top_p": 1, "top_k": 0},
        {"temperature": 1, "top_p": 1e-6, "top_k": 500, "stop_sequences": []},
    ],
)
def test_sampling_at_the_edges_of_its_ranges_is_mapped(sampling: dict[str, Any]) -> None:
    chat = CODEC.parse(_with(**sampling)).chat
    mapped = {"stop" if k == "stop_sequences" else k: v for k, v in sampling.items()}
    assert {k: chat[k] for k in mapped} == mapped


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidFrontRequest) as info:
        CODEC.parse([])  # type: ignore[arg-type]
    assert info.value.param == "body"


# -- encode ------------------------------------------------------------------------------------

ANSWER_MESSAGE = {
    "role": "assistant",
    "content": "Let me check both.",
    "reasoning_content": "I should list the files and read the README.",
    "tool_calls": [
        {
            "id": "call_a1",
            "type": "function",
            "function": {"name": "Bash", "arguments": '{"command": "ls -la"}'},
        },
        {
            "id": "call_b2",
            "type": "function",
            "function": {"name": "Read", "arguments": '{"file_path": "/w/é.md", "limit": 20}'},
        },
    ],
}


def _answer(message: dict[str, Any] | None = None, **fields: Any) -> Answer:
    values: dict[str, Any] = {
        "call_id": CALL_ID,
        "created_at": 1700000000.0,
        "model": "qwen3-8b",
        "message": ANSWER_MESSAGE if message is None else message,
        "finish_reason": "tool_calls",
        "usage": {"prompt_tokens": 120, "completion_tokens": 45, "total_tokens": 165},
    }
    values.update(fields)
    return Answer(**values)


def _request(**fields: Any) -> Any:
    return CODEC.parse(_with(**fields))


def test_encode() -> None:
    answer = _answer()
    assert CODEC.encode(_request(), answer) == {
        "id": "msg_0123456789abcdef0123456789abcdef",
        "type": "message",
        "role": "assistant",
        "model": "qwen3-8b",
        "content": [
            {
                "type": "thinking",
                "thinking": "I should list the files and read the README.",
                "signature": seal_reasoning(
                    CALL_ID, "I should list the files and read the README."
                ),
            },
            {"type": "text", "text": "Let me check both."},
            {"type": "tool_use", "id": "call_a1", "name": "Bash", "input": {"command": "ls -la"}},
            {
                "type": "tool_use",
                "id": "call_b2",
                "name": "Read",
                "input": {"file_path": "/w/é.md", "limit": 20},
            },
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 120,
            "output_tokens": 45,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def test_encode_omitted_thinking_still_seals_the_text() -> None:
    request = _request(thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    block = CODEC.encode(request, _answer())["content"][0]
    assert block["thinking"] == ""
    assert open_reasoning(block["signature"]) == (
        CALL_ID,
        "I should list the files and read the README.",
    )


@pytest.mark.parametrize(
    ("finish_reason", "message", "expected"),
    [
        ("stop", {"role": "assistant", "content": "done"}, "end_turn"),
        ("length", {"role": "assistant", "content": "trunc"}, "max_tokens"),
        ("length", ANSWER_MESSAGE, "max_tokens"),
        ("tool_calls", ANSWER_MESSAGE, "tool_use"),
        ("stop", ANSWER_MESSAGE, "tool_use"),
        (None, {"role": "assistant", "content": "x"}, "end_turn"),
    ],
)
def test_stop_reasons(finish_reason: str | None, message: dict[str, Any], expected: str) -> None:
    body = CODEC.encode(_request(), _answer(message, finish_reason=finish_reason))
    assert body["stop_reason"] == expected


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "message", "expected"),
    [
        ("stop", " files", {"role": "assistant", "content": "Here"}, ("stop_sequence", " files")),
        ("stop", "other", {"role": "assistant", "content": "Here"}, ("end_turn", None)),
        ("stop", 151645, {"role": "assistant", "content": "Here"}, ("end_turn", None)),
        ("stop", None, {"role": "assistant", "content": "Here"}, ("end_turn", None)),
        ("length", " files", {"role": "assistant", "content": "Here"}, ("max_tokens", None)),
        ("stop", " files", ANSWER_MESSAGE, ("tool_use", None)),
    ],
)
def test_a_stop_sequence_the_engine_matched_is_named(
    finish_reason: str, stop_reason: Any, message: dict[str, Any], expected: tuple[Any, Any]
) -> None:
    request = _request(stop_sequences=["END", " files"], stream=True)
    answer = _answer(message, finish_reason=finish_reason, stop_reason=stop_reason)
    body = CODEC.encode(request, answer)
    assert (body["stop_reason"], body["stop_sequence"]) == expected
    delta = [d for n, d in sse_events(_stream(request, [], answer)) if n == "message_delta"]
    assert delta[0]["delta"] == {"stop_reason": expected[0], "stop_sequence": expected[1]}


def test_stream_start_counts_the_prompt_when_it_is_known() -> None:
    head = _answer({"role": "assistant", "content": None}, usage=None, prompt_token_ids=[1, 2, 3])
    encoder = CODEC.stream_encoder(_request(stream=True), head)
    start = sse_events(encoder.start())[0][1]
    assert start["message"]["usage"] == {
        "input_tokens": 3,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def test_encode_plain_answer_without_usage() -> None:
    answer = _answer({"role": "assistant", "content": "hi"}, finish_reason="stop", usage=None)
    body = CODEC.encode(_request(), answer)
    assert body["content"] == [{"type": "text", "text": "hi"}]
    assert body["usage"]["input_tokens"] == 0 and body["usage"]["output_tokens"] == 0


@pytest.mark.parametrize(
    ("arguments", "expected_input"),
    [
        ('{"command": "ls"', {"INVALID_JSON": '{"command": "ls"'}),
        ("[1, 2]", {"INVALID_JSON": "[1, 2]"}),
        ('"just text"', {"INVALID_JSON": '"just text"'}),
        ("", {}),
    ],
)
def test_arguments_that_are_not_an_object(arguments: str, expected_input: Any) -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_z",
                "type": "function",
                "function": {"name": "Bash", "arguments": arguments},
            }
        ],
    }
    content = CODEC.encode(_request(), _answer(message))["content"]
    assert content == [
        {"type": "tool_use", "id": "call_z", "name": "Bash", "input": expected_input}
    ]
    if expected_input:  # wrapped raw text comes back as the model wrote it
        parsed = _parse_back(content)
        assert parsed == message


def _parse_back(content: list[dict[str, Any]]) -> dict[str, Any]:
    """Send ``content`` back as Claude Code does: the assistant turn, then its tool results."""
    results = [
        {"type": "tool_result", "tool_use_id": b["id"], "content": "ok"}
        for b in content
        if b["type"] == "tool_use"
    ]
    request = CODEC.parse(
        _with(
            messages=[
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": copy.deepcopy(content)},
                {"role": "user", "content": results or "next"},
            ]
        )
    )
    assistant = [m for m in request.chat["messages"] if m["role"] == "assistant"]
    assert len(assistant) == 1
    return assistant[0]


@pytest.mark.parametrize("omitted", [False, True])
def test_encode_parse_round_trip(omitted: bool) -> None:
    thinking = {"type": "enabled", "budget_tokens": 2048}
    if omitted:
        thinking["display"] = "omitted"
    answer = _answer()
    content = CODEC.encode(_request(thinking=thinking), answer)["content"]
    request = CODEC.parse(
        _with(
            messages=[
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": copy.deepcopy(content)},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "call_a1", "content": "a\nb"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "call_b2",
                            "content": [{"type": "text", "text": "# readme"}],
                        },
                    ],
                },
            ]
        )
    )
    messages = request.chat["messages"]
    assert messages[1] == answer.message
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "call_a1", "content": "a\nb"},
        {"role": "tool", "tool_call_id": "call_b2", "content": "# readme"},
    ]
    assert request.options.reasoning_hints == (CALL_ID,)
    # what linking digests is the same
    assert history_digest(messages) == history_digest([answer.message])


def test_round_trip_of_compact_arguments_digests_equal() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_c",
                "type": "function",
                "function": {"name": "Bash", "arguments": '{"command":"echo \\u00e9","n":1}'},
            }
        ],
    }
    parsed = _parse_back(CODEC.encode(_request(), _answer(message))["content"])
    assert canonical_turn(parsed) == canonical_turn(message)


# -- streaming ---------------------------------------------------------------------------------


def sse_events(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """Split SSE bytes on blank lines into (event, data) pairs."""
    out = []
    for block in b"".join(chunks).decode().split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(fields["data"])
        assert data["type"] == fields["event"]
        out.append((fields["event"], data))
    return out


def assemble(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks a client builds from the events (as the Anthropic SDKs do)."""
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks[data["index"]] = copy.deepcopy(data["content_block"])
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif name == "content_block_stop" and data["index"] in partial:
            blocks[data["index"]]["input"] = json.loads(partial[data["index"]])
    return [blocks[i] for i in sorted(blocks)]


CHAT_DELTAS: list[dict[str, Any]] = [
    {"reasoning_content": "I should list the files"},
    {"reasoning_content": " and read the README."},
    {"content": "Let me "},
    {"content": "check both."},
    {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_a1",
                "type": "function",
                "function": {"name": "Bash", "arguments": ""},
            }
        ]
    },
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"command": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"ls -la"}'}}]},
    {
        "tool_calls": [
            {
                "index": 1,
                "id": "call_b2",
                "type": "function",
                "function": {"name": "Read", "arguments": '{"file_path": "/w/é.md", '},
            }
        ]
    },
    {"tool_calls": [{"index": 1, "function": {"arguments": '"limit": 20}'}}]},
]


def _stream(request: Any, deltas: list[dict[str, Any]], answer: Answer) -> list[bytes]:
    head = _answer({"role": "assistant", "content": None}, usage=None, finish_reason=None)
    encoder = CODEC.stream_encoder(request, head)
    chunks = encoder.start()
    for delta in deltas:
        chunks += encoder.delta(delta, token_ids=[1], log_probs=[-0.5])
    return chunks + encoder.finish(answer)


def test_stream_event_sequence() -> None:
    request = _request(stream=True)
    answer = _answer()
    events = sse_events(_stream(request, CHAT_DELTAS, answer))
    assert [
        (name, data.get("index"), data.get("delta", {}).get("type")) for name, data in events
    ] == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, None),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[0][1] == {
        "type": "message_start",
        "message": {
            "id": "msg_0123456789abcdef0123456789abcdef",
            "type": "message",
            "role": "assistant",
            "model": "qwen3-8b",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 0,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        },
    }
    assert events[2][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[7][1]["content_block"] == {"type": "text", "text": ""}
    assert events[11][1]["content_block"] == {
        "type": "tool_use",
        "id": "call_a1",
        "name": "Bash",
        "input": {},
    }
    # the arguments come whole, as the engine gave them
    assert events[12][1]["delta"]["partial_json"] == '{"command": "ls -la"}'
    assert events[15][1]["delta"]["partial_json"] == '{"file_path": "/w/é.md", "limit": 20}'
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 120, "output_tokens": 45},
    }
    assert events[-1][1] == {"type": "message_stop"}

    blocks = assemble(events)
    assert blocks == CODEC.encode(request, answer)["content"]
    assert blocks[0]["thinking"] == answer.message["reasoning_content"]
    assert blocks[1]["text"] == answer.message["content"]


def test_stream_omitted_thinking_sends_only_the_signature() -> None:
    request = _request(
        stream=True, thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    )
    answer = _answer()
    events = sse_events(_stream(request, CHAT_DELTAS, answer))
    deltas = [
        d["delta"]["type"] for n, d in events if n == "content_block_delta" and d["index"] == 0
    ]
    assert deltas == ["signature_delta"]
    blocks = assemble(events)
    assert blocks == CODEC.encode(request, answer)["content"]
    assert blocks[0]["thinking"] == ""
    assert open_reasoning(blocks[0]["signature"]) == (CALL_ID, answer.message["reasoning_content"])


def test_stream_text_only_and_empty_deltas() -> None:
    request = _request(stream=True)
    answer = _answer(
        {"role": "assistant", "content": "Hello there"},
        finish_reason="length",
        usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    )
    deltas = [{"role": "assistant", "content": ""}, {"content": "Hello"}, {}, {"content": " there"}]
    events = sse_events(_stream(request, deltas, answer))
    assert [n for n, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert assemble(events) == [{"type": "text", "text": "Hello there"}]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_stream_invalid_arguments_are_wrapped() -> None:
    request = _request(stream=True)
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_q", "type": "function", "function": {"name": "Bash", "arguments": "{oops"}}
        ],
    }
    deltas = [
        {
            "tool_calls": [
                {"index": 0, "id": "call_q", "function": {"name": "Bash", "arguments": "{"}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": "oops"}}]},
    ]
    answer = _answer(message)
    blocks = assemble(sse_events(_stream(request, deltas, answer)))
    assert blocks == CODEC.encode(request, answer)["content"]
    assert blocks == [
        {"type": "tool_use", "id": "call_q", "name": "Bash", "input": {"INVALID_JSON": "{oops"}}
    ]


def test_stream_blocks_known_only_at_the_end_are_sent_whole() -> None:
    request = _request(stream=True)
    answer = _answer()
    # nothing streamed: the whole answer is sent in finish
    events = sse_events(_stream(request, [], answer))
    assert assemble(events) == CODEC.encode(request, answer)["content"]
    # text streamed, tool calls only in the final answer
    events = sse_events(_stream(request, CHAT_DELTAS[:4], answer))
    assert assemble(events) == CODEC.encode(request, answer)["content"]
    indexes = [d["index"] for n, d in events if n == "content_block_start"]
    assert indexes == [0, 1, 2, 3]


def _shape(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, Any, Any]]:
    return [(n, d.get("index"), d.get("delta", {}).get("type")) for n, d in events]


def _tool(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_stream_text_inside_a_tool_calls_arguments_loses_nothing() -> None:
    """The engine sends text between two fragments of one call's arguments: the harness gets
    the stored answer's blocks (text first, then whole tool uses), no fragment dropped."""
    request = _request(stream=True)
    deltas: list[dict[str, Any]] = [
        {"reasoning_content": "think"},
        {"tool_calls": [{"index": 0, "id": "call_A", "function": {"name": "bash"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
        {"content": "hello"},
        {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
        {"tool_calls": [{"index": 1, "id": "call_B", "function": {"name": "read"}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ""}}]},  # a late empty one
    ]
    message = {
        "role": "assistant",
        "content": "hello",
        "reasoning_content": "think",
        "tool_calls": [_tool("call_A", "bash", '{"a": 1}'), _tool("call_B", "read", "{}")],
    }
    answer = _answer(message)
    events = sse_events(_stream(request, deltas, answer))
    assert _shape(events) == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, None),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert [
        d["delta"]["partial_json"] for n, d in events if "partial_json" in d.get("delta", {})
    ] == [
        '{"a": 1}',
        "{}",
    ]
    blocks = assemble(events)
    assert blocks == [
        {"type": "thinking", "thinking": "think", "signature": seal_reasoning(CALL_ID, "think")},
        {"type": "text", "text": "hello"},
        {"type": "tool_use", "id": "call_A", "name": "bash", "input": {"a": 1}},
        {"type": "tool_use", "id": "call_B", "name": "read", "input": {}},
    ]
    assert blocks == CODEC.encode(request, answer)["content"]
    assert _parse_back(blocks) == message


def test_stream_interleaved_reasoning_and_text_round_trip() -> None:
    """Reasoning, text, reasoning, text: each change of kind is a new block, and the blocks
    sent back parse to the stored answer (each kind's texts joined with nothing), so the
    next call finds its parent."""
    request = _request(stream=True)
    deltas = [
        {"reasoning_content": "r1"},
        {"content": "c1"},
        {"reasoning_content": "r2"},
        {"content": "c2"},
    ]
    message = {"role": "assistant", "content": "c1c2", "reasoning_content": "r1r2"}
    answer = _answer(message, finish_reason="stop")
    blocks = assemble(sse_events(_stream(request, deltas, answer)))
    assert blocks == [
        {"type": "thinking", "thinking": "r1", "signature": seal_reasoning(CALL_ID, "r1")},
        {"type": "text", "text": "c1"},
        {"type": "thinking", "thinking": "r2", "signature": seal_reasoning(CALL_ID, "r2")},
        {"type": "text", "text": "c2"},
    ]
    whole = CODEC.encode(request, answer)["content"]
    assert _parse_back(blocks) == _parse_back(whole) == message
    assert history_digest([_parse_back(blocks)]) == history_digest([message])
    # with display omitted the sealed texts carry the reasoning
    omitted = _request(
        stream=True, thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    )
    blocks = assemble(sse_events(_stream(omitted, deltas, answer)))
    assert [b.get("thinking") for b in blocks] == ["", None, "", None]
    assert _parse_back(blocks) == message


def test_stream_error_event() -> None:
    encoder = CODEC.stream_encoder(_request(stream=True), _answer())
    assert sse_events([encoder.error("engine went away")]) == [
        ("error", {"type": "error", "error": {"type": "api_error", "message": "engine went away"}})
    ]


# -- errors, count_tokens ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
        (507, "api_error"),
    ],
)
def test_error_body(status: int, error_type: str) -> None:
    body = CODEC.error_body(status, "went wrong", error_type="server_error", param=None, code=None)
    assert body == {"type": "error", "error": {"type": error_type, "message": "went wrong"}}


def test_error_body_names_the_param() -> None:
    body = CODEC.error_body(
        400, "must be a string", error_type="invalid_request_error", param="model", code=None
    )
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "model: must be a string"},
    }
    # an InvalidFrontRequest's message already names it
    try:
        CODEC.parse(_with(model=1))
    except InvalidFrontRequest as exc:
        body = CODEC.error_body(400, str(exc), error_type="x", param=exc.param, code=None)
    assert body["error"]["message"] == "model: must be a string, not int"


def test_count_tokens() -> None:
    body = claude_code_body()
    for key in ("max_tokens", "stream", "metadata", "context_management"):
        del body[key]
    request = parse_count_tokens(body)
    full = CODEC.parse(claude_code_body())
    assert request.stream is False
    assert request.chat == {
        k: v for k, v in full.chat.items() if k not in ("max_tokens", "stream", "stream_options")
    }
    assert request.options.count_tokens is True
    assert CODEC.parse_count_tokens(body) == request
    assert encode_count_tokens(1234) == {"input_tokens": 1234}


def test_count_tokens_refusals() -> None:
    with pytest.raises(InvalidFrontRequest) as info:
        parse_count_tokens({"model": "m", "messages": _user(IMAGE)})
    assert info.value.param == "messages.0.content.0.source.data"  # no image limits given
    with pytest.raises(InvalidFrontRequest) as info:
        parse_count_tokens({"messages": BASE["messages"]})
    assert info.value.param == "model"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_with(system=5), "system: must be a string or an array of text blocks, not int"),
        (
            _with(messages=[{"role": "system", "content": {}}]),
            "messages.0.content: must be a string or an array of text blocks, not dict",
        ),
        (
            _with(messages=[{"role": "user", "content": 3}]),
            "messages.0.content: must be a string or an array of content blocks, not int",
        ),
        (
            _with(messages=_assistant()[:1] + [{"role": "assistant", "content": None}]),
            "messages.1.content: must be a string or an array of content blocks, not null",
        ),
        (
            _with(messages=_user({"type": "tool_result", "tool_use_id": "t", "content": 3})),
            "messages.0.content.0.content: must be a string or an array of text and image "
            "blocks, not int",
        ),
        (_with(tools={}), "tools: must be an array, not dict"),
    ],
)
def test_a_field_that_may_be_a_string_says_so(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidFrontRequest) as info:
        CODEC.parse(body)
    assert str(info.value) == message


def test_prompt_logprobs_is_not_sent_to_the_engine() -> None:
    # Only the chat front forwards extras; the Messages chat request is built field by field,
    # so the engine never computes prompt log probs the answer could not carry.
    chat = CODEC.parse(_with(prompt_logprobs=1, return_token_ids=True)).chat
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
    }
