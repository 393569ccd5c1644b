"""Backend-template mode's flow, command by command (no event loop): a whole call, a stream,
an engine 4xx/5xx, an engine that fails before its status or mid-stream, a client that leaves
before the answer and mid-stream."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from capture_proxy.core.flow import commands as c
from capture_proxy.core.flow import events as e
from capture_proxy.core.flow.captured import captured_call
from capture_proxy.core.flow.errors import EngineTimedOut
from capture_proxy.core.fronts.chat import ChatCodec
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.linking.digests import request_digest
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.linking.stored import of_record
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.records import CallStatus
from capture_proxy.core.sessions import session_key
from capture_proxy.core.sse import encode_json_event
from tests.core.flow.playbook import (
    CALL_ID,
    CREATED_AT,
    ROLLOUT_ID,
    Playbook,
    call_start,
    playbook,
)

MESSAGES = [{"role": "user", "content": "Say hi"}]
BODY = {"model": "m", "messages": MESSAGES}
STREAM_BODY = {**BODY, "stream": True}


def _root(body: dict) -> e.Resolved:
    return e.Resolved(Resolution(Verdict.ROOT, None, request_digest(body)))


def _to_engine(pb, body: dict) -> c.Command:
    first = pb.start()
    # the flow makes the request digest (the formula's) and hands it to the resolution
    digest = request_digest(body)
    assert first == c.Resolve(
        ROLLOUT_ID, MESSAGES, body, CALL_ID, CREATED_AT, first.linking_facts, request_digest=digest
    )
    send = pb.send(_root(body))
    assert isinstance(send, c.SendToEngine)
    assert (send.path, send.harness_headers) == ("/v1/chat/completions", True)
    return send


def _verified(verify: c.Command) -> e.Verified:
    assert isinstance(verify, c.Verify)
    linking = {"verdict": "root", "reason": None}
    return e.Verified(verify.record.replace(linking=linking))


WHOLE = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "prompt_token_ids": [10, 11, 12],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi"},
            "finish_reason": "stop",
            "token_ids": [7, 8],
            "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]},
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def test_a_whole_call_is_sent_augmented_recorded_and_answered_stripped():
    pb = playbook(ChatCodec(), BODY)
    send = _to_engine(pb, BODY)
    assert orjson.loads(send.body) == {
        **BODY,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
    }
    assert pb.send(e.EngineResponded(200, False)) == c.ReadEngineBody()
    verify = pb.send(e.EngineBody(orjson.dumps(WHOLE)))
    record = verify.record
    assert record.status is CallStatus.COMPLETE
    assert record.prompt_token_ids.tolist() == [10, 11, 12]
    assert record.generation_token_ids.tolist() == [7, 8]
    assert record.generation_log_probs.tolist() == [-0.5, -0.25]
    assert record.response_message == {"role": "assistant", "content": "Hi"}
    assert record.latency_ms == 250.0
    verified = _verified(verify)
    persist = pb.send(verified)
    assert isinstance(persist, c.Persist) and persist.record is verified.record
    assert pb.send(e.Persisted(True)) == c.Remember(verified.record, None, None)
    respond = pb.send(None)
    stripped = {**WHOLE, "choices": [{**WHOLE["choices"][0], "logprobs": None}]}
    del stripped["prompt_token_ids"], stripped["choices"][0]["token_ids"]
    assert respond == c.RespondJson(200, stripped)
    assert pb.send(None) is None
    assert pb.outcome.record is verified.record


def test_the_session_read_for_resolution_is_the_one_remembered():
    # The session is read from the request once: Resolve and Remember carry the same key,
    # the one the stored record's own body and headers name (stored.of_record).
    start = replace(call_start(ChatCodec(), BODY), session_headers={"x-session-id": "ses_1"})
    pb = Playbook(captured_call(start))
    resolve = pb.start()
    assert resolve.session == ("opencode", "ses_1")
    assert isinstance(pb.send(_root(BODY)), c.SendToEngine)
    pb.send(e.EngineResponded(200, False))
    verified = _verified(pb.send(e.EngineBody(orjson.dumps(WHOLE))))
    pb.send(verified)
    remember = pb.send(e.Persisted(True))
    assert remember == c.Remember(verified.record, None, ("opencode", "ses_1"))
    record = verified.record
    assert session_key(record.request_received, record.session_headers) == remember.session
    assert of_record(record).session == of_record(record, session=remember.session).session


def _chunk(delta: dict, token_ids: list[int], logprob: float, finish: str | None = None) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "token_ids": token_ids,
                "logprobs": {"content": [{"logprob": logprob}]},
            }
        ],
    }


CHUNKS = [
    {**_chunk({"role": "assistant", "content": "H"}, [7], -0.5), "prompt_token_ids": [10, 11]},
    _chunk({"content": "i"}, [8], -0.25, "stop"),
]


def _stripped(chunk: dict) -> dict:
    out = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
    choice = {k: v for k, v in chunk["choices"][0].items() if k != "token_ids"}
    return {**out, "choices": [{**choice, "logprobs": None}]}


def test_a_stream_is_forwarded_piece_by_piece_and_persisted_before_its_end():
    pb = playbook(ChatCodec(), STREAM_BODY)
    send = _to_engine(pb, STREAM_BODY)
    assert orjson.loads(send.body)["stream_options"] == {"include_usage": True}
    assert pb.send(e.EngineResponded(200, True)) == c.StartClientStream(200)
    assert pb.send(e.ClientState(False)) == c.ReadEngine()
    # an engine read that cuts an event in two: nothing complete yet, an empty write
    first = encode_json_event(CHUNKS[0])
    assert pb.send(e.EnginePiece(first[:9])) == c.WriteClient(b"")
    assert pb.send(e.ClientState(False)) == c.ReadEngine()
    rest = first[9:] + encode_json_event(CHUNKS[1])
    assert pb.send(e.EnginePiece(rest)) == c.WriteClient(
        encode_json_event(_stripped(CHUNKS[0])) + encode_json_event(_stripped(CHUNKS[1]))
    )
    assert pb.send(e.ClientState(False)) == c.ReadEngine()
    assert pb.send(e.EnginePiece(b"data: [DONE]\n\n")) == c.WriteClient(b"")
    verify = pb.send(e.ClientState(False))
    record = verify.record
    assert record.status is CallStatus.COMPLETE
    assert record.prompt_token_ids.tolist() == [10, 11]
    assert record.generation_token_ids.tolist() == [7, 8]
    assert record.generation_log_probs.tolist() == [-0.5, -0.25]
    assert record.response_message == {"role": "assistant", "content": "Hi"}
    persist = pb.send(_verified(verify))
    assert isinstance(persist, c.Persist) and persist.request is not None
    assert isinstance(pb.send(e.Persisted(True)), c.Remember)
    assert pb.send(None) == c.EndClient(b"data: [DONE]\n\n")
    assert pb.send(e.ClientState(False)) == c.DrainEngine()
    assert pb.send(None) is None
    assert pb.outcome.record.status is CallStatus.COMPLETE


@pytest.mark.parametrize(
    ("status", "error_type"), [(400, "invalid_request_error"), (503, "overloaded_error")]
)
def test_an_engine_error_is_recorded_failed_and_answered_in_the_front_shape(status, error_type):
    pb = playbook(MessagesCodec(), {**BODY, "max_tokens": 16})
    pb.start()
    assert isinstance(pb.send(_root({})), c.SendToEngine)
    assert pb.send(e.EngineResponded(status, False, "Oops")) == c.ReadEngineBody()
    engine_body = orjson.dumps({"error": {"message": "bad things", "type": "x"}})
    verify = pb.send(e.EngineBody(engine_body))
    record = verify.record
    assert record.status is CallStatus.FAILED
    assert record.http_status == status
    assert [(d.kind, d.details) for d in record.diagnostics] == [
        ("upstream_failed", {"reason": f"engine returned HTTP {status}"})
    ]
    assert isinstance(pb.send(_verified(verify)), c.Persist)
    assert isinstance(pb.send(e.Persisted(True)), c.Remember)
    respond = pb.send(None)
    assert respond.status == status
    assert respond.body["type"] == "error"
    assert respond.body["error"]["message"] == f"engine returned {status}: bad things"
    assert respond.body["error"]["type"] == error_type
    assert pb.send(None) is None


def test_an_engine_that_times_out_fails_the_call_after_recording_it():
    pb = playbook(ChatCodec(), BODY)
    _to_engine(pb, BODY)
    verify = pb.send(e.EngineFailed("engine at http://e timed out", "engine_timeout", True))
    assert verify.record.status is CallStatus.FAILED
    assert verify.record.http_status is None
    pb.send(_verified(verify))
    pb.send(e.Persisted(True))
    with pytest.raises(EngineTimedOut) as raised:
        pb.send(None)
    assert (raised.value.code, raised.value.call_id) == ("engine_timeout", CALL_ID)


def test_an_engine_stream_that_breaks_ends_the_client_stream_with_an_error():
    pb = playbook(ChatCodec(), STREAM_BODY)
    _to_engine(pb, STREAM_BODY)
    pb.send(e.EngineResponded(200, True))
    pb.send(e.ClientState(False))
    assert pb.send(e.EnginePiece(encode_json_event(CHUNKS[0]))) == c.WriteClient(
        encode_json_event(_stripped(CHUNKS[0]))
    )
    assert pb.send(e.ClientState(False)) == c.ReadEngine()
    verify = pb.send(e.EngineBroke("ClientPayloadError", "connection lost"))
    record = verify.record
    assert record.status is CallStatus.INCOMPLETE
    assert record.generation_token_ids.tolist() == [7]
    reasons = ["engine stream broke: ClientPayloadError: connection lost"]
    assert [(d.kind, d.details) for d in record.diagnostics] == [
        ("finish_reason_missing", {}),
        ("capture_incomplete", {"reasons": reasons}),
    ]
    pb.send(_verified(verify))
    pb.send(e.Persisted(True))
    end = pb.send(None)
    assert isinstance(end, c.EndClient)
    error = orjson.loads(end.data.removeprefix(b"data: "))["error"]
    assert (error["message"], error["type"]) == (reasons[0], "upstream_error")
    assert pb.send(e.ClientState(False)) is None
    assert pb.outcome.record.status is CallStatus.INCOMPLETE


def test_an_engine_event_that_is_not_utf8_ends_the_stream_after_the_events_before_it():
    # The events of the read before the bad one go to the client and into the record; the
    # bad one and what follows it in the read do neither, and the call is incomplete.
    pb = playbook(ChatCodec(), STREAM_BODY)
    _to_engine(pb, STREAM_BODY)
    pb.send(e.EngineResponded(200, True))
    pb.send(e.ClientState(False))
    bad = b'data: {"choices": [{"delta": {"content": "\xff"}}]}\n\n'
    read = encode_json_event(CHUNKS[0]) + bad + encode_json_event(CHUNKS[1])
    assert pb.send(e.EnginePiece(read)) == c.WriteClient(encode_json_event(_stripped(CHUNKS[0])))
    verify = pb.send(e.ClientState(False))
    record = verify.record
    assert record.status is CallStatus.INCOMPLETE
    assert record.generation_token_ids.tolist() == [7]
    assert record.generation_log_probs.tolist() == [-0.5]
    reasons = ["engine stream is not UTF-8: invalid start byte"]
    assert [(d.kind, d.details) for d in record.diagnostics] == [
        ("finish_reason_missing", {}),
        ("capture_incomplete", {"reasons": reasons}),
    ]


def test_a_client_that_leaves_before_the_answer_is_recorded_abandoned():
    pb = playbook(ChatCodec(), BODY)
    _to_engine(pb, BODY)
    verify = pb.send(e.ClientLeft())
    record = verify.record
    assert record.status is CallStatus.INCOMPLETE
    assert record.latency_ms == 250.0
    reasons = ["client disconnected before the engine answered"]
    assert [(d.kind, d.details) for d in record.diagnostics] == [
        ("capture_incomplete", {"reasons": reasons})
    ]
    pb.send(_verified(verify))
    assert isinstance(pb.send(e.Persisted(True)), c.Remember)
    assert pb.send(None) is None
    assert pb.outcome.record.status is CallStatus.INCOMPLETE


def test_a_client_that_leaves_mid_stream_keeps_what_arrived_and_gets_no_end():
    pb = playbook(ChatCodec(), STREAM_BODY)
    _to_engine(pb, STREAM_BODY)
    pb.send(e.EngineResponded(200, True))
    pb.send(e.ClientState(False))
    pb.send(e.EnginePiece(encode_json_event(CHUNKS[0])))
    verify = pb.send(e.ClientState(True))
    record = verify.record
    assert record.status is CallStatus.INCOMPLETE
    assert record.generation_token_ids.tolist() == [7]
    reasons = ["client disconnected before the stream ended"]
    assert [(d.kind, d.details) for d in record.diagnostics] == [
        ("finish_reason_missing", {}),
        ("capture_incomplete", {"reasons": reasons}),
    ]
    pb.send(_verified(verify))
    # not persisted: not remembered; the client is gone: no end is written
    assert pb.send(e.Persisted(False)) is None
    assert pb.outcome.record.status is CallStatus.INCOMPLETE


def test_a_failed_verification_leaves_the_call_unresolved():
    pb = playbook(ChatCodec(), BODY)
    _to_engine(pb, BODY)
    pb.send(e.EngineResponded(200, False))
    assert isinstance(pb.send(e.EngineBody(orjson.dumps(WHOLE))), c.Verify)
    persist = pb.send(e.StepFailed("RuntimeError", "store down"))
    assert persist.record.parent_call_id is None
    assert persist.record.linking == {
        "verdict": "unresolved",
        "reason": "verification failed: store down",
    }


def test_a_prefill_is_resolved_by_the_turns_before_it_and_verified_as_continued():
    prefill = {"role": "assistant", "content": "Hello,"}
    body = {"model": "m", "max_tokens": 8, "messages": [*MESSAGES, prefill]}
    pb = playbook(MessagesCodec(), body)
    resolve = pb.start()
    # the prefill starts this call's own turn: not a turn of its history
    assert isinstance(resolve, c.Resolve) and resolve.linking_messages == MESSAGES
    send = pb.send(_root(body))
    sent = orjson.loads(send.body)
    assert sent["messages"] == [*MESSAGES, prefill]
    assert (sent["continue_final_message"], sent["add_generation_prompt"]) == (True, False)
    pb.send(e.EngineResponded(200, False))
    verify = pb.send(e.EngineBody(orjson.dumps(WHOLE)))
    assert isinstance(verify, c.Verify)
    assert verify.linking_messages == MESSAGES and verify.prefill == prefill
    assert verify.record.request_messages == [*MESSAGES, prefill]


def _middle(delta: dict, token_id: int, logprob: float) -> bytes:
    """A middle chunk as vLLM 0.32 writes it (compact, UTF-8 kept, its members' order)."""
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1796028430,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": {
                    "content": [
                        {"token": "x", "logprob": logprob, "bytes": [120], "top_logprobs": []}
                    ]
                },
                "finish_reason": None,
                "token_ids": [token_id],
            }
        ],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def play_stream(front, body: dict, pieces: list[bytes], scan) -> tuple[list[bytes], object]:
    """``pieces`` (the engine's reads) played through the flow of a streamed call of
    ``body`` with ``chunk_scan.SCAN`` set to ``scan``: the client's writes and the record."""
    from capture_proxy.core import chunk_scan

    saved, chunk_scan.SCAN = chunk_scan.SCAN, scan
    try:
        pb = playbook(front, body)
        pb.start()
        assert isinstance(pb.send(_root({})), c.SendToEngine)
        pieces = list(pieces)
        writes: list[bytes] = []
        command = pb.send(e.EngineResponded(200, True))
        while command is not None:
            if isinstance(command, (c.WriteClient, c.EndClient)):
                writes.append(command.data)
            if isinstance(command, c.ReadEngine):
                reply = e.EnginePiece(pieces.pop(0)) if pieces else e.EngineEnd()
            elif isinstance(command, c.Verify):
                reply = _verified(command)
            elif isinstance(command, c.Persist):
                reply = e.Persisted(True)
            elif isinstance(command, (c.Remember, c.DrainEngine)):
                reply = None
            else:
                reply = e.ClientState(False)
            command = pb.send(reply)
        return writes, pb.outcome.record
    finally:
        chunk_scan.SCAN = saved


