"""Tier 2: a call whose record the store does not take (issue 34; DESIGN.md, flow step 8).

Default (``store_failure = refuse``): the call is not answered as a success: a whole answer is
a 503 ``store_unavailable`` with ``Retry-After`` in the API's error shape; a stream, whose
headers are out, ends with the API's in-band error and no clean end. ``answer``: the harness
gets its answer, the loss is counted and kept until the store takes the mark, and the
rollout's REST view and ``/health`` show it meanwhile. The store's failure is injected here
(``Switchable``); tests/reliability/test_full_disk.py fills a real filesystem.
"""

from __future__ import annotations

import re

import pytest

from capture_proxy.proxy.errors import STORE_RETRY_AFTER_S
from capture_proxy.proxy.keys import RECORDER_KEY
from capture_proxy.store.base import StoreError
from capture_proxy.store.sqlite import SQLiteStore
from tests.proxy.api_clients import Reply, harness
from tests.proxy.conftest import MakeStack, Stack

APIS = ["chat_completions", "responses", "messages"]
#: The events that end a stream cleanly, by API: none may follow a refusal.
CLEAN_ENDS = {
    "chat_completions": "[DONE]",
    "responses": "response.completed",
    "messages": "message_stop",
}


class Switchable(SQLiteStore):
    """The SQLite store whose writes fail while ``full`` (reads always work); ``marks``: the
    rollouts whose ``mark_rollout_incomplete`` failed, in order."""

    full = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refused_marks: list[str] = []

    async def put_call(self, record, request=None, digests=None):
        if self.full:
            raise StoreError("database or disk is full (injected)")
        return await super().put_call(record, request, digests)

    async def mark_rollout_incomplete(self, rollout_id, diagnostic):
        if self.full:
            self.refused_marks.append(rollout_id)
            raise StoreError("database or disk is full (injected)")
        return await super().mark_rollout_incomplete(rollout_id, diagnostic)

    async def freeze_rollout(self, rollout_id, *, known_elsewhere=False):
        if self.full:
            raise StoreError(f"freezing rollout {rollout_id} failed: disk I/O error (injected)")
        return await super().freeze_rollout(rollout_id, known_elsewhere=known_elsewhere)


def _event_names(reply: Reply) -> list[str]:
    names = []
    for e in reply.events:
        if e.data == "[DONE]":
            names.append("[DONE]")
        elif isinstance(e.data, dict):
            names.append(e.name or e.data.get("type") or ("error" if "error" in e.data else ""))
    return names


def _in_band_error(api: str, reply: Reply) -> dict:
    """The stream's error event, in the API's shape."""
    last = reply.events[-1].data
    if api == "chat_completions":
        return last["error"]
    if api == "messages":
        assert last["type"] == "error"
        return last["error"]
    assert last["type"] == "response.failed"
    error = reply.events[-2].data
    assert error["type"] == "error" and error["code"] == last["response"]["error"]["code"]
    return last["response"]["error"]


async def _stack(make_stack: MakeStack, tmp_path, prompt_mode: str, **settings) -> Stack:
    return await make_stack(
        store=Switchable(tmp_path / "switchable"), prompt_mode=prompt_mode, **settings
    )


