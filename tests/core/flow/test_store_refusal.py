"""A record the store refused (``Persisted(ok=False, refused=True)``), command by command: no
call is answered as a success without its record (DESIGN.md, flow step 8).

A whole answer raises ``StoreUnavailable`` before any answer is written (the adapter makes it
a 503); a stream, whose headers are out, ends with its API's in-band error and no clean end; a
failed engine call keeps its own error; a client that left gets nothing."""

from __future__ import annotations

import orjson
import pytest

from capture_proxy.core.flow import commands as c
from capture_proxy.core.flow import events as e
from capture_proxy.core.flow.errors import EngineTimedOut, StoreUnavailable
from capture_proxy.core.fronts.chat import ChatCodec
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.records import CallStatus
from capture_proxy.core.sse import encode_json_event
from tests.core.flow.playbook import CALL_ID, playbook
from tests.core.flow.test_template_flow import (
    BODY,
    CHUNKS,
    STREAM_BODY,
    WHOLE,
    _root,
    _to_engine,
    _verified,
)

REFUSED = e.Persisted(False, refused=True)


def test_a_whole_answer_whose_record_is_refused_is_not_sent():
    pb = playbook(ChatCodec(), BODY)
    _to_engine(pb, BODY)
    pb.send(e.EngineResponded(200, False))
    verify = pb.send(e.EngineBody(orjson.dumps(WHOLE)))
    assert isinstance(pb.send(_verified(verify)), c.Persist)
    with pytest.raises(StoreUnavailable) as raised:
        pb.send(REFUSED)  # no Remember, no RespondJson
    assert raised.value.code == "store_unavailable"
    assert raised.value.call_id is None  # no stored call to name
    assert f"could not store call {CALL_ID}" in raised.value.message


def test_a_refusal_says_what_the_store_said():
    """Not "disk full or read-only" whatever happened (TRIAL9 finding 6): the store's own
    error, e.g. the supervisor that died before the commit."""
    pb = playbook(ChatCodec(), BODY)
    _to_engine(pb, BODY)
    pb.send(e.EngineResponded(200, False))
    pb.send(_verified(pb.send(e.EngineBody(orjson.dumps(WHOLE)))))
    reason = "the proxy's supervisor process (the store's one writer) died before the commit"
    with pytest.raises(StoreUnavailable) as raised:
        pb.send(e.Persisted(False, refused=True, reason=reason))
    assert f"could not store call {CALL_ID}'s record ({reason})" in raised.value.message
    assert "disk" not in raised.value.message


def test_a_whole_answer_asked_as_a_stream_is_refused_before_its_stream_starts():
    body = {**BODY, "stream": True, "max_tokens": 16}
    pb = playbook(MessagesCodec(), body)
    pb.start()
    pb.send(_root({}))
    pb.send(e.EngineResponded(200, False))  # the engine answered whole
    verify = pb.send(e.EngineBody(orjson.dumps(WHOLE)))
    pb.send(_verified(verify))
    with pytest.raises(StoreUnavailable):
        pb.send(REFUSED)  # before StartClientStream: the adapter can still answer a 503


def test_a_stream_whose_record_is_refused_ends_with_the_error_and_no_done():
    pb = playbook(ChatCodec(), STREAM_BODY)
    _to_engine(pb, STREAM_BODY)
    pb.send(e.EngineResponded(200, True))
    pb.send(e.ClientState(False))
    pieces = encode_json_event(CHUNKS[0]) + encode_json_event(CHUNKS[1])
    assert isinstance(pb.send(e.EnginePiece(pieces)), c.WriteClient)
    pb.send(e.ClientState(False))
    pb.send(e.EnginePiece(b"data: [DONE]\n\n"))
    verify = pb.send(e.ClientState(False))
    assert verify.record.status is CallStatus.COMPLETE
    pb.send(_verified(verify))
    end = pb.send(REFUSED)
    assert isinstance(end, c.EndClient)
    assert b"[DONE]" not in end.data
    error = orjson.loads(end.data.removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "store_unavailable")
    assert pb.send(e.ClientState(False)) == c.DrainEngine()  # the engine's body still drained
    assert pb.send(None) is None


def test_a_failed_call_keeps_its_own_error_when_its_record_is_refused():
    pb = playbook(ChatCodec(), BODY)
    _to_engine(pb, BODY)
    verify = pb.send(e.EngineFailed("engine at http://e timed out", "engine_timeout", True))
    assert verify.record.status is CallStatus.FAILED
    pb.send(_verified(verify))
    with pytest.raises(EngineTimedOut):
        pb.send(REFUSED)


def test_a_client_that_left_gets_nothing_when_its_record_is_refused():
    pb = playbook(ChatCodec(), BODY)
    _to_engine(pb, BODY)
    verify = pb.send(e.ClientLeft())
    pb.send(_verified(verify))
    assert pb.send(REFUSED) is None
    assert pb.outcome.record.status is CallStatus.INCOMPLETE
