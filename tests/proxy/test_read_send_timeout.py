"""Tier 2: the read API's send timeout end to end (``rest.sending``, ``read_send_timeout_s``), on
the proxy as ``serve`` runs it (a handler is not cancelled when its client leaves): an answer
whose client stops reading once it has started (the bulk export, a whole JSON answer) is cut in
time, its handler ends, and the cut is logged and counted; a client reading slowly but steadily
gets the whole export, byte for byte what the encoder makes.

The exports are a few MB: on loopback the kernel takes about 3 MB of an answer before the
proxy's writes wait for the client (its send buffer grows to 4 MiB; the client's receive buffer
is kept small here), so a smaller answer would never stall."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import numpy as np
import pytest
from aiohappyeyeballs import AddrInfoType

from capture_proxy.core.export import ExportEncoder
from capture_proxy.proxy.keys import RECORDER_KEY, STORE_KEY
from capture_proxy.rest.downloads import _encode
from capture_proxy.rest.reads import snapshot_records
from capture_proxy.rest.rollout_state import RolloutState
from tests.factories import record
from tests.proxy.conftest import MakeStack, Stack

SEND_TIMEOUT_S = 0.5
WAIT_S = 10.0
#: Three frozen rollouts of one call each, about 3.6 MB apiece in the export (9 bytes a token).
ROLLOUTS, PROMPT_TOKENS = 3, 400_000


async def _stack(make_stack: MakeStack) -> Stack:
    return await make_stack(read_send_timeout_s=SEND_TIMEOUT_S, cancel_handlers=False)


async def _fill(stack: Stack, rollouts: int = ROLLOUTS, tokens: int = PROMPT_TOKENS) -> None:
    """Frozen rollouts ``r0``, ``r1``, ... of one call each (random prompt ids: nothing in the
    export shrinks them)."""
    store = stack.client.server.app[STORE_KEY]
    rng = np.random.default_rng(0)
    for i in range(rollouts):
        prompt = rng.integers(0, 150_000, tokens).tolist()
        await store.put_call(record(f"c{i}", prompt, [1, 2, 3], rollout_id=f"r{i}"))
        resp = await stack.client.post(f"/captures/rollouts/r{i}/freeze")
        assert resp.status == 200, await resp.text()


def _small_receive_buffer(addr_info: AddrInfoType) -> socket.socket:
    """The client's socket, its receive buffer 4 KiB: the kernel holds little for it."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


@contextlib.asynccontextmanager
async def _client(stack: Stack) -> AsyncIterator[aiohttp.ClientSession]:
    """A session of its own to the proxy (small receive buffers; aiohttp's client stops taking
    bytes from its socket once 128 KiB wait unread)."""
    connector = aiohttp.TCPConnector(socket_factory=_small_receive_buffer)
    async with aiohttp.ClientSession(str(stack.client.make_url("/")), connector=connector) as s:
        yield s


class _Seen(logging.Handler):
    """Sets ``event`` when a line of the ``capture_proxy`` log at ``level`` says ``phrase``
    (logged on the event loop's thread)."""

    def __init__(self, phrase: str, level: int) -> None:
        super().__init__(level)
        self.phrase = phrase
        self.event = asyncio.Event()
        self.lines: list[str] = []

    def emit(self, entry: logging.LogRecord) -> None:
        line = entry.getMessage()
        if self.phrase in line and entry.levelno == self.level:
            self.lines.append(line)
            self.event.set()


@contextlib.contextmanager
def _seeing(phrase: str, level: int) -> Iterator[_Seen]:
    seen = _Seen(phrase, level)
    logger = logging.getLogger("capture_proxy")
    logger.addHandler(seen)
    try:
        yield seen
    finally:
        logger.removeHandler(seen)


@pytest.fixture
def cuts() -> Iterator[_Seen]:
    """The WARNING lines of answers cut by the send timeout."""
    with _seeing("answer cut", logging.WARNING) as seen:
        yield seen


async def _metric(stack: Stack, name: str) -> float:
    text = await (await stack.client.get("/metrics")).text()
    [value] = re.findall(rf"^{name} (\S+)$", text, flags=re.M)
    return float(value)


async def _stalled_then_cut(stack: Stack, cuts: _Seen, path: str) -> bytes:
    """Open ``path``, read its head and stop reading: the proxy must cut the answer within
    ``WAIT_S``. Then read what the sockets held: the answer ends early (a client error)."""
    got = bytearray()
    async with _client(stack) as session, session.get(path) as resp:
        assert resp.status == 200
        started = time.monotonic()
        async with asyncio.timeout(WAIT_S):
            await cuts.event.wait()
        assert time.monotonic() - started < WAIT_S
        with pytest.raises(aiohttp.ClientPayloadError):
            async with asyncio.timeout(WAIT_S):
                async for piece in resp.content.iter_any():
                    got += piece
    return bytes(got)


