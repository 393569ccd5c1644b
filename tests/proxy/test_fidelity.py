"""Tier 2: training-data fidelity of linking (issue "close the silent gaps"): parallel
sub-agents with identical turns, model scope, true refusal classes, harness-rewritten turns."""

from __future__ import annotations

import json

import pytest

from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.proxy.conftest import MakeStack, Stack
from tests.proxy.test_chains_rest import _echo

MODES = ["backend_template", "exact_tokens"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]

# Every answer is the same text, whatever the task: two sub-agents answer alike.
SAME_ANSWER = Policy.model_validate({"steps": [{"content": "On it."}], "final": "On it."})

TOOL_POLICY = Policy.model_validate(
    {
        "steps": [
            {"content": "First.", "tool_calls": [{"name": "bash", "arguments": {"command": "a"}}]},
            {"content": "Second.", "tool_calls": [{"name": "bash", "arguments": {"command": "b"}}]},
            {"content": "Done."},
        ]
    }
)


def _body(messages: list, model: str = "scripted-qwen", tools: list | None = None) -> dict:
    body = {"model": model, "messages": messages}
    if tools is not None:
        body["tools"] = tools
    return body


async def _ask(stack: Stack, messages: list, **kw) -> tuple[str, dict]:
    resp = await stack.chat("r1", _body(messages, **kw))
    assert resp.status == 200, await resp.text()
    return resp.headers["X-Capture-Call-Id"], (await resp.json())["choices"][0]["message"]


async def _call(stack: Stack, call_id: str) -> dict:
    return await stack.get_json(f"/captures/calls/{call_id}")


def _kinds(call: dict) -> list[tuple[str, str | None]]:
    return [(d["kind"], d["details"].get("class")) for d in call["diagnostics"]]


@pytest.mark.parametrize("mode", MODES)
async def test_parallel_subagents_with_identical_turns_each_keep_their_chain(
    make_stack: MakeStack, mode: str
):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=SAME_ANSWER), prompt_mode=mode
    )
    task_a = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Task A."}]
    task_b = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Task B."}]
    a1, msg_a1 = await _ask(stack, task_a, tools=TOOLS)
    b1, msg_b1 = await _ask(stack, task_b, tools=TOOLS)
    assert msg_a1["content"] == msg_b1["content"] == "On it."
    # Interleaved: A1, B1, A2. A2's digest matches both A1 and B1 (same turns).
    go = {"role": "user", "content": "Go."}
    a2, _ = await _ask(stack, [*task_a, _echo(msg_a1), go], tools=TOOLS)
    b2, _ = await _ask(stack, [*task_b, _echo(msg_b1), go], tools=TOOLS)
    got_a2, got_b2 = await _call(stack, a2), await _call(stack, b2)
    assert (got_a2["parent_call_id"], got_a2["linking"]["verdict"]) == (a1, "resolved")
    assert (got_b2["parent_call_id"], got_b2["linking"]["verdict"]) == (b1, "resolved")
    assert got_a2["diagnostics"] == got_b2["diagnostics"] == []
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [[a1, a2], [b1, b2]]
    # Token-exact: each child's prompt begins with its own parent's prompt + generation.
    for child, parent in ((got_a2, a1), (got_b2, b1)):
        p = await _call(stack, parent)
        prefix = p["prompt_token_ids"] + p["generation_token_ids"]
        assert child["prompt_token_ids"][: len(prefix)] == prefix


@pytest.mark.parametrize("mode", MODES)
async def test_a_parent_is_only_taken_from_a_call_to_the_same_model(
    make_stack: MakeStack, mode: str
):
    # one engine serving both names (vLLM: --served-model-name small-model big-model)
    engine = ScriptedEngineConfig(
        policy=SAME_ANSWER, model_name="small-model", model_aliases=("big-model",)
    )
    stack = await make_stack(engine_config=engine, prompt_mode=mode)
    task = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Task."}]
    small, msg = await _ask(stack, task, model="small-model", tools=TOOLS)
    big, _ = await _ask(
        stack,
        [*task, _echo(msg), {"role": "user", "content": "Go."}],
        model="big-model",
        tools=TOOLS,
    )
    call = await _call(stack, big)
    assert call["parent_call_id"] is None
    assert call["linking"]["verdict"] == "unresolved"
    assert call["linking"]["digest_parent_call_id"] is None
    [diag] = call["diagnostics"]
    assert diag["kind"] == "parent_model_mismatch"
    assert "small-model" in diag["details"]["reason"] and "big-model" in diag["details"]["reason"]
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert sorted(ch["chain_id"] for ch in chains["chains"]) == sorted([small, big])


