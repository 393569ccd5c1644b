"""Review of the compiled scan (``core/_chunkscan.c``): inputs where what the harness receives
differs between the scan and the Python path. Each test states the harness's view: the data of
the SSE events it decodes (``SSEStreamDecoder``, WHATWG rules, as a harness's client does)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from capture_proxy.core import chunk_scan
from capture_proxy.core.capture import HarnessAsked, strip_chat_chunk
from capture_proxy.core.sse import SSEStreamDecoder, encode_json_event, parse_json_event

SCAN = chunk_scan.SCAN
needs_scan = pytest.mark.skipif(SCAN is None, reason="the compiled scan is not built")

ASKED = HarnessAsked(
    logprobs=False, return_token_ids=False, include_usage=False, routed_experts=False
)


def _harness_view(event: bytes) -> list[bytes]:
    """The data the harness's SSE client reads from one forwarded event."""
    decoder = SSEStreamDecoder()
    return decoder.feed_data(event) + decoder.close_data()


def _python_event(data: bytes) -> bytes:
    stripped = strip_chat_chunk(parse_json_event(data), ASKED)
    assert stripped is not None
    return encode_json_event(stripped)


@needs_scan
@pytest.mark.parametrize(
    "data",
    [
        # an engine that writes its JSON over several `data:` lines: SSE joins them with "\n"
        b'{"id":"x","choices":[{"index":0,\n"delta":{"content":"hi"},"finish_reason":null}]}',
        b'{"id":"x","choices":[{"index":0,"delta":{"content":\n"hi"},"finish_reason":null}]}',
        b'{"id":"x",\n"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}',
        b'{"id":"x","choices":[{"index"\n:0,"delta":{"content":"hi"},"finish_reason":null}]}',
    ],
)
def test_a_line_break_in_the_data_does_not_split_the_harness_event(data: bytes) -> None:
    """SSE data of several lines reaches the relay with "\\n" between them (JSON whitespace):
    the scan accepts it and forwards the engine's bytes, "\\n" included, so the harness reads
    the event's first line alone (its JSON cut) and drops the rest (a line with no field
    name). The Python path re-encodes the chunk on one line."""
    assert SCAN is not None
    wire = b"data: " + data.replace(b"\n", b"\ndata: ") + b"\n\n"
    (engine_data,) = SSEStreamDecoder().feed_data(wire)
    assert engine_data == data  # what the relay hands the scan
    scanned = SCAN(engine_data, chunk_scan.scan_flags(ASKED, event=True))
    expected = [orjson.loads(d) for d in _harness_view(_python_event(engine_data))]
    got_data = (
        _harness_view(scanned[0])
        if scanned is not None
        else _harness_view(_python_event(engine_data))
    )
    got: list[Any] = []
    for d in got_data:
        try:
            got.append(orjson.loads(d))
        except orjson.JSONDecodeError:
            got.append(("not JSON", d))
    assert got == expected


@needs_scan
@pytest.mark.parametrize(
    "data",
    [
        b'{"id":"x","choices":[{"index":0,"delta":{"content":"a","content":"b"},"finish_reason":null}]}',
        b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}","arguments":"{\\"a\\":1}"}}]},"finish_reason":null}]}',
    ],
)
def test_repeated_member_names_reach_the_harness_as_the_record_reads_them(data: bytes) -> None:
    """A repeated name in a member the scan passes through (the delta): the record reads the
    last value (orjson), the Python path sends the harness that one value, the scan sends
    both; a harness whose JSON reader keeps the first (or refuses repeated names, as serde's
    derived structs do) sees an answer the record does not hold."""
    assert SCAN is not None
    scanned = SCAN(data, chunk_scan.scan_flags(ASKED, event=True))
    (expected,) = _harness_view(_python_event(data))
    (got,) = _harness_view(scanned[0]) if scanned is not None else (expected,)
    first_wins = lambda pairs: dict(reversed(pairs))  # noqa: E731
    assert json.loads(got, object_pairs_hook=first_wins) == json.loads(
        expected, object_pairs_hook=first_wins
    )
