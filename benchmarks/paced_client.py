"""The saturation bench's load client: agent sessions against the paced engine, through a
target (the engine itself, the bare relay, the proxy), at little CPU.

One process runs ``--sessions`` sessions, each on its own keep-alive connection (a harness's),
on a bare ``asyncio.Protocol`` HTTP/1.1 client (uvloop): requests built with orjson, answers
de-chunked and their SSE events counted (``\\n\\n``), never parsed, except every
``--check-every``-th call whose events are parsed whole and compared with the answer the
client asked for (``paced_wire.answer_text``: the client knows every answer before it asks,
so a session echoes it back without reading it). ``saturation.py`` starts several.

A session: a system prompt, a task; ``--calls`` calls, each followed by the answer and a tool
output (``--tool-output-kb``) with the next call's directive; the agent's think time before
each call after the first (uniform in ``--think-s``). Answers ``--tokens`` tokens (uniform),
time to first token ``--ttft-ms`` (uniform), ``--rate`` tokens per second per stream. New
sessions (new rollouts) start until ``--duration-s`` has passed, staggered over ``--ramp-s``
at the start; then each session's call in flight is read to its end (``--drain-s`` at most).

Figures, per call and per process, written as JSON to ``--out``: time to first token, the
gaps between token events as the client read them (a histogram of 0.1 ms bins), tokens and
open streams per second (``time.monotonic()``, the same clock in every process), errors, and
every acknowledged call (its ``X-Capture-Call-Id``, rollout, step, seed, tokens).

Run by ``saturation.py``; alone: ``python benchmarks/paced_client.py --url URL --out F``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import paced_wire as wire  # noqa: E402

BIN_S = 0.0001
BINS = 20_000  # 0.1 ms bins up to 2 s; the last bin holds the rest
CAPTURE = "/ng-rollout/{rollout}/training-token-capture"


class Answer:
    """What one call read: status, call id, event arrivals."""

    def __init__(self, t_send: float) -> None:
        self.t_send = t_send
        self.status = 0
        self.call_id: str | None = None
        self.chunked = False
        self.length = 0
        self.events = 0
        self.first_s: float | None = None
        self.last_event_s = 0.0
        self.body = bytearray()  # kept only when checked (or not streamed)
        self.keep_body = False
        self.expect_tokens = 0
        self.tokens = 0
        self.done = False
        self.tail = b""


class Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, stats: Stats, host: str) -> None:
        self.stats = stats
        self.host = host
        self.transport: Any = None
        self.buf = bytearray()
        self.answer: Answer | None = None
        self.head_done = False
        self.waiter: asyncio.Future[Answer] | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))
        if not self.closed.done():
            self.closed.set_result(None)

    async def call(self, path: str, body: bytes, keep_body: bool, tokens: int) -> Answer:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.answer = Answer(time.monotonic())
        self.answer.keep_body = keep_body
        self.answer.expect_tokens = tokens
        self.head_done = False
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        return await self.waiter

    def data_received(self, data: bytes) -> None:
        a = self.answer
        if a is None:
            return
        now = time.monotonic()
        self.buf += data
        if not self.head_done:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            a.status = int(lines[0].split(" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "x-capture-call-id":
                    a.call_id = value.strip()
                elif name == "transfer-encoding" and "chunked" in value:
                    a.chunked = True
                elif name == "content-length":
                    a.length = int(value)
            del self.buf[: end + 4]
            self.head_done = True
        if a.chunked:
            self._dechunk(a, now)
        elif len(self.buf) >= a.length:
            a.body = self.buf[: a.length]
            del self.buf[: a.length]
            a.first_s = now
            self._finish(a)

    def _dechunk(self, a: Answer, now: float) -> None:
        buf, pos, new = self.buf, 0, bytearray()
        while True:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            size = int(buf[pos:nl].split(b";")[0], 16)
            if len(buf) < nl + 2 + size + 2:
                break
            if size == 0:
                a.done = True
                pos = nl + 4
                break
            new += buf[nl + 2 : nl + 2 + size]
            pos = nl + 2 + size + 2
        del buf[:pos]
        if new:
            self._events(a, bytes(new), now)
        if a.done:
            self._finish(a)

    def _events(self, a: Answer, data: bytes, now: float) -> None:
        joined = a.tail + data
        k = joined.count(b"\n\n") - a.tail.count(b"\n\n")
        a.tail = data[-1:]
        if a.keep_body:
            a.body += data
        if k <= 0:
            return
        # the first event is the role chunk, the last two usage and [DONE]
        tokens = min(k if a.events else k - 1, a.expect_tokens - a.tokens)
        a.tokens += tokens
        if a.first_s is None:
            a.first_s = now
        elif tokens > 0:
            self.stats.gap(now - a.last_event_s, tokens)
        a.events += k
        a.last_event_s = now
        self.stats.tokens(now, tokens)

    def _finish(self, a: Answer) -> None:
        self.answer = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(a)


class Stats:
    """Figures of one client process."""

    def __init__(self) -> None:
        self.gaps = np.zeros(BINS, dtype=np.int64)
        self.tokens_by_s: dict[int, int] = defaultdict(int)
        self.open_by_s: dict[int, int] = defaultdict(int)
        self.open = 0
        self.ttft_s: list[float] = []
        self.calls: list[list[Any]] = []
        self.errors: dict[str, int] = defaultdict(int)

    def gap(self, seconds: float, tokens: int) -> None:
        self.gaps[min(BINS - 1, int(seconds / BIN_S))] += 1
        if tokens > 1:
            self.gaps[0] += tokens - 1  # read together: no gap between them

    def tokens(self, now: float, n: int) -> None:
        self.tokens_by_s[int(now)] += n

    def opened(self, delta: int) -> None:
        self.open += delta
        second = int(time.monotonic())
        self.open_by_s[second] = max(self.open_by_s[second], self.open)


def _checked(a: Answer, text: str, stream: bool) -> str | None:
    """What is wrong with a whole answer (None: it is the one asked for)."""
    if not stream:
        message = orjson.loads(a.body)["choices"][0]["message"]
        return None if message.get("content") == text else "content differs"
    parts, done = [], False
    for line in bytes(a.body).split(b"\n\n"):
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            done = True
            continue
        for choice in orjson.loads(line[6:]).get("choices") or []:
            parts.append((choice.get("delta") or {}).get("content") or "")
    if not done:
        return "no [DONE]"
    return None if "".join(parts) == text else "content differs"


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stats = Stats()
        self.rng = random.Random(args.seed)
        self.stop_at = 0.0
        host, port = args.url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port.rstrip("/"))
        self.system = "You are a coding agent." + " Keep edits small." * int(args.system_kb * 56)
        self.tool_pad = "x" * int(args.tool_output_kb * 1024)
        self.checked = 0

    def _uniform(self, bounds: tuple[float, float]) -> float:
        return self.rng.uniform(*bounds)

    def _body(self, messages: list[dict[str, Any]]) -> bytes:
        stream = self.args.stream
        body: dict[str, Any] = {"model": wire.MODEL, "messages": messages, "stream": stream}
        if self.args.stream:
            body["stream_options"] = {"include_usage": True}
        if self.args.augment:  # what the proxy sends the engine: the direct and relay targets
            body |= {"logprobs": True, "top_logprobs": 0, "return_token_ids": True}
        return orjson.dumps(body)

    async def _connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: Conn(self.stats, f"{self.host}:{self.port}"), self.host, self.port
        )
        return conn

    async def session(self, index: int) -> None:
        a, conn, k = self.args, None, 0
        await asyncio.sleep(a.ramp_s * index / max(1, a.sessions))
        while time.monotonic() < self.stop_at:
            rollout = f"{a.run}-p{a.proc}-s{index}-{k}"
            k += 1
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": self.system},
                {"role": "user", "content": f"Task {rollout}."},
            ]
            for step in range(a.calls):
                if step and a.think_s[1] > 0:
                    await asyncio.sleep(self._uniform(a.think_s))
                if time.monotonic() >= self.stop_at:
                    return
                if conn is None or conn.transport is None:
                    try:
                        conn = await self._connect()
                    except OSError as exc:
                        self.stats.errors[f"connect {type(exc).__name__}"] += 1
                        await asyncio.sleep(1)
                        break
                seed = self.rng.getrandbits(31)
                tokens = int(self._uniform(a.tokens))
                d = wire.directive(seed, tokens, a.rate, self._uniform(a.ttft_ms))
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + " " + d}
                ok = await self._call(conn, rollout, step, messages, seed, tokens)
                if not ok:
                    await asyncio.sleep(1)  # a failed session ends; the next starts later
                    break
                text = wire.answer_text(seed, tokens)
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": f"Tool output {step}: {self.tool_pad}"},
                ]

    async def _call(self, conn: Conn, rollout: str, step: int, messages: list[dict[str, Any]],
                    seed: int, tokens: int) -> bool:  # fmt: skip
        a, stats = self.args, self.stats
        path = (CAPTURE.format(rollout=rollout) if a.capture else "") + "/v1/chat/completions"
        self.checked += 1
        check = self.checked % a.check_every == 0 or not a.stream
        stats.opened(1)
        try:
            answer = await asyncio.wait_for(
                conn.call(path, self._body(messages), check, tokens), a.call_timeout_s
            )
        except (ConnectionError, OSError, TimeoutError) as exc:
            stats.errors[type(exc).__name__] += 1
            if conn.transport is not None:
                conn.transport.close()
            return False
        finally:
            stats.opened(-1)
        error = None
        if answer.status != 200:
            error = f"http {answer.status}"
        elif a.stream and answer.events != tokens + 3:
            error = f"events {answer.events} != {tokens + 3}"
        elif check:
            error = _checked(answer, wire.answer_text(seed, tokens), a.stream)
        if error is not None:
            stats.errors[error] += 1
            return False
        assert answer.first_s is not None
        stats.ttft_s.append(answer.first_s - answer.t_send)
        t = answer.t_send
        stats.calls.append(
            [
                answer.call_id,
                rollout,
                step,
                seed,
                tokens,
                t,
                answer.first_s - t,
                time.monotonic() - t,
            ]
        )
        return True

    async def run(self) -> dict[str, Any]:
        a = self.args
        start = time.monotonic()
        self.stop_at = start + a.duration_s
        tasks = [asyncio.create_task(self.session(i)) for i in range(a.sessions)]
        done, pending = await asyncio.wait(tasks, timeout=a.duration_s + a.drain_s)
        for t in pending:
            t.cancel()
        for t in done:
            if t.exception() is not None:
                self.stats.errors[f"session {type(t.exception()).__name__}"] += 1
        s = self.stats
        return {
            "started": start,
            "gaps": s.gaps.tolist(),
            "tokens_by_s": dict(s.tokens_by_s),
            "open_by_s": dict(s.open_by_s),
            "ttft_s": s.ttft_s,
            "calls": s.calls,
            "errors": dict(s.errors),
            "cut": len(pending),
        }


def _pair(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    return float(lo), float(hi or lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--capture", action="store_true", help="send under the capture path")
    ap.add_argument("--augment", action="store_true", help="ask token ids and log probs")
    ap.add_argument("--no-stream", dest="stream", action="store_false")
    ap.add_argument("--sessions", type=int, default=512)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--tokens", type=_pair, default=(512, 2048))
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--ttft-ms", type=_pair, default=(100, 400))
    ap.add_argument("--think-s", type=_pair, default=(0.5, 3.0))
    ap.add_argument("--system-kb", type=float, default=4.0)
    ap.add_argument("--tool-output-kb", type=float, default=2.0)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--ramp-s", type=float, default=5.0)
    ap.add_argument("--drain-s", type=float, default=120.0)
    ap.add_argument("--call-timeout-s", type=float, default=300.0)
    ap.add_argument("--check-every", type=int, default=16)
    ap.add_argument("--run", default="sat")
    ap.add_argument("--proc", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    import uvloop

    result = uvloop.run(Client(args).run())
    Path(args.out).write_bytes(orjson.dumps(result, option=orjson.OPT_NON_STR_KEYS))


if __name__ == "__main__":
    main()
