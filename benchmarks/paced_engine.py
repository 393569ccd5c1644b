"""The saturation bench's engine: vLLM's OpenAI chat dialect at almost no CPU, paced like a
real engine.

Cheap so that the proxy, not the engine, is the bottleneck of ``saturation.py``: HTTP/1.1 on a
bare ``asyncio.Protocol`` (uvloop), no framework; the prompt ``paced_wire``'s one numpy pass;
every streamed event pre-encoded at start-up (one per piece of the answers' vocabulary, with
its chunked-transfer framing), so a token costs one ``transport.write``; ``--processes`` to
spread it over cores (forked, one shared listening socket).

Paced as an engine that batches: a request's last message says its answer's length, its
tokens per second and its time to first token (``paced_wire.parse_directive``). Streams of
one rate are stepped together by one ticker, one token per stream per step, as continuous
batching emits them; the first step after a stream's time to first token sends the role
chunk, ``prompt_token_ids`` and the first token, the last its finish, usage and ``[DONE]``.
A stream whose reader lags more than ``MAX_BUFFERED`` bytes skips steps until it catches up
(the engine's output waits, as vLLM's does for a slow client). A non-streamed answer is sent
whole at time to first token + tokens / rate.

What the answer carries (vLLM 0.11 with ``return_token_ids`` and ``logprobs``): ``token_ids``
and ``logprobs.content`` per token, ``prompt_token_ids`` in the first chunk (streaming) or the
body, ``usage``. Only what the request asks for.

``--served-log FILE``: one JSON line per chat request when its answer ends (``affinity.py``
reads them): ``id`` its ``X-Request-Id`` (the proxy's call id), ``key`` its
``x-smg-routing-key`` (the proxy's routing key), ``t0`` and ``t1`` when it arrived and when its
last byte was written (``time.monotonic()``: one clock for every process of the machine),
``status``, and ``cut`` when the client left first. Written line by line, so it is read while
the engine runs.

Run: ``python benchmarks/paced_engine.py --port N [--processes 1] [--served-log FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import IO

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import paced_wire as wire  # noqa: E402

#: A stream whose transport holds more than this many unsent bytes skips steps.
MAX_BUFFERED = 256 * 1024
_HEAD = b'{"id":"chatcmpl-paced","object":"chat.completion.chunk","created":0,"model":"paced",'
#: The request headers a served-request log keeps: the proxy's call id and routing key.
_LOGGED_HEADERS = frozenset(("x-request-id", "x-smg-routing-key"))
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def _frame(event: bytes) -> bytes:
    """One SSE event as one chunk of a chunked body."""
    data = b"data: " + event + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _entry(text: str, log_prob: float) -> bytes:
    return orjson.dumps(
        {"token": text, "logprob": log_prob, "bytes": list(text.encode()), "top_logprobs": []}
    )


def _token_event(text: str, token_id: int, entry: bytes, full: bool, finish: bool) -> bytes:
    choice = b'{"index":0,"delta":{"content":' + orjson.dumps(text) + b"},"
    choice += b'"logprobs":{"content":[' + entry + b"]}," if full else b'"logprobs":null,'
    choice += b'"finish_reason":"stop","stop_reason":null' if finish else b'"finish_reason":null'
    if full:
        choice += b',"token_ids":[%d]' % token_id
    return _HEAD + b'"choices":[' + choice + b"}]}"


class Events:
    """Every streamed event, pre-encoded: ``token[full][piece]`` (framed), the end token's."""

    def __init__(self) -> None:
        self.entries = [
            _entry(p, lp) for p, lp in zip(wire.PIECES, wire.PIECE_LOG_PROBS, strict=True)
        ]
        self.end_entry = _entry("", wire.END_LOG_PROB)
        self.token = {
            full: [
                _frame(_token_event(p, tid, e, full, False))
                for p, tid, e in zip(wire.PIECES, wire.PIECE_IDS, self.entries, strict=True)
            ]
            for full in (False, True)
        }
        self.end = {
            full: _frame(_token_event("", wire.IM_END, self.end_entry, full, True))
            for full in (False, True)
        }

    @staticmethod
    def first(prompt_json: bytes | None) -> bytes:
        delta = b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        event = _HEAD + delta + b'"logprobs":null,"finish_reason":null}]'
        if prompt_json is not None:
            event += b',"prompt_token_ids":' + prompt_json
        return _frame(event + b"}")

    @staticmethod
    def tail(prompt_tokens: int, tokens: int, usage: bool) -> bytes:
        out = b""
        if usage:
            u = b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
                prompt_tokens,
                tokens,
                prompt_tokens + tokens,
            )
            out += _frame(_HEAD + b'"choices":[],"usage":' + u + b"}")
        return out + b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n")


