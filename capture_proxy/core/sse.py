"""Incremental Server-Sent Events decoding over arbitrary network chunks.

Owns turning a byte stream into SSE events without assuming that network chunks line up with
events, lines or even UTF-8 characters. Line splitting and event interpretation are
httpx-sse's decoders (WHATWG SSE rules); this module adds incremental UTF-8 decoding and the
end-of-stream flush. It does no I/O.
"""

from __future__ import annotations

import codecs
import json
import math
from typing import Any, NamedTuple

import orjson
from httpx_sse._decoders import SSEDecoder, SSELineDecoder

DONE_SENTINEL = "[DONE]"


class SSEEvent(NamedTuple):
    """One event: ``event`` name ('' when absent) and ``data`` (data lines joined by '\\n').
    A NamedTuple: one is made per streamed token, on the hot path."""

    event: str
    data: str

    @property
    def is_done(self) -> bool:
        return self.data == DONE_SENTINEL

    def encode(self) -> bytes:
        """Wire form of the event, ``data:`` lines then a blank line."""
        head = f"event: {self.event}\n" if self.event else ""
        body = "".join(f"data: {line}\n" for line in self.data.split("\n"))
        return (head + body + "\n").encode("utf-8")


def encode_json_event(obj: object) -> bytes:
    """``data: <compact JSON>`` and a blank line, for one chunk object (UTF-8; NaN as null).
    An integer past 64 bits (read by ``parse_json_event``'s stdlib fallback), which orjson
    cannot write, is written by the stdlib, NaN and infinities still as null."""
    try:
        return b"data: " + orjson.dumps(obj) + b"\n\n"
    except TypeError:
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"))
        return b"data: " + text.encode("utf-8") + b"\n\n"


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None (what orjson writes for them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def parse_json_event(data: str | bytes) -> Any:
    """Parse an event's data: orjson (fast, strict), then the stdlib for what it refuses but
    some engines send anyway (``NaN``/``Infinity`` literals). Raises ValueError
    (UnicodeDecodeError for bytes that are not UTF-8: strict, as the stream decoder is)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)


class SSEStreamDecoder:
    """Feed bytes as they arrive; get complete events back.

    ``feed`` may be called with any split of the stream (mid-line, mid-character);
    ``close`` flushes a final event that lacked its terminating blank line.
    Raises UnicodeDecodeError on bytes that are not UTF-8.

    The grammar is httpx-sse's (WHATWG rules). One shape takes a short cut, because engines
    send one event per generated token and this runs for each: a block that is exactly one
    ``data: <text>`` line ended by ``\n\n`` becomes ``SSEEvent("", <text>)`` without the
    line-by-line decoders (what they make of it too). Every other block (comments, ``event:``,
    several lines, ``data:`` without its space) goes through httpx-sse whole, and a stream
    that uses ``\r`` line ends is handed to httpx-sse from that byte on, for good.
    """

    def __init__(self) -> None:
        self._pending = b""  # bytes after the last complete block (short-cut mode)
        self._general = False  # True once the stream used \r: httpx-sse's decoders only
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._lines = SSELineDecoder()
        self._events = SSEDecoder()

    def _from_lines(self, lines: list[str]) -> list[SSEEvent]:
        out = []
        for line in lines:
            sse = self._events.decode(line)
            if sse is not None:
                out.append(SSEEvent(sse.event if sse.event != "message" else "", sse.data))
        return out

    def _general_feed(self, data: bytes) -> list[SSEEvent]:
        text = self._utf8.decode(data)
        if not text:
            return []
        return self._from_lines(self._lines.decode(text))

    def _blocks(self, data: bytes) -> list[bytes] | None:
        """The blocks ``data`` completes (short-cut mode); None once the stream is general."""
        if self._general:
            return None
        # find, not ``in``: bytes.__contains__ tries its argument as an int first and raises and
        # clears a TypeError for a bytes one (CPython 3.11: ~1.8k instructions, per event)
        if data.find(b"\r") >= 0:
            self._general = True  # the pending bytes go to httpx-sse first (_general_events)
            return None
        blocks = (self._pending + data).split(b"\n\n") if self._pending else data.split(b"\n\n")
        self._pending = blocks.pop()
        return blocks

    def _general_events(self, data: bytes) -> list[SSEEvent]:
        pending, self._pending = self._pending, b""
        return self._general_feed(pending + data)

    def _block_events(self, block: bytes) -> list[SSEEvent]:
        # A whole block: its lines, then the blank line that ended it.
        return self._from_lines([*block.decode("utf-8").split("\n"), ""])

    def feed(self, data: bytes) -> list[SSEEvent]:
        blocks = self._blocks(data)
        if blocks is None:
            return self._general_events(data)
        out: list[SSEEvent] = []
        for block in blocks:
            if block[:6] == b"data: " and block.find(b"\n") < 0:
                out.append(SSEEvent("", block[6:].decode("utf-8")))
            else:
                out += self._block_events(block)
        return out

    def feed_data(self, data: bytes) -> list[bytes]:
        """``feed`` for a reader of the events' data only (the event names, ids and comments
        dropped): the data of each event ``data`` completes, as bytes. The short cut's data is
        the block's own bytes, not checked as UTF-8 here: the caller's JSON parse checks it
        (orjson refuses bytes that are not UTF-8); data that came the long way was checked.
        Raises UnicodeDecodeError (the long way only)."""
        blocks = self._blocks(data)
        if blocks is None:
            return [event.data.encode("utf-8") for event in self._general_events(data)]
        out: list[bytes] = []
        for block in blocks:
            if block[:6] == b"data: " and block.find(b"\n") < 0:
                out.append(block[6:])
            else:
                out += [event.data.encode("utf-8") for event in self._block_events(block)]
        return out

    def close_data(self) -> list[bytes]:
        """``close`` for a reader of the events' data only (``feed_data``)."""
        return [event.data.encode("utf-8") for event in self.close()]

    def close(self) -> list[SSEEvent]:
        if not self._general:
            pending, self._pending = self._pending, b""
            lines = pending.decode("utf-8").split("\n") if pending else []
            if lines and lines[-1] == "":
                lines.pop()  # what follows the last line end is no line
        else:
            text = self._utf8.decode(b"", final=True)
            lines = self._lines.decode(text) if text else []
            lines += self._lines.flush()
        # A stream cut after the last data line: interpret it as if the blank line had come.
        return self._from_lines([*lines, ""])
