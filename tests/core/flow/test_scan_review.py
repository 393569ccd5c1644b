"""Review of the compiled scan at the flow level: random streams of middle chunks (odd
whitespace, escapes, numbers, tool calls, entries of every shape) through ``_Relay`` with the
scan and without it, for the chat, Messages and Responses fronts and every combination of
what the harness asked for: the same record and the same events."""

from __future__ import annotations

import random
import struct
from typing import Any

import orjson
import pytest

from capture_proxy.core import chunk_scan
from capture_proxy.core.fronts.chat import ChatCodec
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.fronts.responses import ResponsesCodec
from capture_proxy.core.sse import encode_json_event
from tests.core.flow.test_template_flow import CHUNKS, play_stream

needs_scan = pytest.mark.skipif(chunk_scan.SCAN is None, reason="the compiled scan is not built")

WS = ["", "", "", " ", "\t", "  "]  # no line breaks: they would end the SSE data line


def _middle(r: random.Random) -> bytes:
    def ws() -> str:
        return r.choice(WS)

    def num() -> str:
        return r.choice(
            [
                "-0",
                "0",
                "-0.0",
                "1e5",
                "-1.5E-3",
                "-0.125",
                "123456789012345678",
                "-7",
                "0.30000000000000001",
                "-2.5e+2",
                str(-r.random() * 20),
                str(r.randint(-9, 9)),
            ]
        )

    def text() -> str:
        return (
            '"'
            + "".join(
                r.choice(
                    [
                        "a",
                        " ",
                        "\\n",
                        "\\u00e9",
                        "\\/",
                        "é",
                        "中",
                        "\U0001f600",
                        '\\"',
                        "\\\\",
                        "\\u0000",
                    ]
                )
                for _ in range(r.randint(0, 4))
            )
            + '"'
        )

    def obj(members: list[tuple[str, str]]) -> str:
        return (
            "{"
            + ws()
            + ",".join(ws() + f'"{k}"' + ws() + ":" + ws() + v + ws() for k, v in members)
            + "}"
        )

    delta = r.choice(
        [
            "null",
            "{}",
            obj([("content", text())]),
            obj([("reasoning_content", text())]),
            obj([("reasoning", text())]),
            obj([("role", '"assistant"'), ("content", text())]),
            obj(
                [
                    (
                        "tool_calls",
                        "["
                        + obj([("index", "0"), ("function", obj([("arguments", text())]))])
                        + "]",
                    )
                ]
            ),
            obj([("content", text()), ("content", text())]),
        ]
    )
    n = r.randint(0, 2)
    entries = [
        r.choice(
            [
                obj(
                    [
                        ("token", text()),
                        ("logprob", r.choice([num(), "null"])),
                        ("bytes", "[1]"),
                        ("top_logprobs", r.choice(["[]", "[" + obj([("logprob", num())]) + "]"])),
                    ]
                ),
                obj([("token", text())]),
                "null",
                "1",
                "[]",
            ]
        )
        for _ in range(n)
    ]
    logprobs = r.choice(
        [
            "null",
            "{}",
            obj([("content", "null")]),
            obj([("content", "[" + ws() + ",".join(entries) + ws() + "]")]),
        ]
    )
    ids = r.choice(
        [
            "null",
            "[]",
            "[" + ",".join(ws() + str(r.randint(0, 2**31 - 1)) + ws() for _ in range(n)) + "]",
        ]
    )
    choice = [
        ("index", "0"),
        ("delta", delta),
        ("logprobs", logprobs),
        ("finish_reason", "null"),
        ("token_ids", ids),
    ]
    r.shuffle(choice)
    top = [
        ("id", text()),
        ("object", '"chat.completion.chunk"'),
        ("created", num()),
        ("model", text()),
        ("choices", "[" + ws() + obj(choice) + ws() + "]"),
    ]
    if r.random() < 0.5:
        top.append(("usage", "null"))
    return b"data: " + (ws() + obj(top) + ws()).encode() + b"\n\n"


def _run(front: Any, body: dict, pieces: list[bytes], scan: Any) -> tuple[list[bytes], Any]:
    return play_stream(front, body, pieces, scan)


