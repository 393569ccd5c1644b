"""Tier 2: request-time parent resolution, fail-closed verification, retries, settings."""

from __future__ import annotations

from capture_proxy.harnesses.recorded import load_recording, replay, replay_engine_config
from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.proxy.conftest import Stack
from tests.proxy.test_capture import USER, _body
from tests.proxy.test_chains_rest import _echo

SPLIT_POLICY = Policy.model_validate(
    {
        "steps": [
            {
                "content": "Skinny elephants",
                "token_split": "characters",
                "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}],
            },
            {"content": "Done."},
        ]
    }
)


async def _step(stack: Stack, rollout: str, messages: list, **kwargs) -> tuple[str, dict]:
    resp = await stack.chat(rollout, _body(messages), **kwargs)
    assert resp.status == 200
    return resp.headers["X-Capture-Call-Id"], (await resp.json())["choices"][0]["message"]


async def test_retokenized_parent_output_is_refused_and_classified(make_stack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY))
    first_id, message = await _step(stack, "r1", list(USER))
    messages = [
        *USER,
        _echo(message),
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "a.txt"},
    ]
    second_id, _ = await _step(stack, "r1", messages)
    call = await stack.get_json(f"/captures/calls/{second_id}")
    assert call["parent_call_id"] is None
    assert call["linking"]["verdict"] == "refused"
    assert call["linking"]["digest_parent_call_id"] == first_id
    [diag] = call["diagnostics"]
    sent = stack.sent
    parent_prefix = sent[0].prompt_token_ids + sent[0].generation_token_ids
    position = next(
        i
        for i, (a, b) in enumerate(zip(parent_prefix, sent[1].prompt_token_ids, strict=False))
        if a != b
    )
    assert diag == {
        "kind": "parent_digest_mismatch",
        "details": {
            "parent_call_id": first_id,
            "position": position,
            "class": "retokenized",
            "explanation": (
                "same text, different tokens: the parent's output re-encodes differently"
            ),
            "classified_with_text": True,
        },
    }
    # The first differing token is inside the parent's output, right where the content starts.
    assert position == len(sent[0].prompt_token_ids)
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [
        [first_id],
        [second_id],
    ]
    summary = await stack.get_json("/captures/rollouts/r1")
    assert summary["linking"]["links_refused"] == {"retokenized": 1}


async def test_identical_retry_is_recorded_as_a_retry_not_a_branch(make_stack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(fail_status=500, fail_first_n=1))
    failed = await stack.chat("r1", _body(list(USER)))
    assert failed.status >= 500
    first_id = failed.headers["X-Capture-Call-Id"]
    retry_id, message = await _step(
        stack, "r1", list(USER), headers={"x-stainless-retry-count": "1"}
    )
    messages = [
        *USER,
        _echo(message),
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "a.txt"},
    ]
    child_id, _ = await _step(stack, "r1", messages)

    retry = await stack.get_json(f"/captures/calls/{retry_id}")
    assert retry["retry_of"] == first_id
    assert retry["diagnostics"] == [
        {"kind": "retry", "details": {"retry_of": first_id, "retry_count_header": "1"}}
    ]
    child = await stack.get_json(f"/captures/calls/{child_id}")
    assert child["parent_call_id"] == retry_id
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [
        [retry_id, child_id]
    ]
    assert [(u["call_id"], u["status"], u["reason"]) for u in chains["unlinked_calls"]] == [
        (first_id, "failed", "superseded_retry")
    ]
    summary = await stack.get_json("/captures/rollouts/r1")
    assert summary["linking"]["retries"] == 1
    assert summary["linking"]["superseded_retries"] == 1
    assert summary["num_branches"] == 0


async def test_unknown_assistant_turn_is_unresolved_and_flagged(stack: Stack):
    messages = [
        *USER,
        {"role": "assistant", "content": "An example answer written by the caller."},
        {"role": "user", "content": "Now do it."},
    ]
    call_id, _ = await _step(stack, "r1", messages)
    call = await stack.get_json(f"/captures/calls/{call_id}")
    assert call["linking"]["verdict"] == "unresolved"
    assert call["parent_call_id"] is None
    assert [d["kind"] for d in call["diagnostics"]] == ["foreign_turn_projected_portable"]


