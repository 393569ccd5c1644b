"""An engine abort in exact-token mode, command by command (no event loop): the flow waits for
the engine to serve, sends the continuation (prompt + tokens so far, the rest of
``max_tokens``) and records one call of both requests' tokens and versions; an abort it cannot
continue is recorded incomplete and raised as a retryable error."""

from __future__ import annotations

import orjson
import pytest

from capture_proxy.core.flow import commands as c
from capture_proxy.core.flow import events as e
from capture_proxy.core.flow.errors import GenerationAborted
from capture_proxy.core.fronts.chat import ChatCodec
from capture_proxy.core.linking.digests import request_digest
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.records import CallStatus
from tests.core.flow.playbook import FakeExact, playbook

BODY = {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5}
FACTS = e.EngineFacts(max_model_len=100, end_of_turn_ids=frozenset({99}))


def _completion(text: str, ids: list[int], log_probs: list[float], finish: str) -> bytes:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": log_probs},
        "finish_reason": finish,
    }
    return orjson.dumps({"choices": [choice]})


def _to_the_engine(pb):
    assert isinstance(pb.start(), c.Resolve)
    resolved = e.Resolved(Resolution(Verdict.ROOT, None, request_digest(BODY)))
    assert pb.send(resolved) == c.AskEngineFacts(served_model=False)
    assert isinstance(pb.send(FACTS), c.Render)
    send = pb.send(e.Rendered([1, 2, 3]))
    assert orjson.loads(send.body)["max_tokens"] == 5
    assert pb.send(e.EngineResponded(200, False, weight_version="3")) == c.ReadEngineBody()
    # the engine aborted after two tokens: the flow waits for it to serve again
    waited = pb.send(e.EngineBody(_completion("He", [7, 8], [-0.5, -0.25], "abort"), "3"))
    assert waited == c.AwaitEngineServing()


def test_an_abort_is_continued_with_the_tokens_so_far_and_recorded_as_one_call():
    pb = playbook(ChatCodec(), BODY, FakeExact())
    _to_the_engine(pb)
    send = pb.send(e.EngineServing(paused=True, waited_ms=1500.0, weight_version="4"))
    assert isinstance(send, c.SendToEngine)
    body = orjson.loads(send.body)
    assert body["prompt"] == [1, 2, 3, 7, 8]  # the prompt and the tokens so far
    assert body["max_tokens"] == 3  # the rest of the call's budget
    assert body["routed_experts_prompt_start"] == 4  # rows from the last token before
    assert pb.send(e.EngineResponded(200, False, weight_version="4")) == c.ReadEngineBody()
    verify = pb.send(e.EngineBody(_completion("llo", [9, 10, 99], [-1.0, -2.0, -0.125], "stop")))
    record = verify.record
    assert record.status is CallStatus.COMPLETE
    assert record.generation_token_ids.tolist() == [7, 8, 9, 10, 99]
    assert record.generation_log_probs.tolist() == [-0.5, -0.25, -1.0, -2.0, -0.125]
    assert record.response_message["content"] == "Hello"
    assert record.finish_reason == "stop"
    assert record.weight_versions == [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": 5},
    ]
    assert record.weight_version_source == "observed"
    [resumed] = [d for d in record.diagnostics if d.kind == "generation_resumed"]
    [resume] = resumed.details["resumes"]
    assert (resume["at_token"], resume["paused"]) == (2, True)
    assert (resume["from_version"], resume["to_version"]) == ("3", "4")


def test_an_abort_neither_paused_nor_updated_is_recorded_incomplete_and_raised():
    pb = playbook(ChatCodec(), BODY, FakeExact())
    _to_the_engine(pb)
    verify = pb.send(e.EngineServing(paused=False, waited_ms=0.0, weight_version="3"))
    assert isinstance(verify, c.Verify)  # no continuation: the record goes on as it is
    record = verify.record
    assert record.status is CallStatus.INCOMPLETE
    assert record.finish_reason == "abort"
    assert record.generation_token_ids.tolist() == [7, 8]
    [aborted] = [d for d in record.diagnostics if d.kind == "generation_aborted"]
    assert aborted.details["at_token"] == 2
    persist = pb.send(e.Verified(record))
    assert isinstance(persist, c.Persist) and persist.record is record  # stored before the error
    assert isinstance(pb.send(e.Persisted(True)), c.Remember)
    with pytest.raises(GenerationAborted) as raised:
        pb.send(None)
    assert raised.value.code == "generation_aborted"


@pytest.mark.parametrize("version", [None, "3"])
def test_an_abort_on_an_engine_that_cannot_say_it_paused_is_continued_only_on_a_new_version(
    version,
):
    # No GET /is_paused (SGLang, vLLM without dev mode): the version must have changed, or
    # the abort may have been a trainer's own (/abort_requests) and is not undone.
    pb = playbook(ChatCodec(), BODY, FakeExact())
    _to_the_engine(pb)
    verify = pb.send(e.EngineServing(paused=None, waited_ms=0.0, weight_version=version))
    assert isinstance(verify, c.Verify)
    record = verify.record
    assert (record.status, record.generation_token_ids.tolist()) == (CallStatus.INCOMPLETE, [7, 8])
    [aborted] = [d for d in record.diagnostics if d.kind == "generation_aborted"]
    assert aborted.details["reason"] == (
        "the engine aborted the generation and neither said it was paused (no GET "
        "/is_paused) nor changed its weight version: not continued"
    )
    pb = playbook(ChatCodec(), BODY, FakeExact())
    _to_the_engine(pb)
    send = pb.send(e.EngineServing(paused=None, waited_ms=0.0, weight_version="4"))
    assert isinstance(send, c.SendToEngine)
    assert orjson.loads(send.body)["prompt"] == [1, 2, 3, 7, 8]


def test_an_engine_that_does_not_serve_again_in_time_ends_the_call_incomplete():
    pb = playbook(ChatCodec(), BODY, FakeExact())
    _to_the_engine(pb)
    failed = e.EngineFailed("did not serve again within 900 s", "engine_paused", timeout=True)
    verify = pb.send(failed)
    assert isinstance(verify, c.Verify)
    [aborted] = [d for d in verify.record.diagnostics if d.kind == "generation_aborted"]
    assert "did not serve again" in aborted.details["reason"]
