"""Small clients of the three wire APIs, for the contract suite (``test_api_contract``).

Each harness builds requests in its API's own shape from one conversation (system prompt, user
task, tools in that API's tool format), sends them through the proxy, parses the answer as a
real client of that API does (the whole JSON, or the SSE events: chat chunks; Responses
``response.output_item.done`` items and ``response.completed``; Messages content blocks from
``content_block_start`` / ``_delta`` / ``_stop``) and appends the assistant turn back in the
API's own form (chat: the message; Responses: the output items as input items; Messages: the
content blocks as an assistant message), plus tool results in the API's form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.core.sse import SSEStreamDecoder
from tests.proxy.conftest import Stack

MODEL = "scripted-qwen"
SYSTEM = "You are a coding agent."
TASK = "List the files, then read the notes."
#: (name, description, JSON schema) of the tools every harness offers
TOOL_SPECS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "bash",
        "Run a shell command",
        {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    ),
    (
        "read",
        "Read a file",
        {
            "type": "object",
            "properties": {"filePath": {"type": "string"}},
            "required": ["filePath"],
        },
    ),
]

PATHS = {
    "chat_completions": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def capture_url(rollout: str, api: str) -> str:
    return f"/ng-rollout/{rollout}/training-token-capture{PATHS[api]}"


@dataclass
class Event:
    name: str | None
    data: Any  # parsed JSON, or the raw text ("[DONE]")


@dataclass
class Reply:
    """One answer as the harness understood it."""

    status: int
    call_id: str | None
    body: Any = None  # the whole JSON (non-streaming, or an error)
    events: list[Event] = field(default_factory=list)  # a stream's events, in order
    content: str = ""
    reasoning: str | None = None
    #: (tool call id, name, arguments as a parsed JSON object)
    tool_calls: list[tuple[str, str, Any]] = field(default_factory=list)
    #: the API-shaped turn to send back (chat message / Responses items / Messages blocks)
    turn: Any = None


def decode_events(raw: bytes) -> list[Event]:
    decoder = SSEStreamDecoder()
    out = []
    for e in [*decoder.feed(raw), *decoder.close()]:
        try:
            data = json.loads(e.data)
        except ValueError:
            data = e.data
        out.append(Event(e.event, data))
    return out


class Harness:
    api: str

    def __init__(self, stack: Stack, rollout: str, *, stream: bool) -> None:
        self.stack = stack
        self.rollout = rollout
        self.stream = stream
        self.history: list[Any] = []
        self.extra: dict[str, Any] = {}

    # -- per API
    def tools(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def start(self, task: str = TASK) -> None:
        raise NotImplementedError

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def parse_whole(self, reply: Reply, body: Any) -> None:
        raise NotImplementedError

    def parse_stream(self, reply: Reply, events: list[Event]) -> None:
        raise NotImplementedError

    def append_turn(self, reply: Reply) -> None:
        raise NotImplementedError

    def append_tool_results(self, results: list[tuple[str, str]]) -> None:
        raise NotImplementedError

    # -- shared
    async def post(self, body: dict[str, Any]) -> Reply:
        resp = await self.stack.client.post(capture_url(self.rollout, self.api), json=body)
        reply = Reply(resp.status, resp.headers.get("X-Capture-Call-Id"))
        raw = await resp.read()
        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            reply.events = decode_events(raw)
            self.parse_stream(reply, reply.events)
        else:
            reply.body = json.loads(raw)
            if resp.status == 200:
                self.parse_whole(reply, reply.body)
        return reply

    async def send(self) -> Reply:
        return await self.post(self.body())

    async def step(self, tool_output: str | None = None) -> Reply:
        """Send the conversation, append the answer and (when it called tools) a result per
        call (``tool_output`` or ``"output of <name>"``)."""
        reply = await self.send()
        assert reply.status == 200, reply.body
        self.append_turn(reply)
        if reply.tool_calls:
            self.append_tool_results(
                [(tid, tool_output or f"output of {name}") for tid, name, _ in reply.tool_calls]
            )
        return reply


# -- chat completions ---------------------------------------------------------------------------


class ChatHarness(Harness):
    api = "chat_completions"

    def tools(self) -> list[dict[str, Any]]:
        return [
            {"type": "function", "function": {"name": n, "description": d, "parameters": p}}
            for n, d, p in TOOL_SPECS
        ]

    def start(self, task: str = TASK) -> None:
        self.history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]

    def body(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": self.history,
            "tools": self.tools(),
            "stream": self.stream,
            **self.extra,
        }

    def _fill(self, reply: Reply, message: dict[str, Any]) -> None:
        reply.content = message.get("content") or ""
        reply.reasoning = message.get("reasoning_content")
        reply.tool_calls = [
            (tc["id"], tc["function"]["name"], json.loads(tc["function"]["arguments"]))
            for tc in message.get("tool_calls") or []
        ]
        turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning_content"):
            turn["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            turn["tool_calls"] = message["tool_calls"]
        reply.turn = turn

    def parse_whole(self, reply: Reply, body: Any) -> None:
        self._fill(reply, body["choices"][0]["message"])

    def parse_stream(self, reply: Reply, events: list[Event]) -> None:
        content, reasoning, calls = "", "", {}
        for e in events:
            if not isinstance(e.data, dict):
                continue
            for choice in e.data.get("choices") or []:
                delta = choice["delta"]
                content += delta.get("content") or ""
                reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
                for tc in delta.get("tool_calls") or []:
                    slot = calls.setdefault(
                        tc["index"],
                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    slot["id"] = tc.get("id") or slot["id"]
                    fn = tc.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        self._fill(reply, message)

    def append_turn(self, reply: Reply) -> None:
        self.history.append(reply.turn)

    def append_tool_results(self, results: list[tuple[str, str]]) -> None:
        for tid, text in results:
            self.history.append({"role": "tool", "tool_call_id": tid, "content": text})


# -- Responses ----------------------------------------------------------------------------------


class ResponsesHarness(Harness):
    """As Codex CLI: ``store: false``, encrypted reasoning included, every output item sent
    back as an input item (reasoning items without their id)."""

    api = "responses"

    def tools(self) -> list[dict[str, Any]]:
        return [
            {"type": "function", "name": n, "description": d, "parameters": p, "strict": False}
            for n, d, p in TOOL_SPECS
        ]

    def start(self, task: str = TASK) -> None:
        self.history = [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": task}]}
        ]

    def body(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "instructions": SYSTEM,
            "input": self.history,
            "tools": self.tools(),
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "stream": self.stream,
            **self.extra,
        }

    def _fill(self, reply: Reply, items: list[dict[str, Any]]) -> None:
        texts, reasoning = [], []
        for item in items:
            if item["type"] == "message":
                texts += [p["text"] for p in item["content"] if p["type"] == "output_text"]
            elif item["type"] == "reasoning":
                reasoning += [p["text"] for p in item.get("content") or []]
            elif item["type"] == "function_call":
                reply.tool_calls.append(
                    (item["call_id"], item["name"], json.loads(item["arguments"]))
                )
        reply.content = "".join(texts)
        reply.reasoning = "".join(reasoning) if reasoning else None
        turn = []
        for item in items:
            if item["type"] == "reasoning":
                item = {k: v for k, v in item.items() if k != "id"}
            turn.append(item)
        reply.turn = turn

    def parse_whole(self, reply: Reply, body: Any) -> None:
        self._fill(reply, body["output"])

    def parse_stream(self, reply: Reply, events: list[Event]) -> None:
        items = [e.data["item"] for e in events if e.name == "response.output_item.done"]
        completed = [e.data for e in events if e.name == "response.completed"]
        if completed:
            reply.body = completed[-1]["response"]
        self._fill(reply, items)

    def append_turn(self, reply: Reply) -> None:
        self.history += reply.turn

    def append_tool_results(self, results: list[tuple[str, str]]) -> None:
        for tid, text in results:
            self.history.append({"type": "function_call_output", "call_id": tid, "output": text})


# -- Anthropic Messages -------------------------------------------------------------------------


class MessagesHarness(Harness):
    """As Claude Code: thinking enabled, content blocks sent back as the assistant message."""

    api = "messages"

    def tools(self) -> list[dict[str, Any]]:
        return [{"name": n, "description": d, "input_schema": p} for n, d, p in TOOL_SPECS]

    def start(self, task: str = TASK) -> None:
        self.history = [{"role": "user", "content": [{"type": "text", "text": task}]}]

    def body(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "max_tokens": 4096,
            "system": [{"type": "text", "text": SYSTEM}],
            "messages": self.history,
            "tools": self.tools(),
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "stream": self.stream,
            **self.extra,
        }

    def _fill(self, reply: Reply, blocks: list[dict[str, Any]]) -> None:
        texts, reasoning = [], []
        for block in blocks:
            if block["type"] == "text":
                texts.append(block["text"])
            elif block["type"] == "thinking":
                reasoning.append(block["thinking"])
            elif block["type"] == "tool_use":
                reply.tool_calls.append((block["id"], block["name"], block["input"]))
        reply.content = "".join(texts)
        reply.reasoning = "".join(reasoning) if reasoning else None
        reply.turn = blocks

    def parse_whole(self, reply: Reply, body: Any) -> None:
        self._fill(reply, body["content"])

    def parse_stream(self, reply: Reply, events: list[Event]) -> None:
        blocks: dict[int, dict[str, Any]] = {}
        partial: dict[int, str] = {}
        for e in events:
            data = e.data
            if not isinstance(data, dict):
                continue
            kind = data.get("type")
            if kind == "content_block_start":
                blocks[data["index"]] = dict(data["content_block"])
                partial[data["index"]] = ""
            elif kind == "content_block_delta":
                block, delta = blocks[data["index"]], data["delta"]
                if delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] += delta["thinking"]
                elif delta["type"] == "signature_delta":
                    block["signature"] = delta["signature"]
                elif delta["type"] == "input_json_delta":
                    partial[data["index"]] += delta["partial_json"]
            elif kind == "content_block_stop":
                block = blocks[data["index"]]
                if block["type"] == "tool_use":
                    text = partial[data["index"]]
                    block["input"] = json.loads(text) if text else {}
        self._fill(reply, [blocks[i] for i in sorted(blocks)])

    def append_turn(self, reply: Reply) -> None:
        self.history.append({"role": "assistant", "content": reply.turn})

    def append_tool_results(self, results: list[tuple[str, str]]) -> None:
        self.history.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tid, "content": text}
                    for tid, text in results
                ],
            }
        )


HARNESSES: dict[str, type[Harness]] = {
    "chat_completions": ChatHarness,
    "responses": ResponsesHarness,
    "messages": MessagesHarness,
}


def harness(api: str, stack: Stack, rollout: str, *, stream: bool) -> Harness:
    h = HARNESSES[api](stack, rollout, stream=stream)
    h.start()
    return h