async def test_source_history_starts_a_new_chain_after_each_note(make_stack, fixtures_dir):
    recording = load_recording(fixtures_dir / "opencode" / "logs" / "03_step_limit_ignored.jsonl")
    stack = await make_stack(
        engine_config=replay_engine_config(recording),
        parent_resolution="source_history",
    )
    calls = await replay(
        recording, str(stack.client.make_url("/ng-rollout/r1/training-token-capture/v1"))
    )
    seq_of = {c.call_id: c.seq for c in calls}
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [[seq_of[c["call_id"]] for c in ch["calls"]] for ch in chains["chains"]] == [
        [1],
        [2, 3, 4],
        [5],
        [6],
        [7],
    ]
    after_note = [c for ch in chains["chains"] for c in ch["calls"] if seq_of[c["call_id"]] >= 5]
    for call in after_note:
        # Not even tried: no token verification, so no mismatch diagnostic, just the reason.
        assert call["linking"]["verdict"] == "unresolved"
        assert "harness note" in call["linking"]["reason"]
        assert [d["kind"] for d in call["diagnostics"]] == ["harness_note_rewritten"]


async def test_links_survive_a_proxy_restart(make_stack, stack: Stack):
    first_id, message = await _step(stack, "r1", list(USER))
    # The restarted proxy (make_stack stops the first) has an empty index: it must load it
    # from the store.
    stack2 = await make_stack()
    assert stack2.store_dir == stack.store_dir
    messages = [
        *USER,
        _echo(message),
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "x"},
    ]
    child_id, _ = await _step(stack2, "r1", messages)
    child = await stack2.get_json(f"/captures/calls/{child_id}")
    assert child["parent_call_id"] == first_id and child["linking"]["verdict"] == "resolved"


async def test_refused_link_flags_partial_routed_expert_rows(make_stack):
    from tests.proxy.test_npz_and_retention import MOE

    stack = await make_stack(engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY, moe=MOE))
    first_id, message = await _step(stack, "r1", list(USER))
    messages = [
        *USER,
        _echo(message),
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "a"},
    ]
    second_id, _ = await _step(stack, "r1", messages)
    call = await stack.get_json(f"/captures/calls/{second_id}")
    first = await stack.get_json(f"/captures/calls/{first_id}")
    start = first["num_prompt_tokens"] + first["num_generation_tokens"] - 1
    assert call["routed_experts_start"] == start
    assert call["linking"]["verdict"] == "refused"
    assert call["diagnostics"][-1] == {
        "kind": "routed_experts_mismatch",
        "details": {
            "reason": "the digest parent's link was not taken: rows before "
            "routed_experts_start were not asked for",
            "routed_experts_start": start,
        },
    }


async def test_verification_does_not_read_the_parent_back(make_stack, tmp_path):
    from capture_proxy.store.sqlite import SQLiteStore

    class CountingStore(SQLiteStore):
        reads = 0

        async def get_call(self, call_id):
            CountingStore.reads += 1
            return await super().get_call(call_id)

    stack = await make_stack(store=CountingStore(tmp_path / "counting"))
    messages = list(USER)
    for step in range(3):
        _, message = await _step(stack, "r1", messages)
        messages.append(_echo(message))
        for tc in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": f"o{step}"})
    # Two links verified by digest: no parent was read back from the store.
    assert CountingStore.reads == 0
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [len(c["calls"]) for c in chains["chains"]] == [3]


async def test_identical_concurrent_requests_are_sibling_samples_not_retries(make_stack):
    import asyncio

    from capture_proxy.scripted_engine import Faults

    stack = await make_stack(engine_config=ScriptedEngineConfig(faults=Faults(chunk_delay_s=0.01)))
    body = _body(list(USER), stream=True)
    answers = await asyncio.gather(*(stack.chat("r1", body) for _ in range(5)))
    for resp in answers:
        await resp.read()
    ids = sorted(resp.headers["X-Capture-Call-Id"] for resp in answers)
    calls = [await stack.get_json(f"/captures/calls/{i}") for i in ids]
    assert [c["retry_of"] for c in calls] == [None] * 5
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    # Five samples of one request: five roots, each exported; none superseded.
    assert sorted(ch["chain_id"] for ch in chains["chains"]) == ids
    assert chains["unlinked_calls"] == []


async def test_a_retry_header_never_supersedes_an_answered_call(make_stack):
    """A GRPO group in one rollout: two samples of one prompt, both answered; a third sample's
    SDK retry (``x-stainless-retry-count: 1``) whose first attempt never reached the proxy.
    No call of the group failed, so the retry replaces none: three samples, each its own
    chain, none superseded (trial 12: the retry took an answered sample's place and the
    export lost it)."""
    stack = await make_stack()
    body = _body(list(USER))
    answered = [await stack.chat("r1", body, headers={"x-stainless-retry-count": "0"})]
    answered.append(await stack.chat("r1", body))
    retried = await stack.chat("r1", body, headers={"x-stainless-retry-count": "1"})
    assert [r.status for r in (*answered, retried)] == [200, 200, 200]
    ids = [r.headers["X-Capture-Call-Id"] for r in (*answered, retried)]
    retry = await stack.get_json(f"/captures/calls/{ids[2]}")
    assert retry["retry_of"] is None
    assert [d for d in retry["diagnostics"] if d["kind"] == "retry"] == []
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert sorted(ch["chain_id"] for ch in chains["chains"]) == sorted(ids)
    assert chains["unlinked_calls"] == []


