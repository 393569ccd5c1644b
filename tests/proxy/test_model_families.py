"""Tier 2: an exact-token session per model family (qwen3, qwen3_coder, gpt_oss) is one
token-exact chain, the scripted engine and the proxy rendering with the same family objects,
and the tool calls and reasoning the model wrote come back equal."""

from __future__ import annotations

import json

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.hf_template import tail_context
from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.factories import answered_content
from tests.proxy.conftest import Stack
from tests.proxy.test_exact_tokens import _assemble_stream

MODEL = "agent-model"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The file."},
                    "limit": {"type": "integer"},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    },
]
STEPS = [
    {
        "reasoning": "Plan: read the notes first.",
        "content": "Let me look.",
        "tool_calls": [{"name": "read", "arguments": {"path": "notes café.txt", "limit": 3}}],
    },
    {
        "reasoning": "Two more things to check.",
        "tool_calls": [
            {"name": "bash", "arguments": {"command": "ls -la\ncat x"}},
            {"name": "read", "arguments": {"path": "b.txt"}},
        ],
    },
    {"reasoning": "All seen.", "content": "Done: 2 files."},
]
# gpt-oss ends its turn at the first <|call|>: one tool call per turn.
ONE_CALL_STEPS = [STEPS[0], {**STEPS[1], "tool_calls": STEPS[1]["tool_calls"][:1]}, STEPS[2]]


def _steps(family: str) -> list[dict]:
    if family == "qwen3_coder":
        # Qwen3-Coder has no thinking mode (vLLM serves it without a reasoning parser, so a
        # think block would be content)
        return [{k: v for k, v in s.items() if k != "reasoning"} for s in STEPS]
    return ONE_CALL_STEPS if family == "gpt_oss" else STEPS


USER = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read the notes."},
]
FAMILIES = ["qwen3", "qwen3_coder", "gpt_oss"]
#: the proxy's ``system_start_date`` (gpt-oss's ``Current date:``; not today's, so that a render
#: by the proxy is told from one by a family loaded without it)
START_DATE = "2026-01-01"


@pytest.fixture(scope="module")
def families(request):
    """One loaded family per name, to compute the expected ids in the tests."""
    from capture_proxy.families.qwen_vocab import load_qwen_tokenizer

    tok = load_qwen_tokenizer()
    return {f: load_family(f, tokenizer=tok, system_start_date=START_DATE) for f in FAMILIES}


def _expected_message(step: dict, family: str) -> dict:
    """What the harness reads: the step as written, its content as vLLM's tool parser for the
    family answers it (hermes: the text before the first call, newline included)."""
    calls = [
        (c["name"], json.dumps(c["arguments"], ensure_ascii=False))
        for c in step.get("tool_calls", [])
    ]
    content = step.get("content") or ""
    return {
        "reasoning_content": step.get("reasoning"),
        "content": answered_content(content, calls) if family == "qwen3" else content,
        "tool_calls": calls,
    }


def _as_written(message: dict) -> dict:
    return {
        "reasoning_content": message.get("reasoning_content"),
        "content": message.get("content") or "",
        "tool_calls": [
            (tc["function"]["name"], tc["function"]["arguments"])
            for tc in message.get("tool_calls") or []
        ],
    }


async def _session(stack: Stack, *, stream: bool) -> list[dict]:
    """Three agent calls, each answer sent back with its tool results; returns the answers."""
    messages = list(USER)
    answers = []
    for step in range(3):
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "stream": stream}
        resp = await stack.chat("r1", body)
        assert resp.status == 200, await resp.text()
        if stream:
            message = _assemble_stream(await resp.read())
        else:
            message = (await resp.json())["choices"][0]["message"]
        answers.append(message)
        echo = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning_content"):
            echo["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            echo["tool_calls"] = message["tool_calls"]
        messages = [*messages, echo]
        for k, tc in enumerate(message.get("tool_calls") or []):
            messages.append(
                {"role": "tool", "tool_call_id": tc["id"], "content": f"out {step}.{k}"}
            )
    return answers


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
async def test_family_session_is_one_exact_chain(make_stack, families, family, stream):
    steps = _steps(family)
    policy = Policy.model_validate({"steps": steps, "final": "Nothing more."})
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=policy, family=family, model_name=MODEL),
        prompt_mode="exact_tokens",
        model_families={MODEL: family},
        system_start_date=START_DATE,
    )
    answers = await _session(stack, stream=stream)
    fam = families[family]

    # What the model wrote comes back equal: reasoning, content, tool calls (arguments typed
    # by the schema for the XML format), with OpenAI ids.
    for answer, step in zip(answers, steps, strict=True):
        got = _as_written(answer)
        if stream:
            # the test client's stream assembly keeps no reasoning deltas
            got["reasoning_content"] = step.get("reasoning")
        assert got == _expected_message(step, family)
        for tc in answer.get("tool_calls") or []:
            assert tc["id"].startswith("call_") and len(tc["id"]) == 29

    # One chain, every link resolved and extended (no full render, no refusal).
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert len(chains["chains"]) == 1
    calls = chains["chains"][0]["calls"]
    assert len(calls) == 3
    for parent, child in zip(calls, calls[1:], strict=False):
        prefix = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert child["prompt_token_ids"][: len(prefix)] == prefix
        assert child["linking"]["verdict"] == "resolved"
        assert child.get("diagnostics", []) == []

    # Exact ids: the engine sampled the family's writing of each step, closed by its stop
    # token; the first prompt is the family's render; each later prompt is parent prompt +
    # generation + the render of the new messages, which for these layouts is also the
    # family's render of the whole conversation (the model's turn is a prefix of it), but for
    # gpt-oss: vLLM re-renders a tool-call turn otherwise than gpt-oss writes it (content
    # before reasoning, calls in ``json``, not ``<|constrain|>json``).
    sent = stack.sent
    assert [s.generation_token_ids for s in sent] == [c["generation_token_ids"] for c in calls]
    for s in sent:
        assert s.generation_token_ids[-1] in fam.close_ids
    assert sent[0].prompt_token_ids == fam.renderer.render_sync(
        USER, TOOLS, add_generation_prompt=True
    )
    conversation = list(USER)
    for k, answer in enumerate(answers[:2]):
        # the turn as the model wrote it (the answer's content holds the newline before a
        # Hermes call, which the template writes again)
        turn = {"role": "assistant", "content": steps[k].get("content") or ""}
        if steps[k].get("reasoning"):
            turn["reasoning_content"] = steps[k]["reasoning"]
        turn["tool_calls"] = answer["tool_calls"]
        conversation.append(turn)
        conversation += [
            {"role": "tool", "tool_call_id": tc["id"], "content": f"out {k}.{j}"}
            for j, tc in enumerate(answer["tool_calls"])
        ]
        turn_index = len(conversation) - len(answer["tool_calls"]) - 1
        tail = fam.renderer.render_tail_sync(
            tail_context(conversation, turn_index),
            conversation[turn_index + 1 :],
            TOOLS,
            end_of_turn_text=fam.end_of_turn_token,
        )
        parent = sent[k].prompt_token_ids + sent[k].generation_token_ids
        assert tail is not None
        assert sent[k + 1].prompt_token_ids == parent + tail
        full = fam.renderer.render_sync(conversation, TOOLS, add_generation_prompt=True)
        assert (sent[k + 1].prompt_token_ids == full) is (family != "gpt_oss")
    first = dict(policy.steps[0].assistant_message("seed"))
    assert sent[0].generation_token_ids == fam.write(first)