async def _tool_session(stack: Stack) -> tuple[list, list[str], list[dict]]:
    messages = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Look."}]
    ids, answers = [], []
    for step in range(2):
        call_id, msg = await _ask(stack, messages, tools=TOOLS)
        ids.append(call_id)
        answers.append(msg)
        messages = [
            *messages,
            _echo(msg),
            {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": f"out{step}"},
        ]
    return messages, ids, answers


async def test_a_dropped_turn_is_history_edited_not_a_foreign_turn(make_stack: MakeStack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(policy=TOOL_POLICY))
    messages, (first, second), _ = await _tool_session(stack)
    # The harness prunes the first exchange (assistant turn + tool result) and goes on.
    pruned = [messages[0], messages[1], *messages[4:]]
    third, _ = await _ask(stack, pruned, tools=TOOLS)
    call = await _call(stack, third)
    assert (call["linking"]["verdict"], call["linking"]["reason"]) == (
        "unresolved",
        "the last model-authored turn is a captured call's output, but the history before it "
        "was edited",
    )
    assert _kinds(call) == [("parent_digest_mismatch", "history_edited")]
    assert call["diagnostics"][0]["details"]["parent_call_id"] == second


async def test_a_turn_with_rewritten_tool_call_ids_is_named_as_such(make_stack: MakeStack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(policy=TOOL_POLICY))
    messages, (first, second), _ = await _tool_session(stack)
    turn = messages[-2]
    renamed = {**turn, "tool_calls": [{**turn["tool_calls"][0], "id": "toolu_renamed"}]}
    tool = {**messages[-1], "tool_call_id": "toolu_renamed"}
    third, _ = await _ask(stack, [*messages[:-2], renamed, tool], tools=TOOLS)
    call = await _call(stack, third)
    assert _kinds(call) == [("parent_digest_mismatch", "history_edited")]
    details = call["diagnostics"][0]["details"]
    assert details["parent_call_id"] == second
    assert "tool-call ids" in details["explanation"]
    assert "foreign_turn_projected_portable" not in [d["kind"] for d in call["diagnostics"]]


@pytest.mark.parametrize("mode", MODES)
async def test_a_turn_the_harness_rewrote_is_found_by_its_tool_call_ids(
    make_stack: MakeStack, mode: str
):
    """Claude Code rebuilds a tool call's input (adding defaults such as "replace_all":
    false): the digest no longer matches, the tool-call ids still do. Tokens decide: in
    exact-token mode the model's own tokens are spliced, one chain; with the engine's
    template the rewritten arguments render differently, so the link is refused and the call
    goes to its deepest token-exact ancestor."""
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=TOOL_POLICY), prompt_mode=mode
    )
    messages, (first, second), _ = await _tool_session(stack)
    turn = messages[-2]
    fn = turn["tool_calls"][0]["function"]
    rewritten_args = json.dumps({"replace_all": False, **json.loads(fn["arguments"])})
    rewritten = {
        **turn,
        "tool_calls": [{**turn["tool_calls"][0], "function": {**fn, "arguments": rewritten_args}}],
    }
    third, _ = await _ask(stack, [*messages[:-2], rewritten, messages[-1]], tools=TOOLS)
    call = await _call(stack, third)
    assert call["linking"]["digest_parent_call_id"] == second
    assert ("turn_rewritten", None) in _kinds(call)
    if mode == "exact_tokens":
        assert (call["parent_call_id"], call["linking"]["verdict"]) == (second, "resolved")
    else:
        assert call["linking"]["verdict"] == "prefix"
        assert call["parent_call_id"] == first
        assert ("parent_digest_mismatch", "template_rerendered") in _kinds(call)
    parent = await _call(stack, call["parent_call_id"])
    prefix = parent["prompt_token_ids"] + parent["generation_token_ids"]
    assert call["prompt_token_ids"][: len(prefix)] == prefix


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda args: {**args, "command": "rm -rf /"}, id="an-argument-changed"),
        pytest.param(lambda args: {"replace_all": False}, id="an-argument-dropped"),
        pytest.param(None, id="the-text-changed"),
    ],
)
async def test_a_turn_the_harness_changed_is_what_the_engine_sees_in_exact_token_mode(
    make_stack: MakeStack, qwen_tokenizer, change
):
    """A rewrite found by its tool-call ids is spliced from the model's tokens only when the
    harness added arguments (defaults) and changed nothing else. A changed or dropped argument,
    or other text, is what the harness wants the model to see: the splice is refused, the
    conversation rendered whole, and the link left to the tokens (here: not taken)."""
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=TOOL_POLICY), prompt_mode="exact_tokens"
    )
    messages, (first, second), _ = await _tool_session(stack)
    turn = messages[-2]
    fn = turn["tool_calls"][0]["function"]
    if change is None:
        rewritten = {**turn, "content": "Something else."}
        shown = "Something else."
    else:
        args = change(json.loads(fn["arguments"]))
        call_ = {**turn["tool_calls"][0], "function": {**fn, "arguments": json.dumps(args)}}
        rewritten = {**turn, "tool_calls": [call_]}
        shown = "rm -rf /" if "command" in args else '"replace_all": false'
    third, _ = await _ask(stack, [*messages[:-2], rewritten, messages[-1]], tools=TOOLS)
    call = await _call(stack, third)
    assert call["linking"]["digest_parent_call_id"] == second
    refused = [d for d in call["diagnostics"] if d["kind"] == "exact_prompt_refused"]
    assert len(refused) == 1 and refused[0]["details"]["parent_call_id"] == second
    assert "beyond adding arguments" in refused[0]["details"]["reason"]
    assert call["parent_call_id"] != second
    prompt_text = qwen_tokenizer.decode(call["prompt_token_ids"])
    assert shown in prompt_text
    # and not what the model had written in its place
    replaced = "Second." if change is None else '"command": "b"'
    assert replaced not in prompt_text