async def test_a_request_after_a_failed_identical_one_is_its_retry(make_stack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(fail_status=500, fail_first_n=1))
    body = _body(list(USER))
    failed = await stack.chat("r1", body)
    assert failed.status >= 500
    ok = await stack.chat("r1", body)
    assert ok.status == 200
    retry = await stack.get_json(f"/captures/calls/{ok.headers['X-Capture-Call-Id']}")
    assert retry["retry_of"] == failed.headers["X-Capture-Call-Id"]


async def test_link_indexes_stay_bounded_and_reload_from_the_store(make_stack):
    from capture_proxy.proxy.keys import LINKER_KEY

    stack = await make_stack(link_index_max_rollouts=2)
    first = {}
    for rollout in ("ra", "rb", "rc"):
        first[rollout] = await _step(stack, rollout, list(USER))
    linker = stack.client.app[LINKER_KEY]
    assert list(linker.indexes) == ["rb", "rc"]  # "ra" was least recently used: evicted
    call_id, message = first["ra"]
    messages = [
        *USER,
        _echo(message),
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "x"},
    ]
    child_id, _ = await _step(stack, "ra", messages)  # reloads "ra" from the store
    child = await stack.get_json(f"/captures/calls/{child_id}")
    assert child["parent_call_id"] == call_id and child["linking"]["verdict"] == "resolved"
    assert list(linker.indexes) == ["rc", "ra"]
    # three rollouts' first calls and the reload of "ra": four indexes made from the store
    metrics = await (await stack.client.get("/metrics")).text()
    assert "capture_proxy_link_index_loads_total 4.0" in metrics.splitlines()
    resp = await stack.client.delete("/captures/rollouts/rc")
    assert resp.status == 200 and list(linker.indexes) == ["ra"]