EVENTS = Events()


class Served:
    """One chat request for the served-request log (``--served-log``): its headers' call id
    and routing key, when it arrived."""

    __slots__ = ("log", "request_id", "key", "t0")

    def __init__(self, log: IO[str], request_id: str | None, key: str | None) -> None:
        self.log, self.request_id, self.key, self.t0 = log, request_id, key, time.monotonic()

    def ended(self, status: int, cut: bool = False) -> None:
        line = {"id": self.request_id, "key": self.key, "t0": self.t0, "t1": time.monotonic()}
        line |= {"status": status, "cut": cut}
        self.log.write(orjson.dumps(line).decode() + "\n")


class Stream:
    """One streamed answer in progress."""

    __slots__ = ("conn", "pieces", "next", "start_at", "first", "tail", "full", "served")

    def __init__(self, conn: Conn, pieces: tuple[int, ...], start_at: float, first: bytes,
                 tail: bytes, full: bool, served: Served | None = None) -> None:  # fmt: skip
        self.conn, self.pieces, self.next, self.start_at = conn, pieces, -1, start_at
        self.first, self.tail, self.full, self.served = first, tail, full, served

    def step(self) -> bool:
        """Send the next token (the first step: the head chunk too); True when done."""
        transport = self.conn.transport
        if transport is None or transport.is_closing():
            if self.served is not None:
                self.served.ended(200, cut=True)
            return True
        if transport.get_write_buffer_size() > MAX_BUFFERED:
            return False
        tokens = EVENTS.token[self.full]
        i = self.next
        if i < 0:
            out, i = self.first, 0
        else:
            out = b""
        if i < len(self.pieces):
            transport.write(out + tokens[self.pieces[i]])
            self.next = i + 1
            return False
        transport.write(out + EVENTS.end[self.full] + self.tail)
        if self.served is not None:
            self.served.ended(200)
        self.conn.done()
        return True


