"""Streamed calls hand the store the request side of their record, encoded while the engine
generated (``request_encoding.RequestEncoding``), and the token digests verification made
(``RecordDigests``), in both prompt modes; the store never computes them again for them, and
the stored calls are all there (one chain in exact-token mode)."""

from __future__ import annotations

import pytest

from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.test_exact_tokens import _session


class HandedStore(SQLiteStore):
    """Keeps, per ``put_call``, whether an encoding came with it and belonged to the record,
    and whether token digests came with it and were of its arrays."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.handed: list[bool | None] = []
        self.digests: list[bool | None] = []

    async def put_call(self, record, request=None, digests=None):
        self.handed.append(None if request is None else request.belongs_to(record))
        self.digests.append(None if digests is None else digests.same_tokens(record))
        await super().put_call(record, request, digests)


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_streamed_calls_hand_over_their_request_encoding(
    make_stack, tmp_path, monkeypatch, prompt_mode
):
    store = HandedStore(tmp_path / "handed")
    stack = await make_stack(store=store, prompt_mode=prompt_mode)
    computed: list[tuple[int, bool]] = []
    original = RequestEncoding.of.__func__  # type: ignore[attr-defined]

    def counting(cls, messages, tools, digests=None, *known_tools):
        computed.append((len(messages), digests is not None))
        return original(cls, messages, tools, digests, *known_tools)

    monkeypatch.setattr(RequestEncoding, "of", classmethod(counting))
    ids = await _session(stack, "r1", stream=True)
    assert store.handed == [True, True, True]
    assert store.digests == [True, True, True]
    # once per call, in the proxy, from the messages' known facts; never again in the store
    assert computed == [(2, True), (4, True), (6, True)]
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    stored = [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]]
    assert sorted(sum(stored, [])) == sorted(ids)
    if prompt_mode == "exact_tokens":
        assert stored == [ids]


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
async def test_a_call_validates_only_the_messages_no_earlier_call_had(
    make_stack, monkeypatch, prompt_mode
):
    from capture_proxy.core import requests as requests_module

    stack = await make_stack(prompt_mode=prompt_mode)
    validated: list[int] = []
    adapter = requests_module._MESSAGES

    class Counting:
        def validate_python(self, messages):
            validated.append(len(messages))
            return adapter.validate_python(messages)

    monkeypatch.setattr(requests_module, "_MESSAGES", Counting())
    ids = await _session(stack, "r1", stream=False)
    # 2, 4 and 6 messages sent; each call brings 2 new ones (the answer and a tool result)
    assert validated == [2, 2, 2]
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [ids]
