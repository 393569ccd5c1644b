import json

from capture_proxy.core.sse import SSEEvent, SSEStreamDecoder

STREAM = (
    'data: {"a": "h\u00e9llo \u2603"}\n\n'
    ": keep-alive comment\n\n"
    'data: {"b": 2}\r\n\r\n'
    "event: custom\ndata: line1\ndata: line2\n\n"
    "data: [DONE]\n\n"
).encode()

EXPECTED = [
    SSEEvent("", json.dumps({"a": "h\u00e9llo \u2603"}, ensure_ascii=False)),
    SSEEvent("", '{"b": 2}'),
    SSEEvent("custom", "line1\nline2"),
    SSEEvent("", "[DONE]"),
]


def _decode_in_pieces(data: bytes, size: int) -> list[SSEEvent]:
    decoder = SSEStreamDecoder()
    events = []
    for i in range(0, len(data), size):
        events += decoder.feed(data[i : i + size])
    return events + decoder.close()


def test_whole_stream():
    assert _decode_in_pieces(STREAM, len(STREAM)) == EXPECTED


def test_every_split_size_gives_the_same_events():
    # Includes splits inside multi-byte UTF-8 characters and between \r and \n.
    for size in range(1, 40):
        assert _decode_in_pieces(STREAM, size) == EXPECTED, size


def test_stream_cut_without_final_blank_line_still_yields_last_event():
    decoder = SSEStreamDecoder()
    assert decoder.feed(b'data: {"x": 1}\n') == []
    assert decoder.close() == [SSEEvent("", '{"x": 1}')]


def test_encode_round_trip():
    event = SSEEvent("custom", "line1\nline2")
    decoder = SSEStreamDecoder()
    assert decoder.feed(event.encode()) == [event]