async def test_tools_the_harness_withdrew_are_not_shown_in_exact_token_mode(
    make_stack: MakeStack, qwen_tokenizer
):
    """The template renders the tools in the prompt's head: a continuation whose request
    offers other tools than its parent's is not spliced from the parent's tokens (they show
    the old tools); it is rendered whole, and the link left to the tokens (not taken)."""
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=TOOL_POLICY), prompt_mode="exact_tokens"
    )
    extra = {**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "delete_everything"}}
    messages = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Look."}]
    first, msg = await _ask(stack, messages, tools=[*TOOLS, extra])
    tool_turn = {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "out"}
    messages = [*messages, _echo(msg), tool_turn]
    second, msg = await _ask(stack, messages, tools=TOOLS)
    call = await _call(stack, second)
    assert call["linking"]["digest_parent_call_id"] == first
    refused = [d for d in call["diagnostics"] if d["kind"] == "exact_prompt_refused"]
    assert [d["details"] for d in refused] == [
        {
            "parent_call_id": first,
            "reason": "the harness changed the tools since the parent's request: the prompt "
            "is rendered whole",
        }
    ]
    assert call["parent_call_id"] is None
    assert "delete_everything" not in qwen_tokenizer.decode(call["prompt_token_ids"])
    parent = await _call(stack, first)
    assert "delete_everything" in qwen_tokenizer.decode(parent["prompt_token_ids"])
    # the same tools sent again: spliced from the parent's tokens and linked
    tool_turn = {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "out"}
    third, _ = await _ask(stack, [*messages, _echo(msg), tool_turn], tools=TOOLS)
    call = await _call(stack, third)
    assert call["parent_call_id"] == second
    assert [d for d in call["diagnostics"] if d["kind"] == "exact_prompt_refused"] == []


# -- token counts, sampling, routed experts ----------------------------------------------------