async def test_a_call_whose_resolution_failed_is_still_found_by_its_child(
    stack: Stack, monkeypatch
):
    """Resolution raised (never failing the call): the call is unresolved, its child digest is
    computed from its whole history, and the next call resolves to it."""
    from capture_proxy.proxy.linker import Linker

    messages = list(USER)
    first_id, message = await _step(stack, "r1", messages)
    messages += [_echo(message)]
    messages += [{"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "x"}]

    async def broken(*args, **kwargs):
        raise RuntimeError("index unavailable")

    with monkeypatch.context() as patch:
        patch.setattr(Linker, "resolve", broken)
        second_id, message = await _step(stack, "r1", messages)
    second = await stack.get_json(f"/captures/calls/{second_id}")
    assert second["linking"]["verdict"] == "unresolved"
    assert second["linking"]["reason"].startswith("parent resolution failed: RuntimeError")
    messages += [_echo(message), {"role": "user", "content": "go on"}]
    third_id, _ = await _step(stack, "r1", messages)
    third = await stack.get_json(f"/captures/calls/{third_id}")
    assert third["linking"]["verdict"] == "resolved"
    assert third["linking"]["digest_parent_call_id"] == second_id
    assert third["parent_call_id"] == second_id


async def test_recent_calls_answer_what_the_store_does_and_go_with_their_rollout(make_stack):
    """The linker keeps the calls it stored in memory (a parent is not decoded from the store
    again): a hit holds the values the store gives back, and a deleted rollout's are dropped."""
    import numpy as np

    from capture_proxy.proxy.keys import LINKER_KEY, STORE_KEY

    stack = await make_stack()
    call_id, message = await _step(stack, "ra", list(USER))
    linker = stack.client.app[LINKER_KEY]
    cached = linker.recent.get(call_id)
    stored = await stack.client.app[STORE_KEY].get_call(call_id)
    assert cached is not None and stored is not None and cached is not stored
    for name in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
        assert np.array_equal(getattr(cached, name), getattr(stored, name))
        assert getattr(cached, name).dtype == getattr(stored, name).dtype
    arrays = {"prompt_token_ids", "generation_token_ids", "generation_log_probs"}
    assert {k: v for k, v in vars(cached).items() if k not in arrays} == {
        k: v for k, v in vars(stored).items() if k not in arrays
    }
    assert await linker.get_call(call_id) is cached
    resp = await stack.client.delete("/captures/rollouts/ra")
    assert resp.status == 200
    assert linker.recent.get(call_id) is None and await linker.get_call(call_id) is None


def test_recent_calls_stay_within_their_bound_least_recently_used_out():
    import numpy as np

    from capture_proxy.core.records import CallRecord
    from capture_proxy.proxy.recent import RecentCalls

    def record(call_id: str, rollout: str = "r") -> CallRecord:
        return CallRecord(call_id, rollout, 0.0, prompt_token_ids=np.zeros(100, np.uint32))

    recent = RecentCalls(max_bytes=3 * 400 + 10)  # three records of 400 bytes (and "[]")
    for name in ("a", "b", "c"):
        recent.put(record(name))
    assert recent.get("a") is not None  # "b" is now the least recently used
    recent.put(record("d", rollout="other"))
    assert recent.get("b") is None and len(recent) == 3
    recent.forget("r")
    assert len(recent) == 1 and recent.get("d") is not None
    RecentCalls(max_bytes=10).put(record("big"))  # larger than the bound: not kept


async def test_two_identical_sub_agents_continuing_at_once_are_two_chains(tmp_path):
    """Two sub-agents given the same task answer alike (same tool-call ids, same tokens, as in
    backend-template mode); both continuations are resolved before either is stored. The
    second's must not take the first's call (no stored child yet) but its own sibling's: two
    chains, each session whole."""
    import numpy as np

    from capture_proxy.core.chains import build_chains
    from capture_proxy.core.records import CallRecord
    from capture_proxy.proxy.linker import Linker
    from capture_proxy.store.sqlite import SQLiteStore

    task = [{"role": "user", "content": "count the files"}]
    call = {"id": "call_0", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    answer = {"content": None, "tool_calls": [call]}
    history = [*task, {"role": "assistant", **answer}, {"role": "tool", "content": "a b"}]
    body = {"model": "m", "messages": history}

    def record(call_id: str, created_at: float, messages: list, prompt: list, gen: list):
        return CallRecord(
            call_id=call_id,
            rollout_id="r1",
            created_at=created_at,
            model="m",
            request_messages=messages,
            response_message=answer if messages is task else {"content": "2 files"},
            prompt_token_ids=np.asarray(prompt, np.uint32),
            generation_token_ids=np.asarray(gen, np.uint32),
            generation_log_probs=np.full(len(gen), -0.5, np.float32),
        )

    store = SQLiteStore(tmp_path / "store")
    await store.open()
    try:
        linker = Linker(store)
        for first in (
            record("a1", 1.0, task, [1, 2], [3, 4]),
            record("b1", 2.0, task, [1, 2], [3, 4]),
        ):
            await store.put_call(first)
            await linker.remember(first)
        kwargs = {"harness_note": None, "retry_count": None, "decode": None}
        resolutions = {
            name: await linker.resolve("r1", history, body, call_id=name, created_at=at)
            for name, at in (("a2", 3.0), ("b2", 4.0))
        }
        for name, at in (("b2", 4.0), ("a2", 3.0)):
            second = record(name, at, history, [1, 2, 3, 4, 5], [6])
            second = await linker.verify(second, resolutions[name], history, **kwargs)
            await store.put_call(second)
            await linker.remember(second)
        chains = build_chains("r1", await store.get_rollout_calls("r1"))
        assert [[c.call_id for c in chain.calls] for chain in chains.chains] == [
            ["a1", "a2"],
            ["b1", "b2"],
        ]
    finally:
        await store.close()


async def test_a_stored_call_whose_indexing_failed_is_no_retry_target(make_stack, monkeypatch):
    """Indexing a stored call failed (logged): the call is stored and answered, so an
    identical request after it is a sample of its own, not its retry (review: the call was
    filed as failed when it ended, and the sibling superseded it in the chains)."""
    from capture_proxy.proxy import linker as linker_module

    real, failures = linker_module.add_record, [1]

    def add_record_failing_once(index, record, digests=None):
        if failures:
            failures.pop()
            raise RuntimeError("indexing failed (injected)")
        return real(index, record, digests)

    monkeypatch.setattr(linker_module, "add_record", add_record_failing_once)
    stack = await make_stack()
    body = _body(list(USER))
    replies = [await stack.chat("r1", body) for _ in range(2)]
    assert [r.status for r in replies] == [200, 200]
    ids = [r.headers["X-Capture-Call-Id"] for r in replies]
    second = await stack.get_json(f"/captures/calls/{ids[1]}")
    assert second["retry_of"] is None
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert sorted(ch["chain_id"] for ch in chains["chains"]) == sorted(ids)