def _stream_through(front, scan) -> tuple[list[bytes], object]:
    """A stream of a first chunk, three middle ones (content, reasoning, a tool call's
    pieces) and a last one, run through the flow; the client's writes and the record."""
    pieces = [
        encode_json_event(CHUNKS[0])
        + _middle({"reasoning_content": "hmm"}, 20, -1.5)
        + _middle({"content": " wörld"}, 21, -0.125),
        _middle(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "ls", "arguments": "{}"},
                    }
                ]
            },
            22,
            -2.0,
        )
        + encode_json_event(CHUNKS[1]),
        b"data: [DONE]\n\n",
    ]
    return play_stream(front, {**STREAM_BODY, "max_tokens": 16}, pieces, scan)


@pytest.mark.parametrize("front", [ChatCodec(), MessagesCodec()], ids=["chat", "messages"])
def test_middle_chunks_give_the_same_record_and_events_with_the_compiled_scan_or_without(front):
    from capture_proxy.core import chunk_scan

    if chunk_scan.SCAN is None:
        pytest.skip("the compiled scan is not built")
    scan, accepted = chunk_scan.SCAN, []

    def counted(data: bytes, flags: int):
        result = scan(data, flags)
        accepted.append(result is not None)
        return result

    scanned_writes, scanned = _stream_through(front, counted)
    # the first chunk (prompt ids) and the last (finish_reason) take the Python path
    assert accepted == [False, True, True, True, False]
    parsed_writes, parsed = _stream_through(front, None)
    assert scanned.generation_token_ids.tolist() == [7, 20, 21, 22, 8]
    assert scanned.generation_log_probs.tolist() == [-0.5, -1.5, -0.125, -2.0, -0.25]
    assert scanned.response_message == {
        "role": "assistant",
        "content": "H wörldi",
        "reasoning_content": "hmm",
        "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
        ],
    }
    for field in ("generation_token_ids", "generation_log_probs", "prompt_token_ids"):
        assert getattr(scanned, field).tolist() == getattr(parsed, field).tolist()
    assert scanned.response_message == parsed.response_message
    assert scanned.status is parsed.status is CallStatus.COMPLETE

    def events(writes: list[bytes]) -> list:
        datas = b"".join(writes).split(b"\n\n")
        return [orjson.loads(d[6:]) if d.startswith(b"data: {") else d for d in datas]

    assert events(scanned_writes) == events(parsed_writes)
    if isinstance(front, ChatCodec):
        middle = events(scanned_writes)[2]
        assert middle["choices"] == [
            {"index": 0, "delta": {"content": " wörld"}, "logprobs": None, "finish_reason": None}
        ]