@pytest.mark.parametrize("prompt_mode", ["backend_template", "exact_tokens"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", APIS)
async def test_a_call_the_store_refuses_is_not_answered_as_a_success(
    make_stack: MakeStack, tmp_path, api, stream, prompt_mode
):
    stack = await _stack(make_stack, tmp_path, prompt_mode)
    store = stack.client.app[RECORDER_KEY].store
    h = harness(api, stack, "r1", stream=stream)
    h.start()
    assert (await h.step()).status == 200  # stored: a success
    store.full = True
    reply = await h.send()
    if stream:
        assert reply.status == 200  # the headers were out before the write
        names = _event_names(reply)
        assert not set(names) & set(CLEAN_ENDS.values()), names
        error = _in_band_error(api, reply)
        assert "could not store call" in error["message"] and "retry" in error["message"]
        if api == "chat_completions":
            assert (error["type"], error["code"]) == ("server_error", "store_unavailable")
        elif api == "responses":
            assert error["code"] == "store_unavailable"
        else:
            assert error["type"] == "overloaded_error"
    else:
        assert reply.status == 503
        if api == "messages":
            assert reply.body["type"] == "error"
            assert reply.body["error"]["type"] == "overloaded_error"
        else:
            assert reply.body["error"]["type"] == "server_error"
            assert reply.body["error"]["code"] == "store_unavailable"
        error = reply.body["error"]
        assert "could not store call" in error["message"]
        assert reply.call_id is None  # names no stored call
    refused = re.search(r"could not store call (call-[0-9a-f]+)", error["message"])
    assert refused is not None, error["message"]
    # Nothing of the refused call is stored, and the rollout is not marked: nothing answered
    # was lost. The harness's retry, once writes succeed, is stored and links on.
    summary = await stack.get_json("/captures/rollouts/r1")
    assert (summary["num_calls"], summary["incomplete"]) == (1, False)
    assert store.refused_marks == []
    health = await stack.get_json("/health", status=503)
    assert health["status"] == "degraded" and health["capture"]["store_failures"] == 1
    assert health["capture"]["answered_unstored"] == 0
    store.full = False
    retried = await h.step()
    assert retried.status == 200
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [len(c["calls"]) for c in chains["chains"]] == [2]
    assert chains["chains"][0]["calls"][1]["call_id"] == retried.call_id
    # the retry names the refused call (the 503 named it; the store does not hold it)
    retry = await stack.get_json(f"/captures/calls/{retried.call_id}")
    assert retry["retry_of"] == refused.group(1)
    assert chains["unlinked_calls"] == []
    assert (await stack.get_json("/health"))["status"] == "ok"


async def test_the_whole_answers_503_carries_retry_after(make_stack: MakeStack, tmp_path):
    stack = await _stack(make_stack, tmp_path, "backend_template")
    stack.client.app[RECORDER_KEY].store.full = True
    h = harness("chat_completions", stack, "r1", stream=False)
    h.start()
    resp = await stack.client.post(
        "/ng-rollout/r1/training-token-capture/v1/chat/completions", json=h.body()
    )
    assert resp.status == 503
    assert resp.headers["Retry-After"] == str(STORE_RETRY_AFTER_S)
    assert "X-Capture-Call-Id" not in resp.headers
    metrics = await (await stack.client.get("/metrics")).text()
    assert "capture_proxy_store_failures_total 1.0" in metrics
    assert "capture_proxy_calls_answered_unstored_total 0.0" in metrics


async def test_an_engine_failure_keeps_its_own_error_when_the_store_refuses_too(
    make_stack: MakeStack, tmp_path
):
    from capture_proxy.scripted_engine.app import ScriptedEngineConfig

    stack = await make_stack(
        store=Switchable(tmp_path / "switchable"),
        engine_config=ScriptedEngineConfig(fail_status=500),
    )
    stack.client.app[RECORDER_KEY].store.full = True
    h = harness("chat_completions", stack, "r1", stream=False)
    h.start()
    reply = await h.send()
    assert reply.status == 500  # the engine's answer, not the store's
    health = await stack.get_json("/health", status=503)
    assert health["capture"]["store_failures"] == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", APIS)
async def test_answer_setting_answers_and_keeps_the_loss_until_the_store_takes_it(
    make_stack: MakeStack, tmp_path, api, stream
):
    stack = await _stack(make_stack, tmp_path, "backend_template", store_failure="answer")
    recorder = stack.client.app[RECORDER_KEY]
    store = recorder.store
    store.full = True
    h = harness(api, stack, "lost", stream=stream)
    h.start()
    first = await h.step()
    second = await h.step()
    assert first.status == second.status == 200
    if stream:
        assert CLEAN_ENDS[api] in _event_names(second)
    lost = [first.call_id, second.call_id]
    assert store.refused_marks == ["lost", "lost"]  # tried at once, refused
    # Meanwhile: /health names the loss; the rollout, unknown to the store, reads incomplete.
    health = await stack.get_json("/health", status=503)
    assert health["store"]["unmarked_losses"] == {
        "rollouts": 1,
        "calls": 2,
        "rollout_ids": ["lost"],
    }
    assert health["capture"]["answered_unstored"] == 2
    summary = await stack.get_json("/captures/rollouts/lost")
    assert (summary["num_calls"], summary["incomplete"]) == (0, True)
    [diagnostic] = summary["diagnostics"]["rollout"]
    assert diagnostic["kind"] == "store_failed" and diagnostic["details"]["call_ids"] == lost
    # A freeze would hand a trainer a rollout that reads complete: refused while unmarked.
    freeze = await stack.client.post("/captures/rollouts/lost/freeze")
    assert freeze.status == 503
    assert (await freeze.json())["error"]["code"] == "store_unavailable"
    metrics = await (await stack.client.get("/metrics")).text()
    assert "capture_proxy_calls_answered_unstored_total 2.0" in metrics
    # Writes succeed again: the next call is stored, and the loss is marked in the store.
    store.full = False
    assert (await h.step()).status == 200
    await recorder.close()  # the mark runs off the call's path: wait for it
    assert recorder.losses.pending == {}
    info = await store.get_rollout("lost")
    assert info.incomplete
    assert [(d.kind, d.details["call_ids"]) for d in info.diagnostics] == [("store_failed", lost)]
    assert (await stack.get_json("/health"))["status"] == "ok"
    summary = await stack.get_json("/captures/rollouts/lost")
    assert (summary["num_calls"], summary["incomplete"]) == (1, True)
    assert summary["diagnostics"]["rollout"] == [d.to_json() for d in info.diagnostics]
    assert (await stack.client.post("/captures/rollouts/lost/freeze")).status == 200


async def test_answer_setting_marks_at_once_when_only_the_call_is_refused(
    make_stack: MakeStack, tmp_path
):
    class PutFails(SQLiteStore):
        async def put_call(self, record, request=None, digests=None):
            raise StoreError("injected")

    stack = await make_stack(store=PutFails(tmp_path / "putfails"), store_failure="answer")
    h = harness("chat_completions", stack, "r1", stream=False)
    h.start()
    reply = await h.step()
    summary = await stack.get_json("/captures/rollouts/r1")
    assert summary["incomplete"] is True
    [diagnostic] = summary["diagnostics"]["rollout"]
    assert diagnostic["kind"] == "store_failed"
    assert diagnostic["details"]["call_ids"] == [reply.call_id]
    assert stack.client.app[RECORDER_KEY].losses.pending == {}


async def test_losses_unmarked_at_shutdown_are_logged(make_stack: MakeStack, tmp_path, caplog):
    stack = await _stack(make_stack, tmp_path, "backend_template", store_failure="answer")
    stack.client.app[RECORDER_KEY].store.full = True
    h = harness("chat_completions", stack, "r9", stream=False)
    h.start()
    reply = await h.step()
    await stack.client.close()  # the app's cleanup: one last attempt, then ERROR
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(
        line.startswith("rollout r9: 1 call(s) answered but not stored") and reply.call_id in line
        for line in lines
    ), lines


async def test_a_lifecycle_step_the_store_fails_is_a_retryable_503(make_stack: MakeStack, tmp_path):
    stack = await _stack(make_stack, tmp_path, "backend_template")
    h = harness("chat_completions", stack, "r1", stream=False)
    assert (await h.step()).status == 200
    stack.client.app[RECORDER_KEY].store.full = True
    resp = await stack.client.post("/captures/rollouts/r1/freeze")
    assert resp.status == 503  # not a 500 "internal proxy error"
    assert resp.headers["Retry-After"] == str(STORE_RETRY_AFTER_S)
    error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == ("server_error", "store_unavailable")
    assert error["message"] == (
        "the capture store failed: freezing rollout r1 failed: disk I/O error (injected)"
    )
    stack.client.app[RECORDER_KEY].store.full = False
    assert (await stack.client.post("/captures/rollouts/r1/freeze")).status == 200


async def test_health_does_not_wait_behind_the_stores_queued_reads(
    make_stack: MakeStack, tmp_path, monkeypatch
):
    """The store's reads are queued (an export of a large rollout ahead, hundreds of calls in
    flight: trial 12 saw ``/health`` take 29 s): ``/health`` answers within
    ``HEALTH_STORE_WAIT_S``, in service, saying the store's reads wait: a liveness probe
    does not take the proxy out of service for a slow read; a store silent for
    ``STORE_SILENT_S`` is ``degraded`` (review: a hung store looked healthy for ever)."""
    import asyncio

    from capture_proxy.proxy import status

    class QueuedReads(SQLiteStore):
        released = asyncio.Event()

        async def health(self):
            await self.released.wait()  # behind the queue until released
            return await super().health()

    monkeypatch.setattr(status, "HEALTH_STORE_WAIT_S", 0.05)
    store = QueuedReads(tmp_path / "queued")
    stack = await make_stack(store=store)
    body = await stack.get_json("/health")
    assert body["status"] == "ok"
    assert body["store"] == {"read_wait": "no answer within 0.05 s (its reads are queued)"}
    # a store that has not answered for STORE_SILENT_S is taken as not answering
    reads = stack.client.app[status.STORE_HEALTH_KEY]
    reads.answered_at -= status.STORE_SILENT_S + 1.0
    body = await stack.get_json("/health", status=503)
    assert body["status"] == "degraded"
    assert body["store"]["error"].startswith("the store has not answered for ")
    store.released.set()  # the pending read (one, shared by the probes) answers
    body = await stack.get_json("/health")
    assert (body["status"], body["store"]["kind"]) == ("ok", "sqlite")


async def test_a_call_answered_without_its_record_is_no_retry_target(
    make_stack: MakeStack, tmp_path
):
    """``store_failure = answer``: the harness got the answer of a call the store did not
    take; an identical request after it (a sibling sample) is no retry of it (review: it
    was filed as failed when it ended)."""
    stack = await _stack(make_stack, tmp_path, "backend_template", store_failure="answer")
    store = stack.client.app[RECORDER_KEY].store
    body = harness("chat_completions", stack, "r1", stream=False)
    body.start()
    store.full = True
    lost = await body.send()
    assert lost.status == 200  # answered
    store.full = False
    sibling = await body.send()
    assert sibling.status == 200
    call = await stack.get_json(f"/captures/calls/{sibling.call_id}")
    assert call["retry_of"] is None
    assert [d["kind"] for d in call["diagnostics"] if d["kind"] == "retry"] == []
