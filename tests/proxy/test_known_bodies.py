"""Request bodies read from the bytes their history does not repeat, end to end
(``core.known_bodies``): an agent session through the proxy, its requests written as a harness
writes them (compact JSON, UTF-8, the history first), in both prompt modes. From the third call
on, each request's repeated history is taken from the one before (its messages the same
objects), and every record holds what the whole parse gives: the request's messages, its
request digest (the formula's), one chain; and each prompt's blocks shared with its parent's
are not hashed again."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from capture_proxy.core.capture import prepare_request
from capture_proxy.core.fronts import front_for
from capture_proxy.core.known_bodies import ParsedBody
from capture_proxy.core.linking.digests import request_digest
from capture_proxy.core.prefixes import PREFIX_BLOCK, block_states
from capture_proxy.core.records import CallRecord
from capture_proxy.proxy.keys import LINKER_KEY
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.api_clients import MODEL, capture_url

CAPTURE = "/ng-rollout/{rollout}/training-token-capture/v1/chat/completions"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


class KeptStore(SQLiteStore):
    """Keeps each ``put_call``'s record."""

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self.records: list[CallRecord] = []

    async def put_call(self, record, request=None, digests=None):
        await super().put_call(record, request, digests)
        self.records.append(record)


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_a_session_reads_each_request_from_the_one_before(make_stack, tmp_path, prompt_mode):
    store = KeptStore(tmp_path / "kept")
    stack = await make_stack(store=store, prompt_mode=prompt_mode)
    known_bodies = stack.client.app[LINKER_KEY].known_bodies
    reads: list[ParsedBody] = []
    parse = known_bodies.parse

    def read(raw: bytes, scope: str, name: str) -> ParsedBody:
        reads.append(parse(raw, scope, name))
        return reads[-1]

    known_bodies.parse = read  # type: ignore[method-assign]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. ✓\n" + "Keep edits small. " * 200},
        {"role": "user", "content": "Read the notes, then sum up."},
    ]
    sent: list[dict[str, Any]] = []
    for turn in range(4):
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0.0}
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        resp = await stack.client.post(
            CAPTURE.format(rollout="r1"), data=raw, headers={"Content-Type": "application/json"}
        )
        assert resp.status == 200, await resp.text()
        answer = (await resp.json())["choices"][0]["message"]
        sent.append(body)
        kept = reads[-1].kept
        assert kept is not None and kept.raw == raw
        assert kept.facts is not None and len(kept.facts) == len(messages)
        assert kept.digest_state is not None
        messages = [
            *messages,
            {k: v for k, v in answer.items() if v is not None},
            {"role": "user", "content": f"And part {turn + 2}?"},
        ]
    # each request repeated the whole history of the one before, taken as it was read
    assert [r.repeated for r in reads] == [0, 2, 4, 6]
    for earlier, later in zip(reads, reads[1:], strict=False):
        shared = zip(
            earlier.body["messages"], later.body["messages"][: later.repeated], strict=True
        )
        assert all(a is b for a, b in shared)
    assert len(known_bodies) == 1  # each call's body replaced the one it extended
    assert len(store.records) == 4
    front = front_for("/v1/chat/completions")
    assert front is not None
    for body, record in zip(sent, store.records, strict=True):
        whole = orjson.loads(orjson.dumps(body))
        assert orjson.dumps(record.request_messages) == orjson.dumps(whole["messages"])
        chat = front.parse(whole).chat
        assert record.linking is not None
        assert record.linking["request_digest"] == request_digest(prepare_request(chat, None).body)
    # one chain: each call the child of the one before
    parents = [r.parent_call_id for r in store.records]
    assert parents == [None, *(r.call_id for r in store.records[:-1])]
    # each prompt's whole blocks shared with its parent's were not hashed again: its block
    # states begin with the parent's own (``RecordDigests.seed``), and are the formula's
    recent = stack.client.app[LINKER_KEY].recent
    for parent, child in zip(store.records, store.records[1:], strict=False):
        theirs, mine = recent.digests(parent.call_id), recent.digests(child.call_id)
        assert theirs is not None and mine is not None
        shared = parent.prompt_token_ids.shape[0] // PREFIX_BLOCK
        assert shared >= 2
        assert mine.block_states()[shared] is theirs.block_states()[shared]
        fresh = block_states(child.prompt_token_ids)
        assert [s.digest() for s in mine.block_states()] == [s.digest() for s in fresh]


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_a_messages_session_converts_each_message_once(make_stack, tmp_path, prompt_mode):
    """Anthropic Messages (Claude Code's key order: the history first): the messages a request
    repeats are converted once (``MessagesMemo``), their facts and the request digest go on
    from the earlier request, and every record holds what the whole parse gives."""
    store = KeptStore(tmp_path / "kept")
    stack = await make_stack(store=store, prompt_mode=prompt_mode)
    reads: list[ParsedBody] = []
    known_bodies = stack.client.app[LINKER_KEY].known_bodies
    parse = known_bodies.parse

    def read(raw: bytes, scope: str, name: str) -> ParsedBody:
        reads.append(parse(raw, scope, name))
        return reads[-1]

    known_bodies.parse = read  # type: ignore[method-assign]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read the notes. ✓"}]
    sent = []
    for turn in range(4):
        body = {"model": MODEL, "messages": messages, "system": "You are Claude Code. " * 60,
                "max_tokens": 32, "temperature": 0.0}  # fmt: skip
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        resp = await stack.client.post(
            capture_url("r1", "messages"), data=raw, headers={"Content-Type": "application/json"}
        )
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        sent.append(body)
        messages = [
            *messages,
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": f"And part {turn + 2}?"},
        ]
    # (the second request's first two messages are not the first's key: its one message)
    assert [r.repeated for r in reads] == [0, 0, 3, 5]
    front = front_for("/v1/messages")
    assert front is not None
    for n, (body, record) in enumerate(zip(sent, store.records, strict=True)):
        chat = front.parse(orjson.loads(orjson.dumps(body))).chat
        assert orjson.dumps(record.request_messages) == orjson.dumps(chat["messages"])
        assert record.linking is not None
        assert record.linking["request_digest"] == request_digest(prepare_request(chat, None).body)
        kept = reads[n].kept
        assert kept is not None and kept.facts is not None and kept.digest_state is not None
        if n >= 2:  # the repeated messages' conversions and facts are the earlier call's
            earlier = reads[n - 1].kept
            assert earlier is not None and earlier.canonical is not None
            assert kept.canonical is not None and earlier.facts is not None
            same = len(earlier.canonical)  # (the system message, then each repeated one's)
            assert all(
                a is b for a, b in zip(kept.canonical[:same], earlier.canonical, strict=True)
            )
            assert kept.facts[:same] == earlier.facts[:same]
            hashed = kept.digest_state.messages[:same]  # (the digest went on over these)
            assert all(a is b for a, b in zip(hashed, earlier.canonical, strict=True))
    parents = [r.parent_call_id for r in store.records]
    assert parents == [None, *(r.call_id for r in store.records[:-1])]
