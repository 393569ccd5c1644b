"""The tools memo end to end (``core.known_tools``): two calls through the proxy with a harness's
real tools (OpenCode's, Codex's, Claude Code's, from the fixtures), in both prompt modes. The
second call takes the first one's facts (nothing derived again) and its record stores the same
tools text, content address and request digest as derived without the memo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.core import known_tools as known_tools_module
from capture_proxy.core.capture import prepare_request
from capture_proxy.core.fronts import front_for
from capture_proxy.core.linking.digests import request_digest
from capture_proxy.core.records import CallRecord
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.stored_form import canonical_json, json_sha256
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.api_clients import MODEL, capture_url

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HARNESS_TOOLS = {
    "chat_completions": FIXTURES / "opencode" / "logs" / "03_step_limit_ignored.jsonl",
    "responses": FIXTURES / "codex" / "01_tool_session.jsonl",
    "messages": FIXTURES / "claude_code" / "01_tool_session.jsonl",
}


def _tools(api: str) -> Any:
    for line in HARNESS_TOOLS[api].read_text().splitlines():
        body = json.loads(line).get("body")
        if isinstance(body, dict) and body.get("tools"):
            return body["tools"]
    raise AssertionError(api)


def _body(api: str, task: str) -> dict[str, Any]:
    tools = _tools(api)  # a new object per request, as a harness's next request parses it
    if api == "chat_completions":
        messages = [{"role": "system", "content": "You are a coding agent."}]
        return {"model": MODEL, "messages": [*messages, {"role": "user", "content": task}],
                "tools": tools}  # fmt: skip
    if api == "responses":
        return {"model": MODEL, "instructions": "You are a coding agent.", "input": task,
                "tools": tools, "store": False}  # fmt: skip
    return {"model": MODEL, "max_tokens": 64, "system": "You are a coding agent.",
            "messages": [{"role": "user", "content": task}], "tools": tools}  # fmt: skip


class KeptStore(SQLiteStore):
    """Keeps each ``put_call``'s record and the request encoding handed with it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.puts: list[tuple[CallRecord, RequestEncoding | None]] = []

    async def put_call(self, record, request=None, digests=None):
        self.puts.append((record, request))
        await super().put_call(record, request, digests)


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
@pytest.mark.parametrize("api", ["chat_completions", "responses", "messages"])
async def test_a_second_call_takes_the_tools_facts_and_stores_the_same(
    make_stack, tmp_path, monkeypatch, api, prompt_mode
):
    store = KeptStore(tmp_path / "kept")
    stack = await make_stack(store=store, prompt_mode=prompt_mode)
    derived: list[int] = []
    original = known_tools_module.derive_tools_facts

    def counting(tools: Any, key: bytes | None) -> Any:
        derived.append(len(tools))
        return original(tools, key)

    monkeypatch.setattr(known_tools_module, "derive_tools_facts", counting)
    bodies = [_body(api, "List the files."), _body(api, "Read the notes.")]
    for body in bodies:
        resp = await stack.client.post(capture_url("r1", api), json=body)
        assert resp.status == 200, await resp.text()
    # the first call derived the facts of its tools (once), the second none
    assert derived == [len(bodies[0]["tools"])]
    assert len(store.puts) == 2
    for body, (record, request) in zip(bodies, store.puts, strict=True):
        # what the record's request digest and tools texts are without the memo
        front = front_for(f"/v1/{'chat/completions' if api == 'chat_completions' else api}")
        assert front is not None
        chat = front.parse(json.loads(json.dumps(body))).chat
        assert record.linking is not None
        assert record.linking["request_digest"] == request_digest(prepare_request(chat, None).body)
        assert record.request_tools == chat["tools"]
        assert request is not None and request.belongs_to(record)
        assert request.tools_text == canonical_json(chat["tools"])
        assert request.tools_sha256 == json_sha256(canonical_json(chat["tools"]))
        if api == "chat_completions":
            assert request.received_tools is None  # the chat tools are the received ones
            assert record.request_received["tools"] is record.request_tools
        else:
            assert request.received_tools is record.request_received["tools"]
            assert request.received_tools_text == canonical_json(body["tools"])
            assert request.received_tools_sha256 == json_sha256(canonical_json(body["tools"]))
    # the second record's tools are the first's, by value and content address
    (first, first_request), (second, second_request) = store.puts
    assert second.request_tools == first.request_tools
    assert first_request is not None and second_request is not None
    assert second_request.tools_sha256 == first_request.tools_sha256
    # and the store reads back what was sent
    for record, _ in store.puts:
        stored = await store.get_call(record.call_id)
        assert stored is not None and stored.request_tools == record.request_tools
        assert stored.request_received == record.request_received