# --- the prompt's ids taken straight into their array (chunk_scan.take_prompt) ---------------

#: an agent's prompt: thousands of ids, the extremes of uint32 among them
LONG_PROMPT = [(i * 7919) % 151_936 for i in range(6000)] + [0, 2**32 - 1]


def _fields(record) -> dict:
    """A record's fields, arrays as lists (records holding arrays do not compare with ==)."""
    import dataclasses

    return {
        f.name: (v.tolist() if hasattr(v, "tolist") else v)
        for f in dataclasses.fields(record)
        for v in [getattr(record, f.name)]
    }


def _whole_through(body: dict, answer: dict, take) -> tuple[c.Command, object]:
    """A whole call of ``body`` answered ``answer``, with ``chunk_scan``'s prompt-id reader set
    to ``take`` (None: the Python path): the answer to the client and the record."""
    from capture_proxy.core import chunk_scan

    saved, chunk_scan._TAKE_PROMPT_IDS = chunk_scan._TAKE_PROMPT_IDS, take
    try:
        pb = playbook(ChatCodec(), body)
        pb.start()
        assert isinstance(pb.send(_root(body)), c.SendToEngine)
        assert pb.send(e.EngineResponded(200, False)) == c.ReadEngineBody()
        verified = _verified(pb.send(e.EngineBody(orjson.dumps(answer))))
        assert isinstance(pb.send(verified), c.Persist)
        assert isinstance(pb.send(e.Persisted(True)), c.Remember)
        respond = pb.send(None)
        assert pb.send(None) is None
        return respond, pb.outcome.record
    finally:
        chunk_scan._TAKE_PROMPT_IDS = saved