def _events(writes: list[bytes]) -> list:
    out = []
    for block in b"".join(writes).split(b"\n\n"):
        lines = block.split(b"\n")
        out.append([orjson.loads(x[6:]) if x.startswith(b"data: {") else x for x in lines])
    return out


def _bits(array: Any) -> list:
    return [struct.pack("<f", float(v)) for v in array.tolist()] if array is not None else None


MSG = [{"role": "user", "content": "Say hi"}]
BODIES = {
    "chat": (
        ChatCodec,
        [
            {"model": "m", "messages": MSG, "stream": True, **extra}
            for extra in (
                {},
                {"logprobs": True},
                {"return_token_ids": True},
                {"stream_options": {"include_usage": True}},
                {
                    "logprobs": True,
                    "return_token_ids": True,
                    "stream_options": {"include_usage": True},
                },
            )
        ],
    ),
    "messages": (
        MessagesCodec,
        [{"model": "m", "messages": MSG, "max_tokens": 16, "stream": True}],
    ),
    "responses": (ResponsesCodec, [{"model": "m", "input": "Say hi", "stream": True}]),
}


@needs_scan
@pytest.mark.parametrize("front_name", list(BODIES))
@pytest.mark.parametrize("seed", range(40))
def test_random_streams_give_the_same_record_and_events_with_the_scan_or_without(front_name, seed):
    r = random.Random(seed)
    make, bodies = BODIES[front_name]
    middles = [_middle(r) for _ in range(r.randint(1, 6))]
    stream = encode_json_event(CHUNKS[0]) + b"".join(middles) + encode_json_event(CHUNKS[1])
    cut = sorted(r.sample(range(1, len(stream)), 3))
    pieces = [stream[i:j] for i, j in zip([0, *cut], [*cut, len(stream)], strict=True)] + [
        b"data: [DONE]\n\n"
    ]
    accepted = []
    scan = chunk_scan.SCAN

    def counted(data: bytes, flags: int):
        result = scan(data, flags)
        accepted.append(result is not None)
        return result

    for body in bodies:
        accepted.clear()
        w1, rec1 = _run(make(), body, pieces, counted)
        w2, rec2 = _run(make(), body, pieces, None)
        assert any(accepted)
        assert _events(w1) == _events(w2)
        for field in ("generation_token_ids", "prompt_token_ids"):
            assert getattr(rec1, field).tolist() == getattr(rec2, field).tolist()
        assert _bits(rec1.generation_log_probs) == _bits(rec2.generation_log_probs)
        assert rec1.response_message == rec2.response_message
        assert rec1.status is rec2.status
        assert rec1.diagnostics == rec2.diagnostics


@needs_scan
def test_an_event_written_over_several_data_lines_reaches_the_harness_whole():
    """SSE lets an engine write one event's JSON over several ``data:`` lines (the data is
    the lines joined by "\\n"): the harness must get one event it can parse, as without the
    scan."""
    from capture_proxy.core.sse import SSEStreamDecoder

    middle = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"content":\ndata: " w\xc3\xb6rld"},"logprobs":{"content":[{"logprob":-0.125}]},'
        b'"finish_reason":null,"token_ids":[21]}]}\n\n'
    )
    stream = encode_json_event(CHUNKS[0]) + middle + encode_json_event(CHUNKS[1])
    pieces = [stream, b"data: [DONE]\n\n"]
    body = {"model": "m", "messages": MSG, "stream": True}
    seen = []

    def harness(writes: list[bytes]) -> list:
        decoder = SSEStreamDecoder()
        datas = decoder.feed_data(b"".join(writes)) + decoder.close_data()
        out = []
        for d in datas:
            try:
                out.append(orjson.loads(d))
            except orjson.JSONDecodeError:
                out.append(("not JSON", d))
        return out

    scan = chunk_scan.SCAN

    def counted(data: bytes, flags: int):
        seen.append(data)
        return scan(data, flags)

    w1, rec1 = _run(ChatCodec(), body, pieces, counted)
    w2, rec2 = _run(ChatCodec(), body, pieces, None)
    assert any(b"\n" in d for d in seen)
    assert harness(w1) == harness(w2)
    assert rec1.response_message == rec2.response_message