USER = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Look."}]
MOE = (2, 2, 8)  # num_layers, top_k, num_experts


async def test_a_stream_that_lost_chunks_is_incomplete_by_the_engines_own_count(
    make_stack: MakeStack,
):
    from capture_proxy.scripted_engine import Faults

    stack = await make_stack(
        engine_config=ScriptedEngineConfig(
            policy=TOOL_POLICY, faults=Faults(drop_chunks_at=frozenset({1, 2, 3}))
        )
    )
    resp = await stack.chat("r1", {**_body(USER, tools=TOOLS), "stream": True})
    assert resp.status == 200
    await resp.read()
    call = await _call(stack, resp.headers["X-Capture-Call-Id"])
    sent = stack.sent[0]
    n = len(sent.generation_token_ids)
    assert call["status"] == "incomplete"
    assert len(call["generation_token_ids"]) == n - 3
    mismatch = next(d for d in call["diagnostics"] if d["kind"] == "token_count_mismatch")
    assert mismatch["details"] == {"completion_tokens": {"usage": n, "received": n - 3}}
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert chains["incomplete"] is True and chains["chains"] == []


@pytest.mark.parametrize("mode", MODES)
async def test_the_sampling_sent_to_the_engine_is_recorded(make_stack: MakeStack, mode: str):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=TOOL_POLICY), prompt_mode=mode
    )
    body = {
        **_body(USER, tools=TOOLS),
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 11,
        "max_tokens": 200,
        "stop": ["</done>"],
    }
    resp = await stack.chat("r1", body)
    assert resp.status == 200, await resp.text()
    call = await _call(stack, resp.headers["X-Capture-Call-Id"])
    assert call["sampling"] == {
        "sent": {
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 11,
            "max_tokens": 200,
            "stop": ["</done>"],
        },
        "engine_defaults": [
            "top_k",
            "min_p",
            "stop_token_ids",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "min_tokens",
            "ignore_eos",
        ],
    }


async def _moe_session(stack: Stack, stream_second: bool) -> tuple[dict, dict]:
    first = await stack.chat("r1", _body(USER, tools=TOOLS))
    msg = (await first.json())["choices"][0]["message"]
    messages = [
        *USER,
        _echo(msg),
        {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "out"},
    ]
    second = await stack.chat("r1", {**_body(messages, tools=TOOLS), "stream": stream_second})
    await second.read()
    return (
        await _call(stack, first.headers["X-Capture-Call-Id"]),
        await _call(stack, second.headers["X-Capture-Call-Id"]),
    )


async def test_a_streamed_moe_call_without_experts_says_so(make_stack: MakeStack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(policy=TOOL_POLICY, moe=MOE))
    first, second = await _moe_session(stack, stream_second=True)
    assert first["routed_experts"] is not None and first["diagnostics"] == []
    assert second["routed_experts"] is None
    [diag] = [d for d in second["diagnostics"] if d["kind"] == "routed_experts_unavailable"]
    assert diag["details"]["expectation"] == "optional"
    assert "vllm_generate" in diag["details"]["hint"]
    assert second["status"] == "complete"  # optional: flagged, still a link
    summary = await stack.get_json("/captures/rollouts/r1")
    assert "routed_experts_unavailable" in json.dumps(summary["diagnostics"])


async def test_required_routed_experts_make_a_call_without_them_incomplete(
    make_stack: MakeStack,
):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=TOOL_POLICY, moe=MOE),
        routed_experts="required",
    )
    first, second = await _moe_session(stack, stream_second=True)
    assert first["status"] == "complete"
    assert second["status"] == "incomplete"
    assert "routed experts are required" in json.dumps(second["diagnostics"])
    assert (await stack.get_json("/captures/rollouts/r1"))["incomplete"] is True


async def test_routed_experts_off_asks_for_none(make_stack: MakeStack):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=TOOL_POLICY, moe=MOE), routed_experts="off"
    )
    first, second = await _moe_session(stack, stream_second=True)
    assert "routed_experts_prompt_start" not in stack.sent[1].request_body
    assert [d["kind"] for d in second["diagnostics"]] == []