class Ticker:
    """Steps every stream of one rate together, ``rate`` times a second."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self.streams: list[Stream] = []
        self.task: asyncio.Task[None] | None = None

    def add(self, stream: Stream) -> None:
        self.streams.append(stream)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while self.streams:
            now = loop.time()
            self.streams = [s for s in self.streams if now < s.start_at or not s.step()]
            due = max(due + self.interval, now)
            await asyncio.sleep(due - loop.time())
        self.task = None


TICKERS: dict[float, Ticker] = {}


class Conn(asyncio.Protocol):
    """One client connection: requests one after the other (keep-alive)."""

    def __init__(self, served_log: IO[str] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.served_log = served_log

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's: no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next_request()

    def done(self) -> None:
        self.busy = False
        self._next_request()

    def _next_request(self) -> None:
        while not self.busy and self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ", 2)[:2]
            length, named = 0, {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name in _LOGGED_HEADERS:
                    named[name] = value.strip()
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            self.busy = True
            served = None
            if self.served_log is not None and method == "POST":
                key = named.get("x-smg-routing-key")
                served = Served(self.served_log, named.get("x-request-id"), key)
            self._handle(method, path, body, served)

    def _respond(self, status: str, body: bytes, served: Served | None = None) -> None:
        if served is not None:
            served.ended(int(status.split(" ", 1)[0]), cut=self.transport is None)
        if self.transport is None:  # the client left while the answer was generated
            return
        head = b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        self.transport.write(head % (status.encode(), len(body)) + body)
        self.done()

    def _handle(self, method: str, path: str, body: bytes, served: Served | None) -> None:
        if method == "GET":
            models = {"object": "list", "data": [{"id": wire.MODEL, "object": "model"}]}
            self._respond("200 OK", orjson.dumps(models if path == "/v1/models" else {}))
            return
        if not path.startswith("/v1/chat/completions"):
            self._respond("404 Not Found", b'{"error":{"message":"not found"}}', served)
            return
        try:
            request = orjson.loads(body)
            messages = request["messages"]
            last = messages[-1].get("content") or ""
            directive = wire.parse_directive(last if isinstance(last, str) else "")
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            self._respond("400 Bad Request", b'{"error":{"message":"bad request"}}', served)
            return
        seed, tokens, rate, ttft_ms = directive or (0, 32, 1e6, 0.0)
        prompt = wire.prompt_ids(messages)
        full = request.get("return_token_ids") is True and request.get("logprobs") is True
        prompt_json = orjson.dumps(prompt, option=orjson.OPT_SERIALIZE_NUMPY) if full else None
        loop = asyncio.get_running_loop()
        start_at = loop.time() + ttft_ms / 1000
        pieces = wire.answer_pieces(seed, tokens)
        if request.get("stream") is True:
            options = request.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            assert self.transport is not None
            self.transport.write(_SSE_HEAD)
            first = EVENTS.first(prompt_json)
            tail = EVENTS.tail(len(prompt), tokens, usage)
            ticker = TICKERS.get(rate) or TICKERS.setdefault(rate, Ticker(rate))
            ticker.add(Stream(self, pieces, start_at, first, tail, full, served))
            return
        whole = self._whole(pieces, seed, tokens, prompt_json, len(prompt), full)
        loop.call_at(start_at + tokens / rate, self._respond, "200 OK", whole, served)

    @staticmethod
    def _whole(pieces: tuple[int, ...], seed: int, tokens: int, prompt_json: bytes | None,
               prompt_tokens: int, full: bool) -> bytes:  # fmt: skip
        text = orjson.dumps(wire.answer_text(seed, tokens))
        choice = b'{"index":0,"message":{"role":"assistant","content":' + text + b"},"
        if full:
            entries = b",".join([*(EVENTS.entries[i] for i in pieces), EVENTS.end_entry])
            ids = orjson.dumps(wire.answer_ids(seed, tokens))
            choice += b'"logprobs":{"content":[' + entries + b"]},"
            choice += b'"token_ids":' + ids + b","
        else:
            choice += b'"logprobs":null,'
        choice += b'"finish_reason":"stop","stop_reason":null}'
        usage = b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
            prompt_tokens,
            tokens,
            prompt_tokens + tokens,
        )
        out = b'{"id":"chatcmpl-paced","object":"chat.completion","created":0,"model":"paced",'
        out += b'"choices":[' + choice + b'],"usage":' + usage
        if prompt_json is not None:
            out += b',"prompt_token_ids":' + prompt_json
        return out + b"}"


def serve(sock: socket.socket, served_log: IO[str] | None = None) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Conn(served_log), sock=sock, backlog=4096)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument(
        "--served-log",
        type=Path,
        help="append one JSON line per chat request answered (module docstring); one process only",
    )
    args = ap.parse_args()
    if args.served_log is not None and args.processes != 1:
        ap.error("--served-log needs --processes 1")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(4096)
    sock.setblocking(False)
    children = []
    for _ in range(args.processes - 1):
        pid = os.fork()
        if pid == 0:
            serve(sock)
            os._exit(0)
        children.append(pid)
    served_log = args.served_log.open("a", buffering=1) if args.served_log else None
    try:
        serve(sock, served_log)
    except KeyboardInterrupt:
        pass
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


if __name__ == "__main__":
    main()
