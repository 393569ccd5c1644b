"""Exact-token mode's flow, command by command (no event loop): a first call rendered whole, a
tail call extending its parent's tokens, a render error, a prefill the renderer cannot leave
open, an engine that cannot tell its facts, a streamed Anthropic Messages call."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from capture_proxy.core.flow import commands as c
from capture_proxy.core.flow import events as e
from capture_proxy.core.flow.errors import EngineUnreachable, PrefillNotSupported
from capture_proxy.core.fronts.chat import ChatCodec
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.json_bodies import InvalidRequest
from capture_proxy.core.linking.digests import request_digest
from capture_proxy.core.linking.resolution import Candidate, Resolution
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.records import CallStatus
from capture_proxy.families.base import RenderError
from tests.core.flow.playbook import CALL_ID, FakeExact, playbook
from tests.factories import record as make_record

FIRST = [{"role": "user", "content": "Say hi"}]
ANSWER = {"role": "assistant", "content": "Hi"}
#: the family parser's message of the generation "Hi"
PARSED = {"role": "assistant", "content": "Hi", "tool_calls": []}
SECOND = [*FIRST, ANSWER, {"role": "user", "content": "Again"}]
END_OF_TURN = 99
FACTS = e.EngineFacts(max_model_len=100, end_of_turn_ids=frozenset({END_OF_TURN}))


def _root(body: dict) -> e.Resolved:
    return e.Resolved(Resolution(Verdict.ROOT, None, request_digest(body)))


def _completion(text: str, ids: list[int], log_probs: list[float]) -> bytes:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": log_probs},
        "finish_reason": "stop",
    }
    return orjson.dumps({"choices": [choice]})


def _finish(pb, verify: c.Command, linking: dict) -> c.Command:
    """Verified, persisted, remembered: the command after them."""
    assert isinstance(verify, c.Verify)
    verified = verify.record.replace(linking=linking)
    persist = pb.send(e.Verified(verified))
    assert isinstance(persist, c.Persist) and persist.record is verified
    assert pb.send(e.Persisted(True)) == c.Remember(verified, None, None)
    return pb.send(None)


def test_a_first_call_is_rendered_whole_and_answered_from_the_generated_ids():
    body = {"model": "m", "messages": FIRST}
    pb = playbook(ChatCodec(), body, FakeExact())
    assert isinstance(pb.start(), c.Resolve)
    assert pb.send(_root(body)) == c.AskEngineFacts(served_model=False)
    assert pb.send(FACTS) == c.Render(FIRST, None, True, None)
    send = pb.send(e.Rendered([1, 2, 3]))
    assert (send.path, send.harness_headers) == ("/v1/completions", False)
    assert orjson.loads(send.body) == {
        "prompt": [1, 2, 3],
        "max_tokens": 97,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": False,
        "model": "m",
    }
    assert pb.send(e.EngineResponded(200, False)) == c.ReadEngineBody()
    verify = pb.send(e.EngineBody(_completion("Hi", [7, 8], [-0.5, -0.25])))
    record = verify.record
    assert record.status is CallStatus.COMPLETE
    assert record.prompt_token_ids.tolist() == [1, 2, 3]
    assert record.generation_token_ids.tolist() == [7, 8]
    assert record.generation_log_probs.tolist() == [-0.5, -0.25]
    assert record.response_message == PARSED
    assert record.upstream_path == "/v1/completions"
    assert verify.resolution.verdict is Verdict.ROOT
    respond = _finish(pb, verify, {"verdict": "root"})
    assert isinstance(respond, c.RespondJson) and respond.status == 200
    assert respond.body["choices"][0]["message"] == PARSED
    assert respond.body["choices"][0]["finish_reason"] == "stop"
    assert respond.body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert pb.send(None) is None
    assert pb.outcome.record.linking == {"verdict": "root"}


def _spliced_tail(parent, messages: list) -> tuple[Any, Any]:
    """Play a call continuing ``parent`` (prompt [1, 2, 3], generation [7, 8, END_OF_TURN],
    its request FIRST and what follows) with ``messages``, resolved to it by digest: the tail
    is rendered in a small context (FIRST, then ``messages``, as [1, 2] and [1, 2, 50, 51,
    END_OF_TURN, 60, 61]) and spliced after the parent's tokens, which the engine is sent and
    the record keeps. Returns the playbook and the Verify command."""
    body = {"model": "m", "messages": messages}
    resolution = Resolution(
        Verdict.RESOLVED,
        "digest",
        request_digest(body),
        parent_call_id="call-p",
        candidates=(Candidate("call-p"),),
    )
    pb = playbook(ChatCodec(), body, FakeExact())
    pb.start()
    pb.send(e.Resolved(resolution))
    assert pb.send(FACTS) == c.LookUpCall("call-p")
    assert pb.send(e.CallFound(parent)) == c.Render(FIRST, None, False, None)
    assert pb.send(e.Rendered([1, 2])) == c.Render(messages, None, True, None)
    send = pb.send(e.Rendered([1, 2, 50, 51, END_OF_TURN, 60, 61]))
    assert orjson.loads(send.body)["prompt"] == [1, 2, 3, 7, 8, END_OF_TURN, 60, 61]
    pb.send(e.EngineResponded(200, False))
    verify = pb.send(e.EngineBody(_completion("Hi", [9], [-1.0])))
    assert verify.record.prompt_token_ids.tolist() == [1, 2, 3, 7, 8, END_OF_TURN, 60, 61]
    return pb, verify


def test_a_tail_call_extends_its_parents_tokens_by_the_new_messages_only():
    parent = make_record("call-p", [1, 2, 3], [7, 8, END_OF_TURN]).replace(
        request_messages=FIRST, response_message=ANSWER
    )
    # the tail, in a small context: the user turn before the continued one, then the new turn
    pb, verify = _spliced_tail(parent, SECOND)
    assert verify.record.generation_token_ids.tolist() == [9]
    assert verify.record.diagnostics == []
    assert verify.resolution.parent_call_id == "call-p"
    respond = _finish(pb, verify, {"verdict": "resolved"})
    assert isinstance(respond, c.RespondJson)


def test_a_render_error_fails_the_request_and_records_nothing():
    body = {"model": "m", "messages": FIRST}
    pb = playbook(ChatCodec(), body, FakeExact())
    pb.start()
    pb.send(_root(body))
    pb.send(FACTS)
    with pytest.raises(RenderError, match="no template"):
        pb.send(e.RenderFailed(RenderError("no template")))


def test_a_prefill_the_renderer_cannot_leave_open_is_refused_before_anything():
    body = {
        "model": "m",
        "messages": [*FIRST, ANSWER],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    pb = playbook(ChatCodec(), body, FakeExact())
    with pytest.raises(PrefillNotSupported):
        pb.start()


@pytest.mark.parametrize("generation", [True, None], ids=["true", "left_out"])
def test_continue_final_message_with_the_generation_prompt_on_is_refused_as_vllm_does(generation):
    # vLLM 0.32: add_generation_prompt defaults to true, and transformers refuses it beside
    # continue_final_message (a 400); the proxy renders in exact-token mode, so it refuses too
    body = {"model": "m", "messages": [*FIRST, ANSWER], "continue_final_message": True}
    if generation is not None:
        body["add_generation_prompt"] = generation
    pb = playbook(ChatCodec(), body, FakeExact())
    with pytest.raises(InvalidRequest) as raised:
        pb.start()
    assert raised.value.param == "add_generation_prompt"


def test_an_engine_that_cannot_tell_its_facts_fails_the_call_recorded():
    body = {"model": "m", "messages": FIRST}
    pb = playbook(ChatCodec(), body, FakeExact())
    pb.start()
    pb.send(_root(body))
    verify = pb.send(e.EngineFailed("engine at http://e is unreachable", "engine_unreachable"))
    assert verify.record.status is CallStatus.FAILED
    pb.send(e.Verified(verify.record))
    pb.send(e.Persisted(True))
    with pytest.raises(EngineUnreachable) as raised:
        pb.send(None)
    assert (raised.value.code, raised.value.call_id) == ("engine_unreachable", CALL_ID)


def _sse(text: str, ids: list[int], finish: str | None = None) -> bytes:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * len(ids)},
        "finish_reason": finish,
    }
    return b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n"


def _event_names(data: bytes) -> list[str]:
    return [line[7:] for line in data.decode().splitlines() if line.startswith("event: ")]


def _streamed_messages_call() -> tuple:
    body = {"model": "m", "max_tokens": 16, "messages": FIRST, "stream": True}
    pb = playbook(MessagesCodec(), body, FakeExact())
    pb.start()
    pb.send(_root({}))
    pb.send(FACTS)
    send = pb.send(e.Rendered([1, 2, 3]))
    assert orjson.loads(send.body)["stream"] is True
    assert pb.send(e.EngineResponded(200, True)) == c.StartClientStream(200)
    start = pb.send(e.ClientState(False))
    assert _event_names(start.data) == ["message_start", "ping"]
    assert pb.send(e.ClientState(False)) == c.ReadEngine()
    return pb


def test_a_streamed_messages_call_forwards_each_piece_and_ends_after_persisting():
    pb = _streamed_messages_call()
    write = pb.send(e.EnginePiece(_sse("H", [7])))
    assert _event_names(write.data) == ["content_block_start", "content_block_delta"]
    assert pb.send(e.ClientState(False)) == c.ReadEngine()
    write = pb.send(e.EnginePiece(_sse("i", [8], "stop") + b"data: [DONE]\n\n"))
    assert _event_names(write.data) == ["content_block_delta"]
    assert pb.send(e.ClientState(False)) == c.ReadEngine()
    verify = pb.send(e.EngineEnd())
    record = verify.record
    assert record.status is CallStatus.COMPLETE
    assert record.api == "messages"
    assert record.generation_token_ids.tolist() == [7, 8]
    assert record.response_message == PARSED
    end = _finish(pb, verify, {"verdict": "root"})
    assert _event_names(end.data) == ["content_block_stop", "message_delta", "message_stop"]
    assert pb.send(e.ClientState(False)) is None


def test_a_streamed_call_whose_engine_breaks_ends_with_an_error_event():
    pb = _streamed_messages_call()
    pb.send(e.EnginePiece(_sse("H", [7])))
    pb.send(e.ClientState(False))
    verify = pb.send(e.EngineBroke("ClientPayloadError", "cut"))
    assert verify.record.status is CallStatus.INCOMPLETE
    assert verify.record.generation_token_ids.tolist() == [7]
    kinds = {d.kind: d.details for d in verify.record.diagnostics}
    assert kinds["capture_incomplete"] == {
        "reasons": ["engine stream broke: ClientPayloadError: cut"]
    }
    end = _finish(pb, verify, {"verdict": "root"})
    assert _event_names(end.data) == ["error"]


def test_a_client_that_leaves_mid_stream_is_recorded_incomplete_with_what_arrived():
    pb = _streamed_messages_call()
    pb.send(e.EnginePiece(_sse("H", [7])))
    verify = pb.send(e.ClientState(True))
    assert verify.record.status is CallStatus.INCOMPLETE
    assert verify.record.generation_token_ids.tolist() == [7]
    kinds = {d.kind: d.details for d in verify.record.diagnostics}
    assert kinds["capture_incomplete"] == {
        "reasons": ["client disconnected before the stream ended"]
    }
    assert _finish(pb, verify, {"verdict": "root"}) is None
    assert pb.outcome.record.status is CallStatus.INCOMPLETE


def test_a_client_that_leaves_before_the_engine_answers_keeps_the_prompt():
    body = {"model": "m", "messages": FIRST}
    pb = playbook(ChatCodec(), body, FakeExact())
    pb.start()
    pb.send(_root(body))
    pb.send(FACTS)
    pb.send(e.Rendered([1, 2, 3]))
    verify = pb.send(e.ClientLeft())
    assert verify.record.status is CallStatus.INCOMPLETE
    assert verify.record.prompt_token_ids.tolist() == [1, 2, 3]
    assert (
        verify.record.generation_token_ids is None or verify.record.generation_token_ids.size == 0
    )
    assert _finish(pb, verify, {"verdict": "root"}) is None


def test_the_flow_imports_no_http_library():
    import subprocess
    import sys

    code = (
        "import sys, capture_proxy.core.flow.captured; "
        "print(sorted(m for m in ('aiohttp', 'multidict', 'yarl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_child_of_a_prefilled_call_is_spliced_from_its_prompt_and_generation():
    # the parent continued the prefill "Hel" (its prompt's last id, 3) with "lo" (7, 8): the
    # harness sends the merged turn "Hello", which the parent's ids end with
    prefill = {"role": "assistant", "content": "Hel"}
    parent = make_record("call-p", [1, 2, 3], [7, 8, END_OF_TURN]).replace(
        request_messages=[*FIRST, prefill],
        response_message={"role": "assistant", "content": "lo", "tool_calls": []},
        linking={"verdict": "root", "prefill": True},
    )
    second = [*FIRST, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "?"}]
    # the tail after the merged turn, in a small context (no full render, nothing refused)
    _, verify = _spliced_tail(parent, second)
    assert verify.record.diagnostics == []
    assert verify.prefill is None