@pytest.mark.parametrize("asked_ids", [False, True], ids=["ids-not-asked", "ids-asked"])
def test_a_long_prompts_ids_taken_compiled_give_the_same_record_and_answer(asked_ids):
    from capture_proxy.core import chunk_scan

    take = chunk_scan._TAKE_PROMPT_IDS
    if take is None:
        pytest.skip("the compiled module is not built")
    used: list[bool] = []

    def counted(raw: bytes):
        result = take(raw)
        used.append(result is not None)
        return result

    body = {**BODY, "return_token_ids": True} if asked_ids else BODY
    answer = {**WHOLE, "prompt_token_ids": LONG_PROMPT}
    taken_answer, taken = _whole_through(body, answer, counted)
    parsed_answer, parsed = _whole_through(body, answer, None)
    # the harness that asked for the ids gets the engine's list: nothing is taken then
    assert used == ([] if asked_ids else [True])
    assert taken.prompt_token_ids.dtype == parsed.prompt_token_ids.dtype
    assert taken.prompt_token_ids.tolist() == parsed.prompt_token_ids.tolist() == LONG_PROMPT
    assert taken.prompt_token_ids.flags.writeable
    assert _fields(taken) == _fields(parsed)
    assert taken_answer == parsed_answer
    assert ("prompt_token_ids" in taken_answer.body) is asked_ids


