"""Tier 2: the one access line of a request says what became of it (``proxy.app``).

A new-user trial found every captured call logged ``captured``, also one the store did not
take, one the engine broke off mid-stream (stored ``incomplete``) and one the engine refused
(stored ``failed``): someone counting ``captured`` lines overcounted. (The bytes of a body
cut short: tests/proxy/test_security_policy.py, the 408.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

from capture_proxy.core.records import CallStatus
from capture_proxy.proxy.recorder import (
    NOT_STORED,
    NOT_STORED_DELETED,
    StoreWrite,
    stored_as,
)
from capture_proxy.scripted_engine import Faults, ScriptedEngineConfig
from tests.proxy.conftest import CAPTURE, MakeStack
from tests.proxy.test_capture import USER, _body
from tests.proxy.test_store_failure import Switchable

WAIT_S = 10.0
#: An access line: what was done, the rollout, the bytes in, the time (which varies).
LINE = re.compile(r"(.*), (\d+\.\d) ms\)")


async def _access_line(caplog, rollout: str) -> str:
    """The access line of the one request to ``rollout``, without its time (the handler
    writes it after the response's last byte: waited for, bounded)."""
    path = CAPTURE.format(rollout=rollout)

    def lines() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "capture_proxy" and r.getMessage().startswith(f"POST {path} -> ")
        ]

    async with asyncio.timeout(WAIT_S):
        while not lines():
            await asyncio.sleep(0.01)
    [line] = lines()
    match = LINE.fullmatch(line)
    assert match is not None, line
    return match.group(1) + ")"


def _line(rollout: str, status: int, done: str, body: dict) -> str:
    size = len(json.dumps(body).encode())
    path = CAPTURE.format(rollout=rollout)
    return f"POST {path} -> {status} ({done}, rollout {rollout}, <{size} bytes in>)"


async def test_a_stored_call_is_logged_with_its_status(make_stack: MakeStack, caplog):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    stack = await make_stack()
    body = _body(USER)
    resp = await stack.chat("ok", body)
    assert resp.status == 200
    await resp.read()
    assert await _access_line(caplog, "ok") == _line("ok", 200, "complete", body)


async def test_a_call_the_engine_broke_off_is_logged_incomplete(make_stack: MakeStack, caplog):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(faults=Faults(disconnect_after_chunks=2))
    )
    body = _body(USER, stream=True)
    resp = await stack.chat("kill", body)
    assert resp.status == 200
    await resp.read()
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["status"] == "incomplete"
    assert await _access_line(caplog, "kill") == _line("kill", 200, "incomplete", body)


async def test_a_call_the_engine_refused_is_logged_failed(make_stack: MakeStack, caplog):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    stack = await make_stack(engine_config=ScriptedEngineConfig(max_model_len=20))
    body = _body(USER)
    resp = await stack.chat("long", body)
    assert resp.status == 400
    await resp.read()
    assert await _access_line(caplog, "long") == _line("long", 400, "failed", body)


async def test_a_stream_the_store_did_not_take_is_logged_not_stored(
    make_stack: MakeStack, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="capture_proxy")
    store = Switchable(tmp_path / "full")
    stack = await make_stack(store=store)
    store.full = True
    body = _body(USER, stream=True)
    resp = await stack.chat("full", body)
    assert resp.status == 200  # the headers were out: the refusal is the stream's last event
    assert b"store_unavailable" in await resp.read()
    assert await _access_line(caplog, "full") == _line("full", 200, "not stored", body)


@pytest.mark.parametrize(
    ("written", "said"),
    [
        (StoreWrite.STORED, None),
        (StoreWrite.REFUSED, NOT_STORED),
        (StoreWrite.LOST, NOT_STORED),
        (StoreWrite.LATE, NOT_STORED_DELETED),
    ],
)
def test_stored_as_says_the_status_only_of_a_stored_record(written, said):
    for status in CallStatus:
        assert stored_as(status, written) == (said or status.value)
    assert (NOT_STORED, NOT_STORED_DELETED) == ("not stored", "not stored (rollout deleted)")
