import codecs
import json
import random

import pytest
from httpx_sse._decoders import SSEDecoder, SSELineDecoder

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


def _data_in_pieces(data: bytes, size: int) -> list[bytes]:
    decoder = SSEStreamDecoder()
    out: list[bytes] = []
    for i in range(0, len(data), size):
        out += decoder.feed_data(data[i : i + size])
    return out + decoder.close_data()


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


def _reference(data: bytes, size: int) -> list[SSEEvent]:
    """httpx-sse's decoders alone, line by line (what SSEStreamDecoder must equal)."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    lines_decoder, events_decoder = SSELineDecoder(), SSEDecoder()
    lines: list[str] = []
    for i in range(0, len(data), size):
        lines += lines_decoder.decode(utf8.decode(data[i : i + size]))
    lines += lines_decoder.decode(utf8.decode(b"", final=True)) + lines_decoder.flush()
    out = []
    for line in [*lines, ""]:
        sse = events_decoder.decode(line)
        if sse is not None:
            out.append(SSEEvent(sse.event if sse.event != "message" else "", sse.data))
    return out


BLOCKS = [
    'data: {"choices": [{"delta": {"content": "h\u00e9 \u2603"}}]}\n\n',
    "data: [DONE]\n\n",
    "data:no-space\n\n",
    "data: \n\n",
    "data:\n\n",
    ": keep-alive\n\n",
    "event: custom\ndata: a\ndata: b\n\n",
    "id: 7\ndata: with id\n\n",
    "retry: 100\n\n",
    "\n\n",
    "\n",
    "data: x\n",
    "data: y",
    "data: crlf\r\n\r\n",
    "data: cr\r\r",
]


def test_the_short_cut_gives_what_httpx_sse_gives_for_any_stream_and_split():
    # feed_data is feed with the names, ids and comments dropped and the data as UTF-8 bytes,
    # whichever way (short cut or httpx-sse) each block goes.
    rng = random.Random(20261130)
    for _ in range(400):
        text = "".join(rng.choice(BLOCKS) for _ in range(rng.randint(1, 8)))
        data = text.encode()
        for size in (1, 2, 3, 7, 64, len(data)):
            want = _reference(data, size)
            assert _decode_in_pieces(data, size) == want, (text, size)
            assert _data_in_pieces(data, size) == [e.data.encode() for e in want], (text, size)


def test_engine_shaped_stream_takes_the_short_cut_and_stays_exact():
    events = [json.dumps({"i": i, "text": "\u00e9" * i}, ensure_ascii=False) for i in range(50)]
    data = "".join(f"data: {e}\n\n" for e in [*events, "[DONE]"]).encode()
    for size in (1, 5, 13, len(data)):
        decoder = SSEStreamDecoder()
        got = []
        for i in range(0, len(data), size):
            got += decoder.feed(data[i : i + size])
        got += decoder.close()
        assert got == [SSEEvent("", e) for e in [*events, "[DONE]"]]
        assert not decoder._general


def test_bytes_that_are_not_utf8_are_refused():
    decoder = SSEStreamDecoder()
    with pytest.raises(UnicodeDecodeError):
        decoder.feed(b"data: \xff\xfe\n\n")
    cut = SSEStreamDecoder()
    assert cut.feed("data: \u2603".encode()[:-1]) == []
    with pytest.raises(UnicodeDecodeError):
        cut.close()


def test_the_data_only_short_cut_hands_the_bytes_on_unchecked_and_the_long_way_checks_them():
    # The short cut's data is the block's bytes: the caller's JSON parse refuses bad UTF-8.
    assert SSEStreamDecoder().feed_data(b"data: \xff\xfe\n\n") == [b"\xff\xfe"]
    with pytest.raises(UnicodeDecodeError):
        SSEStreamDecoder().feed_data(b"event: x\ndata: \xff\xfe\n\n")
    assert _data_in_pieces(STREAM, 5) == [event.data.encode() for event in EXPECTED]


def test_an_event_with_an_integer_past_64_bits_is_written_by_the_stdlib():
    """orjson cannot write an integer the stdlib fallback of ``parse_json_event`` read (an
    engine's NaN took that path): the event is still written, NaN as null as orjson would."""
    from capture_proxy.core.sse import encode_json_event, parse_json_event

    chunk = parse_json_event('{"a":NaN,"b":123456789012345678901234567890,"c":"é"}'.encode())
    assert encode_json_event(chunk) == (
        'data: {"a":null,"b":123456789012345678901234567890,"c":"é"}\n\n'.encode()
    )