def test_an_answer_whose_prompt_ids_are_not_ids_is_flagged_alike_with_the_module_or_without():
    from capture_proxy.core import chunk_scan

    if chunk_scan._TAKE_PROMPT_IDS is None:
        pytest.skip("the compiled module is not built")
    for bad in ([1, -1], [1, 2**32], [1, 2.5], [1, True], [1, None], "1 2"):
        answer = {**WHOLE, "prompt_token_ids": bad}
        (_, taken), (_, parsed) = (
            _whole_through(BODY, answer, t) for t in (chunk_scan._TAKE_PROMPT_IDS, None)
        )
        assert taken.status is parsed.status is CallStatus.INCOMPLETE, bad
        assert taken.diagnostics == parsed.diagnostics, bad


def test_a_streams_first_chunk_gives_the_same_prompt_ids_with_the_module_or_without():
    from capture_proxy.core import chunk_scan

    take = chunk_scan._TAKE_PROMPT_IDS
    if take is None:
        pytest.skip("the compiled module is not built")
    first = {**CHUNKS[0], "prompt_token_ids": LONG_PROMPT}
    pieces = [encode_json_event(first) + encode_json_event(CHUNKS[1]), b"data: [DONE]\n\n"]
    runs = []
    for reader in (take, None):
        saved, chunk_scan._TAKE_PROMPT_IDS = chunk_scan._TAKE_PROMPT_IDS, reader
        try:
            runs.append(play_stream(ChatCodec(), STREAM_BODY, pieces, chunk_scan.SCAN))
        finally:
            chunk_scan._TAKE_PROMPT_IDS = saved
    (taken_writes, taken), (parsed_writes, parsed) = runs
    assert taken.prompt_token_ids.tolist() == parsed.prompt_token_ids.tolist() == LONG_PROMPT
    assert _fields(taken) == _fields(parsed)
    assert taken_writes == parsed_writes
    assert b"prompt_token_ids" not in b"".join(taken_writes)
