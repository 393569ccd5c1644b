"""The Responses API front: parse (Codex CLI 0.169.0 bodies), encode, stream, errors."""

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
from capture_proxy.core.fronts.responses import ResponsesCodec
from capture_proxy.core.fronts.responses.options import ResponsesOptions
from capture_proxy.core.fronts.responses.parse import referenced_history, referenced_response_id
from capture_proxy.core.fronts.responses.tools import CUSTOM_TOOL_PARAMETERS

CODEC = ResponsesCodec()
CALL_ID = "call-0123abcd"
BASE = "0123abcd"

EXEC_PARAMS = {
    "type": "object",
    "properties": {"cmd": {"type": "string"}},
    "required": ["cmd"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command.",
        "strict": False,
        "parameters": EXEC_PARAMS,
    },
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Applies a patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"},
    },
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Sub-agents.",
        "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}],
    },
    {"type": "web_search", "external_web_access": False},
]


def sse(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of each SSE block: split on blank lines."""
    out = []
    for block in b"".join(chunks).decode().split("\n\n"):
        if not block:
            continue
        event = ""
        data = []
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        out.append((event, json.loads("\n".join(data))))
    return out


def codex_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "qwen3",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "# AGENTS.md"},
                    {"type": "input_text", "text": "List the files."},
                ],
            },
        ],
        "tools": copy.deepcopy(TOOLS),
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019e-session",
        "client_metadata": {"x-codex-installation-id": "abc"},
    }
    body.update(overrides)
    return body


def request(**overrides: Any):
    return CODEC.parse(codex_body(**overrides))


def answer(message: dict[str, Any], finish_reason: str = "stop", **kw: Any) -> Answer:
    return Answer(
        call_id=CALL_ID,
        created_at=1700000000.7,
        model="qwen3",
        message=message,
        finish_reason=finish_reason,
        usage=kw.pop("usage", {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}),
        **kw,
    )


# -- parse -------------------------------------------------------------------------------------


def test_codex_first_request():
    req = request()
    assert req.api is Api.RESPONSES
    assert req.stream is True
    assert req.chat == {
        "model": "qwen3",
        "messages": [
            {"role": "system", "content": "You are Codex."},
            {"role": "user", "content": "# AGENTS.md\nList the files."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "exec_command",
                    "description": "Runs a command.",
                    "parameters": EXEC_PARAMS,
                    "strict": False,
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "apply_patch",
                    "description": "Applies a patch.",
                    "parameters": CUSTOM_TOOL_PARAMETERS,
                },
            },
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert req.options == ResponsesOptions(
        custom_tools=frozenset({"apply_patch"}),
        unrendered_tools=tuple(TOOLS[-2:]),
        reasoning={"summary": "auto"},
        include=("reasoning.encrypted_content",),
    )
    [diagnostic] = req.diagnostics
    assert diagnostic.kind == "tools_not_rendered"
    assert diagnostic.details == {
        "tools": [{"type": "namespace", "name": "multi_agent_v1"}, {"type": "web_search"}]
    }
    body = codex_body()
    del body["input"]
    assert req.received == body


def test_codex_tool_loop_history():
    sealed = seal_reasoning("call-earlier", "I should list files.")
    items = codex_body()["input"] + [
        # Codex replays output items without their ids
        {
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "I should list files."}],
            "content": [{"type": "reasoning_text", "text": "I should list files."}],
            "encrypted_content": sealed,
        },
        {
            "type": "function_call",
            "name": "exec_command",
            "arguments": '{"cmd":"ls"}',
            "call_id": "call_a",
        },
        {"type": "function_call_output", "call_id": "call_a", "output": "a.txt\nb.txt"},
        {
            "type": "reasoning",
            "summary": [
                {"type": "summary_text", "text": "**Patching**"},
                {"type": "summary_text", "text": "Add a line."},
            ],
            "encrypted_content": "gAAAAABforeign-opaque-value",
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}],
        },
        {
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": "call_b",
            "name": "apply_patch",
            "input": "*** Begin Patch\n*** End Patch",
        },
        {
            "type": "custom_tool_call_output",
            "call_id": "call_b",
            "output": [{"type": "input_text", "text": "Done!"}],
        },
        {"role": "user", "content": "thanks"},
    ]
    req = CODEC.parse(codex_body(input=items))
    assert req.chat["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "user", "content": "# AGENTS.md\nList the files."},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should list files.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "a.txt\nb.txt"},
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "**Patching**\nAdd a line.",
            "tool_calls": [
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {
                        "name": "apply_patch",
                        "arguments": '{"input": "*** Begin Patch\\n*** End Patch"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_b", "content": "Done!"},
        {"role": "user", "content": "thanks"},
    ]


def test_reasoning_text_sources():
    def parsed(item: dict[str, Any]) -> dict[str, Any]:
        items = [{"role": "user", "content": "hi"}, item]
        return CODEC.parse({"model": "m", "input": items}).chat["messages"][-1]

    # the sealed text wins over what the harness shows
    sealed = seal_reasoning("call-x", "the real text")
    item = {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "shown"}],
        "content": [{"type": "reasoning_text", "text": "content text"}],
        "encrypted_content": sealed,
    }
    assert parsed(item)["reasoning_content"] == "the real text"
    # a tampered seal is foreign: content next, then the summary
    item["encrypted_content"] = sealed[:-1] + ("0" if sealed[-1] != "0" else "1")
    assert parsed(item)["reasoning_content"] == "content text"
    del item["content"]
    assert parsed(item)["reasoning_content"] == "shown"
    # an empty reasoning item adds nothing: no assistant turn at all
    empty = {"type": "reasoning", "summary": [], "encrypted_content": None}
    assert CODEC.parse({"model": "m", "input": [{"role": "user", "content": "hi"}, empty]}).chat[
        "messages"
    ] == [{"role": "user", "content": "hi"}]


def test_string_input_instructions_and_sampling():
    req = CODEC.parse(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": "hello",
            "max_output_tokens": 64,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_logprobs": 3,
            "text": {
                "format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}
            },
        }
    )
    assert req.stream is False
    assert req.chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.9,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}},
        },
        "stream": False,
    }


def test_tool_choice_forms():
    def choice(value: Any) -> Any:
        return request(tool_choice=value).chat["tool_choice"]

    assert choice("required") == "required"
    assert choice({"type": "function", "name": "exec_command"}) == {
        "type": "function",
        "function": {"name": "exec_command"},
    }
    assert choice({"type": "custom", "name": "apply_patch"}) == {
        "type": "function",
        "function": {"name": "apply_patch"},
    }
    # only hosted tools: nothing to offer the engine, so no tools and no choice
    req = request(tools=[{"type": "web_search"}])
    assert "tools" not in req.chat and "tool_choice" not in req.chat
    assert req.options.unrendered_tools == ({"type": "web_search"},)
    assert [d.to_json() for d in req.diagnostics] == [
        {"kind": "tools_not_rendered", "details": {"tools": [{"type": "web_search"}]}}
    ]


def test_previous_response_history():
    previous = [
        {"role": "system", "content": "dev"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    body = {"model": "m", "previous_response_id": "resp_1", "input": "more"}
    assert referenced_response_id(body) == "resp_1"
    assert CODEC.parse(body, previous=previous).chat["messages"] == [
        *previous,
        {"role": "user", "content": "more"},
    ]
    # The new instructions come first; the history's own system message (an input item) stays.
    body["instructions"] = "new"
    assert CODEC.parse(body, previous=previous).chat["messages"] == [
        {"role": "system", "content": "new"},
        *previous,
        {"role": "user", "content": "more"},
    ]
    assert previous[0] == {"role": "system", "content": "dev"}  # not changed in place
    # no input at all is fine when a previous response is referenced
    del body["input"]
    assert CODEC.parse(body, previous=previous[1:]).chat["messages"][-1] == previous[-1]
    assert referenced_response_id({"model": "m"}) is None


ANSWER_MESSAGE = {"role": "assistant", "content": "Hello."}


def test_referenced_history_leaves_out_the_instructions_of_the_response():
    # Case A: call 1 had instructions; they are not carried over to the next response.
    received = {"model": "m", "instructions": "INSTR-ONE"}
    messages = [{"role": "system", "content": "INSTR-ONE"}, {"role": "user", "content": "hi"}]
    history = referenced_history(messages, ANSWER_MESSAGE, received)
    assert history == [{"role": "user", "content": "hi"}, ANSWER_MESSAGE]
    body = {"model": "m", "previous_response_id": "resp_1", "input": "again"}
    assert CODEC.parse(body, previous=history).chat["messages"] == [
        {"role": "user", "content": "hi"},
        ANSWER_MESSAGE,
        {"role": "user", "content": "again"},
    ]


def test_referenced_history_keeps_developer_items_under_new_instructions():
    # Case B: call 1's developer input item stays; call 2's instructions come before it.
    messages = [{"role": "system", "content": "DEV-MSG"}, {"role": "user", "content": "hi"}]
    history = referenced_history(messages, ANSWER_MESSAGE, {"model": "m"})
    assert history == [*messages, ANSWER_MESSAGE]
    body = {
        "model": "m",
        "previous_response_id": "resp_1",
        "instructions": "INSTR-TWO",
        "input": "again",
    }
    assert CODEC.parse(body, previous=history).chat["messages"] == [
        {"role": "system", "content": "INSTR-TWO"},
        {"role": "system", "content": "DEV-MSG"},
        {"role": "user", "content": "hi"},
        ANSWER_MESSAGE,
        {"role": "user", "content": "again"},
    ]


def test_referenced_history_of_instructions_and_a_developer_item():
    # Only the first system message came from instructions; the developer item after it stays.
    messages = [
        {"role": "system", "content": "INSTR-ONE"},
        {"role": "system", "content": "DEV-MSG"},
        {"role": "user", "content": "hi"},
    ]
    received = {"model": "m", "instructions": "INSTR-ONE"}
    assert referenced_history(messages, ANSWER_MESSAGE, received) == [
        *messages[1:],
        ANSWER_MESSAGE,
    ]
    # A record from before request bodies were kept: the messages as stored.
    assert referenced_history(messages, ANSWER_MESSAGE, None) == [*messages, ANSWER_MESSAGE]


def _user(content: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": content}


REFUSALS = [
    ({"model": None}, "model"),
    ({"model": 3}, "model"),
    ({"input": None}, "input"),
    ({"input": {"role": "user"}}, "input"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input.0"),
    ({"input": [{"content": "x"}]}, "input.0.type"),
    ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [_user(None)]}, "input.0.content"),
    ({"input": [_user(7)]}, "input.0.content"),
    (
        # (parsed without image limits: images are refused, naming the image)
        {"input": [_user("a"), _user([{"type": "input_image", "image_url": "data:x"}])]},
        "input.1.content.0.image_url",
    ),
    ({"input": [_user([{"type": "input_file", "file_id": "f"}])]}, "input.0.content.0.type"),
    ({"input": [_user([{"type": "input_text", "text": 1}])]}, "input.0.content.0.text"),
    (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input.0.call_id",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
        "input.0.arguments",
    ),
    (
        # vLLM parses a history's tool-call arguments (text that is not JSON becomes {}):
        # only nesting its parser cannot take is refused
        {
            "input": [
                _user("hi"),
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 100_000},
            ]
        },
        "input.1.arguments",
    ),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f"}]}, "input.0.input"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.output"),
    (
        {
            "input": [
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image", "image_url": "data:x"}],
                }
            ]
        },
        "input.0.output.0.image_url",
    ),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input.0.summary"),
    (
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": 5}]},
        "input.0.encrypted_content",
    ),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "web_search_call", "action": {"type": "search"}}]}, "input.0.type"),
    ({"input": [{"type": "local_shell_call", "call_id": "c"}]}, "input.0.type"),
    ({"instructions": ["x"]}, "instructions"),
    ({"previous_response_id": 12}, "previous_response_id"),
    ({"tools": {}}, "tools"),
    ({"tools": [{"name": "x"}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools.0.parameters"),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools.0.strict"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice.type"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"max_output_tokens": 1.5}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": False}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"stream": "true"}, "stream"),
    ({"reasoning": "high"}, "reasoning"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"include": [1]}, "include.0"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
]


@pytest.mark.parametrize(("overrides", "param"), REFUSALS)
def test_refusals_name_the_field(overrides: dict[str, Any], param: str):
    # an override of None leaves the field out
    body = {k: v for k, v in codex_body(**overrides).items() if v is not None}
    with pytest.raises(InvalidFrontRequest) as exc:
        CODEC.parse(body)
    assert exc.value.param == param
    assert str(exc.value).startswith(f"'{param}'")


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0, "top_p": 1}, {"temperature": 2, "top_p": 1e-6}]
)
def test_sampling_at_the_edges_of_its_ranges_is_mapped(sampling: dict[str, Any]):
    chat = CODEC.parse(codex_body(**sampling)).chat
    assert {k: chat[k] for k in sampling} == sampling


def test_image_without_limits_is_refused():
    body = codex_body(input=[_user([{"type": "input_image", "image_url": "data:x"}])])
    with pytest.raises(InvalidFrontRequest, match="images are not accepted here"):
        CODEC.parse(body)


# -- encode ------------------------------------------------------------------------------------

MESSAGE = {
    "role": "assistant",
    "content": "Listing.",
    "reasoning_content": "Let me look.",
    "tool_calls": [
        {
            "id": "call_x",
            "type": "function",
            "function": {"name": "exec_command", "arguments": '{"cmd": "ls -la"}'},
        },
        {
            "id": "call_y",
            "type": "function",
            "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch"}'},
        },
    ],
}


def test_encode():
    req = request()
    body = CODEC.encode(req, answer(MESSAGE, "tool_calls"))
    sealed = body["output"][0]["encrypted_content"]
    assert open_reasoning(sealed) == (CALL_ID, "Let me look.")
    assert body == {
        "id": f"resp_{BASE}",
        "object": "response",
        "created_at": 1700000000,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": "qwen3",
        "output": [
            {
                "id": f"rs_{BASE}",
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "Let me look."}],
                "content": [{"type": "reasoning_text", "text": "Let me look."}],
                "encrypted_content": sealed,
            },
            {
                "id": f"msg_{BASE}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Listing.", "annotations": []}],
            },
            {
                "id": f"fc_{BASE}_0",
                "type": "function_call",
                "status": "completed",
                "call_id": "call_x",
                "name": "exec_command",
                "arguments": '{"cmd": "ls -la"}',
            },
            {
                "id": f"ctc_{BASE}_1",
                "type": "custom_tool_call",
                "status": "completed",
                "call_id": "call_y",
                "name": "apply_patch",
                "input": "*** Begin Patch",
            },
        ],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"summary": "auto"},
        "store": False,
        "temperature": None,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": TOOLS,
        "top_p": None,
        "truncation": "disabled",
        "usage": {
            "input_tokens": 100,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 20,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 120,
        },
        "metadata": {},
    }


def test_encode_without_summary_or_encrypted_content_and_cut_short():
    req = request(reasoning=None, include=None)
    body = CODEC.encode(
        req, answer({"role": "assistant", "content": None, "reasoning_content": "hm"}, "length")
    )
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"] == [
        {
            "id": f"rs_{BASE}",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hm"}],
        }
    ]


def test_encode_then_parse_gives_the_answer_back():
    """Codex replays the output items (without ids) and adds the tool outputs: the parsed
    assistant turn is the answer's message, so linking finds the call."""
    req = request()
    body = CODEC.encode(req, answer(MESSAGE, "tool_calls"))
    replayed = [{k: v for k, v in item.items() if k != "id"} for item in body["output"]]
    items = codex_body()["input"] + [
        *replayed,
        {"type": "function_call_output", "call_id": "call_x", "output": "a.txt"},
        {"type": "custom_tool_call_output", "call_id": "call_y", "output": "Done!"},
    ]
    messages = CODEC.parse(codex_body(input=items)).chat["messages"]
    assert messages[2] == MESSAGE
    assert messages[3:] == [
        {"role": "tool", "tool_call_id": "call_x", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_y", "content": "Done!"},
    ]


def test_round_trip_without_encrypted_content_uses_reasoning_text():
    req = request(include=None)
    body = CODEC.encode(req, answer(MESSAGE, "tool_calls"))
    items = codex_body()["input"] + body["output"]
    assert CODEC.parse(codex_body(input=items)).chat["messages"][2] == MESSAGE


def test_error_body():
    assert CODEC.error_body(
        400, "'model' is required", error_type="invalid_request_error", param="model", code=None
    ) == {
        "error": {
            "message": "'model' is required",
            "type": "invalid_request_error",
            "param": "model",
            "code": None,
        }
    }


# -- streaming ---------------------------------------------------------------------------------


def tool_delta(index: int, arguments: str, call_id: str | None = None, name: str | None = None):
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def run_stream(req, deltas: list[dict[str, Any]], final: Answer) -> list[tuple[str, dict]]:
    enc = CODEC.stream_encoder(req, answer({"role": "assistant", "content": None}, None))
    chunks = enc.start()
    for d in deltas:
        chunks += enc.delta(d)
    chunks += enc.finish(final)
    return sse(chunks)


STREAM_DELTAS = [
    {"reasoning_content": "Let me "},
    {"reasoning_content": "look."},
    {"content": "List"},
    {"content": "ing."},
    tool_delta(0, "", "call_x", "exec_command"),
    tool_delta(0, '{"cmd":'),
    tool_delta(1, "", "call_y", "apply_patch"),
    tool_delta(1, '{"input": "*** Begin'),
    tool_delta(0, ' "ls -la"}'),
    tool_delta(1, ' Patch"}'),
]
STREAM_MESSAGE = copy.deepcopy(MESSAGE)
STREAM_MESSAGE["tool_calls"][0]["function"]["arguments"] = '{"cmd": "ls -la"}'


def test_stream_events():
    req = request()
    final = answer(STREAM_MESSAGE, "tool_calls")
    events = run_stream(req, STREAM_DELTAS, final)
    assert [e for e, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # function call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",  # (the custom call's start is held)
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",  # custom tool call: one item after another
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(e == d["type"] for e, d in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    for _, d in events[:2]:
        assert d["response"]["status"] == "in_progress"
        assert d["response"]["id"] == f"resp_{BASE}" and d["response"]["output"] == []

    def joined(kind: str) -> str:
        return "".join(d["delta"] for e, d in events if e == kind)

    assert joined("response.reasoning_summary_text.delta") == "Let me look."
    assert joined("response.output_text.delta") == "Listing."
    assert joined("response.function_call_arguments.delta") == '{"cmd": "ls -la"}'
    assert joined("response.custom_tool_call_input.delta") == "*** Begin Patch"
    added = [d for e, d in events if e == "response.output_item.added"]
    assert [d["output_index"] for d in added] == [0, 1, 2, 3]
    assert added[2]["item"] == {
        "id": f"fc_{BASE}_0",
        "type": "function_call",
        "status": "in_progress",
        "call_id": "call_x",
        "name": "exec_command",
        "arguments": "",
    }
    assert added[3]["item"]["type"] == "custom_tool_call" and added[3]["item"]["input"] == ""

    # the whole response is encode's, and the done items (what Codex keeps) are its output
    completed = events[-1][1]["response"]
    assert completed == CODEC.encode(req, final)
    done = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert done == completed["output"]


def test_parallel_calls_stream_one_item_after_another():
    """An engine that interleaves two calls' argument deltas: the API (and Codex, which keeps
    the done items) sees each call's item added, its arguments and done before the next item
    is added, and each call's arguments whole."""

    def frag(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
        if name is not None:
            call |= {"id": f"call_{index}", "function": {"name": name, "arguments": arguments}}
        return {"tool_calls": [call]}

    deltas = [
        frag(0, '{"cmd": ', "exec_command"),
        frag(1, '{"cmd": ', "exec_command"),
        frag(0, '"ls"}'),
        frag(1, '"pwd"}'),
    ]
    calls = [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "exec_command", "arguments": args}}
        for i, args in enumerate(['{"cmd": "ls"}', '{"cmd": "pwd"}'])
    ]  # fmt: skip
    final = answer({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls")
    events = run_stream(request(), deltas, final)
    item_events = [(e, d["output_index"]) for e, d in events if "output_index" in d]
    assert item_events == [
        ("response.output_item.added", 0),
        ("response.function_call_arguments.delta", 0),
        ("response.function_call_arguments.delta", 0),
        ("response.function_call_arguments.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
    ]
    done = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert [(i["call_id"], i["arguments"]) for i in done] == [
        ("call_0", '{"cmd": "ls"}'),
        ("call_1", '{"cmd": "pwd"}'),
    ]
    assert done == events[-1][1]["response"]["output"]


def test_stream_without_summary_streams_reasoning_text():
    req = request(reasoning={"effort": "high"})
    final = answer({"role": "assistant", "content": "Hi.", "reasoning_content": "ab"})
    events = run_stream(
        req, [{"reasoning_content": "a"}, {"reasoning": "b"}, {"content": "Hi."}], final
    )
    assert [e for e, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["content_index"] for e, d in events if e == "response.reasoning_text.delta"] == [0, 0]
    done = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert done == events[-1][1]["response"]["output"] == CODEC.encode(req, final)["output"]
    assert done[0]["summary"] == []


def test_stream_holds_text_that_comes_while_calls_stream():
    req = request()
    message = {
        "role": "assistant",
        "content": "Run.\n",
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "exec_command", "arguments": "{}"},
            },
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "exec_command", "arguments": "[]"},
            },
        ],
    }
    deltas = [
        {"content": "Run."},
        tool_delta(0, "{}", "c0", "exec_command"),
        {"content": "\n"},
        tool_delta(1, "[]", "c1", "exec_command"),
    ]
    events = run_stream(req, deltas, answer(message, "tool_calls"))
    done = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert [(i["type"], i.get("call_id")) for i in done] == [
        ("message", None),
        ("function_call", "c0"),
        ("function_call", "c1"),
        ("message", None),
    ]
    assert done[3]["id"] == f"msg_{BASE}_3"
    # Codex keeps these items as the turn: parsed back, it is the answer's message
    items = [{"role": "user", "content": "go"}, *done]
    assert CODEC.parse({"model": "m", "input": items}).chat["messages"][1] == message


#: Deltas that interleave kinds (as a harmony model's may), each with the answer they add up
#: to (the engine's whole message), the done items the stream sends and the whole answer's
#: output items: (name, deltas, message, streamed [(id, type, text)], whole [(id, type, text)])
FUNCTION_TOOLS = [
    {"type": "function", "name": "bash", "parameters": {"type": "object"}},
    {"type": "function", "name": "read", "parameters": {"type": "object"}},
]
CALL_A = {"id": "call_A", "type": "function", "function": {"name": "bash", "arguments": '{"a": 1}'}}
CALL_B = {"id": "call_B", "type": "function", "function": {"name": "read", "arguments": "{}"}}
CALL_C = {"id": "call_C", "type": "function", "function": {"name": "bash", "arguments": '{"a": 2}'}}
INTERLEAVED = [
    (
        "text-inside-a-call",
        [
            {"reasoning_content": "think"},
            tool_delta(0, "", "call_A", "bash"),
            tool_delta(0, '{"a":'),
            {"content": "hello"},
            tool_delta(0, " 1}"),
            tool_delta(1, "{}", "call_B", "read"),
        ],
        {
            "role": "assistant",
            "content": "hello",
            "reasoning_content": "think",
            "tool_calls": [CALL_A, CALL_B],
        },
        [
            (f"rs_{BASE}", "reasoning", "think"),
            (f"fc_{BASE}_0", "function_call", '{"a": 1}'),
            (f"fc_{BASE}_1", "function_call", "{}"),
            (f"msg_{BASE}", "message", "hello"),
        ],
        [
            (f"rs_{BASE}", "reasoning", "think"),
            (f"msg_{BASE}", "message", "hello"),
            (f"fc_{BASE}_0", "function_call", '{"a": 1}'),
            (f"fc_{BASE}_1", "function_call", "{}"),
        ],
    ),
    (
        "text-after-a-call",
        [{"content": "before"}, tool_delta(0, '{"a": 2}', "call_C", "bash"), {"content": " after"}],
        {"role": "assistant", "content": "before after", "tool_calls": [CALL_C]},
        [
            (f"msg_{BASE}", "message", "before"),
            (f"fc_{BASE}_0", "function_call", '{"a": 2}'),
            (f"msg_{BASE}_2", "message", " after"),
        ],
        [
            (f"msg_{BASE}", "message", "before after"),
            (f"fc_{BASE}_0", "function_call", '{"a": 2}'),
        ],
    ),
    (
        "reasoning-and-text-alternate",
        [
            {"reasoning_content": "r1"},
            {"content": "c1"},
            {"reasoning_content": "r2"},
            {"content": "c2"},
        ],
        {"role": "assistant", "content": "c1c2", "reasoning_content": "r1r2"},
        [
            (f"rs_{BASE}", "reasoning", "r1"),
            (f"msg_{BASE}", "message", "c1"),
            (f"rs_{BASE}_2", "reasoning", "r2"),
            (f"msg_{BASE}_3", "message", "c2"),
        ],
        [(f"rs_{BASE}", "reasoning", "r1r2"), (f"msg_{BASE}", "message", "c1c2")],
    ),
]


def _item_text(item: dict[str, Any]) -> str:
    if item["type"] == "function_call":
        return item["arguments"]
    return item["content"][0]["text"]


@pytest.mark.parametrize(
    ("deltas", "message", "streamed", "whole"),
    [case[1:] for case in INTERLEAVED],
    ids=[case[0] for case in INTERLEAVED],
)
def test_stream_completed_output_is_the_done_items(deltas, message, streamed, whole):
    req = CODEC.parse({"model": "m", "input": "x", "tools": FUNCTION_TOOLS})
    final = answer(message, "tool_calls" if "tool_calls" in message else "stop")
    events = run_stream(req, deltas, final)
    done = [d for e, d in events if e == "response.output_item.done"]
    items = [d["item"] for d in done]
    assert [(i["id"], i["type"], _item_text(i)) for i in items] == streamed
    assert [d["output_index"] for d in done] == list(range(len(streamed)))
    completed = events[-1][1]["response"]
    assert events[-1][0] == "response.completed"
    assert completed["output"] == items
    # The rest of the completed response is the whole answer's.
    whole_response = CODEC.encode(req, final)
    assert {**completed, "output": None} == {**whole_response, "output": None}
    # The whole answer keeps one item per kind (the canonical answer holds no order) ...
    assert [(i["id"], i["type"], _item_text(i)) for i in whole_response["output"]] == whole
    # ... and both, sent back as the next request's input, are the answer's message: the
    # turn digests as the stored answer does, so the next call links.
    for output in (items, whole_response["output"]):
        parsed = CODEC.parse({"model": "m", "input": [{"role": "user", "content": "x"}, *output]})
        assert parsed.chat["messages"][1] == message


def test_stream_finish_sends_what_no_delta_carried():
    req = request()
    final = answer({"role": "assistant", "content": "Whole.", "reasoning_content": "r"})
    events = run_stream(req, [], final)
    assert "".join(d["delta"] for e, d in events if e == "response.output_text.delta") == "Whole."
    done = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert done == events[-1][1]["response"]["output"] == CODEC.encode(req, final)["output"]


def test_stream_cut_short_completes_with_incomplete_status():
    req = request()
    final = answer({"role": "assistant", "content": "Trunc"}, "length")
    events = run_stream(req, [{"content": "Trunc"}], final)
    assert events[-1][0] == "response.completed"
    assert events[-1][1]["response"]["status"] == "incomplete"


def test_stream_error():
    req = request()
    enc = CODEC.stream_encoder(req, answer({"role": "assistant", "content": None}, None))
    chunks = enc.start() + enc.delta({"content": "pa"}) + [enc.error("engine went away")]
    events = sse(chunks)
    assert [e for e, _ in events][-2:] == ["error", "response.failed"]
    assert events[-2][1] == {
        "type": "error",
        "sequence_number": 5,
        "param": None,
        "code": "server_error",
        "message": "engine went away",
    }
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "engine went away"}


def test_prompt_logprobs_is_not_sent_to_the_engine() -> None:
    # The Responses chat request is built field by field: no prompt_logprobs reaches the engine.
    chat = CODEC.parse(
        {"model": "m", "input": "hi", "prompt_logprobs": 1, "return_token_ids": True}
    ).chat
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
    }