async def test_an_export_its_client_stops_reading_is_cut_and_its_handler_ends(
    make_stack: MakeStack, cuts: _Seen
):
    stack = await _stack(make_stack)
    await _fill(stack)
    got = await _stalled_then_cut(stack, cuts, "/captures/export?limit=10&after=0")
    assert cuts.lines == [
        "GET /captures/export: answer cut, the client did not take its bytes within 0.5 s "
        "(read_send_timeout_s); connection closed"
    ]  # the path, never the query
    assert 0 < len(got) < ROLLOUTS * PROMPT_TOKENS * 9  # some of it, not all
    assert await _metric(stack, "capture_proxy_read_answers_cut_total") == 1
    # The export's handler has ended: only this scrape's request runs.
    assert await _metric(stack, "capture_proxy_requests_in_flight") == 1
    # Nothing else was disturbed: the same export, read, is whole.
    resp = await stack.client.get("/captures/export?limit=10")
    assert resp.headers["X-Capture-Count"] == str(ROLLOUTS)
    assert len(await resp.read()) > len(got)


async def test_a_whole_answer_its_client_stops_reading_is_cut(make_stack: MakeStack, cuts: _Seen):
    """A whole answer (the chains of a rollout of 1.2M prompt ids, about 8 MB of JSON) is
    sent bounded too, not left to wait in aiohttp after its handler returned."""
    stack = await _stack(make_stack)
    await _fill(stack, rollouts=1, tokens=3 * PROMPT_TOKENS)
    got = await _stalled_then_cut(stack, cuts, "/captures/rollouts/r0/chains")
    assert cuts.lines == [
        "GET /captures/rollouts/r0/chains: answer cut, the client did not take its bytes "
        "within 0.5 s (read_send_timeout_s); connection closed"
    ]
    assert got.startswith(b'{"rollout_id":"r0"')
    assert await _metric(stack, "capture_proxy_read_answers_cut_total") == 1
    assert await _metric(stack, "capture_proxy_requests_in_flight") == 1


async def _encoded_export(stack: Stack) -> bytes:
    """The page the export handler must send for the stored rollouts: the encoder's bytes."""
    app = stack.client.server.app
    store = app[STORE_KEY]
    encoder = ExportEncoder()
    out = [encoder.header()]
    for info in await store.list_frozen(after=0, limit=10):
        records = snapshot_records(info, await store.get_rollout_calls(info.rollout_id))
        state = RolloutState(info, app[RECORDER_KEY])
        out.append(_encode(encoder, info, records, state, None, None, {}))
    out.append(encoder.end())
    return b"".join(out)


async def test_a_slow_steady_reader_gets_the_whole_export_byte_for_byte(
    make_stack: MakeStack, cuts: _Seen
):
    """256 KiB every 0.1 s: each of the proxy's waits is short, the whole answer (and each
    rollout's 3.6 MB batch) takes many times ``read_send_timeout_s``."""
    stack = await _stack(make_stack)
    await _fill(stack)
    expected = await _encoded_export(stack)
    at_once = await (await stack.client.get("/captures/export?limit=10")).read()
    assert at_once == expected
    got = bytearray()
    async with _client(stack) as session, session.get("/captures/export?limit=10") as resp:
        started = time.monotonic()
        async with asyncio.timeout(60):
            while piece := await resp.content.read(256 * 1024):
                got += piece
                await asyncio.sleep(0.1)  # the slow reader's pace
        took = time.monotonic() - started
    assert bytes(got) == expected
    assert took > 4 * SEND_TIMEOUT_S
    assert cuts.lines == []
    assert await _metric(stack, "capture_proxy_read_answers_cut_total") == 0


@pytest.mark.parametrize(
    ("path", "rollouts", "tokens"),
    [
        ("/captures/export?limit=10", ROLLOUTS, PROMPT_TOKENS),
        ("/captures/rollouts/r0/chains", 1, 3 * PROMPT_TOKENS),
    ],
)
async def test_a_client_that_leaves_mid_answer_is_one_line_not_a_traceback(
    make_stack: MakeStack,
    cuts: _Seen,
    caplog: pytest.LogCaptureFixture,
    path: str,
    rollouts: int,
    tokens: int,
):
    """The stream or whole answer ends at the write that finds the client gone: one INFO line,
    no ERROR, not counted as cut by the send timeout (a long one here)."""
    caplog.set_level(logging.INFO, logger="capture_proxy")
    stack = await make_stack(read_send_timeout_s=30, cancel_handlers=False)
    await _fill(stack, rollouts, tokens)
    with _seeing("the client left", logging.INFO) as left:
        async with _client(stack) as session, session.get(path) as resp:
            assert resp.status == 200
            await resp.content.readexactly(1000)
            resp.close()  # mid-answer, its bytes unread
        async with asyncio.timeout(WAIT_S):
            await left.event.wait()
    assert left.lines == [f"GET {path.split('?')[0]}: the client left before the answer ended"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert cuts.lines == []
    assert await _metric(stack, "capture_proxy_read_answers_cut_total") == 0
    assert await _metric(stack, "capture_proxy_requests_in_flight") == 1
