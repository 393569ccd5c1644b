"""The chat front's stream encoder (exact-token mode's events): a delta's event written around
its delta's JSON is byte for byte the event of the chunk dict it stands for."""

from __future__ import annotations

import itertools

import pytest

from capture_proxy.core.fronts.base import Answer
from capture_proxy.core.fronts.chat import ChatStreamEncoder
from capture_proxy.core.sse import encode_json_event

DELTAS = [
    {"content": " hello"},
    {"content": 'é "q" \\ \n'},
    {"reasoning_content": "hmm"},
    {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "ls"}}]},
    {},
]


@pytest.mark.parametrize(
    ("logprobs", "token_ids", "model"),
    list(itertools.product([False, True], [False, True], ["m", None])),
)
def test_a_deltas_event_is_the_chunk_dicts_event(logprobs, token_ids, model):
    body = {"model": "m", "logprobs": logprobs, "return_token_ids": token_ids}
    enc = ChatStreamEncoder(body, Answer("call-1", 1_796_028_430.5, model, {}, None))
    for delta, (ids, lps) in itertools.product(DELTAS, [(None, None), ([7], [-0.5]), ([], [])]):
        shown = (logprobs or token_ids) and ids is not None
        expected = (
            [encode_json_event(enc._chunk(delta, ids, lps))] if delta or (shown and ids) else []
        )
        assert enc.delta(delta, token_ids=ids, log_probs=lps) == expected, (delta, ids)
    assert enc.delta({"content": "x"}) == [
        b'data: {"id":"chatcmpl-call-1","object":"chat.completion.chunk","created":1796028430,'
        + (b'"model":"m"' if model else b'"model":null')
        + b',"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,'
        b'"finish_reason":null}]}\n\n'
    ]
