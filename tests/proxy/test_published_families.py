"""Issue 21, tier 2: agent sessions through the proxy on the published chat templates.

The client echoes each answer the way the OpenAI SDK hands it back (``content: null`` beside
``tool_calls``, reasoning as ``reasoning_content``), with reasoning on and off. In exact-token
mode every session is one chain extended turn by turn (no full render, no refusal), the first
prompt is the template's render as vLLM renders it, each later prompt is the parent's prompt
and generation followed by exactly what the template renders after the parent's turn, and the
answers come back as vLLM's tool parser for the family reads what the model wrote (Qwen3-2507
Thinking's reasoning, which starts in the generation prompt, as reasoning; hermes content with
the newline before the first call). In backend-template mode the same sessions are answered,
and any refused link is named with its class. Qwen3-Coder has no thinking mode (vLLM serves it
without a reasoning parser): its sessions run without reasoning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.factories import answered_content
from tests.proxy.conftest import Stack
from tests.proxy.test_exact_tokens import _assemble_stream

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
NAMES = [
    "qwen3_hybrid",
    "qwen3_hybrid_v2",
    "qwen3_2507_instruct",
    "qwen3_2507_thinking",
    "qwen3_coder",
]
IM_END = "<|im_end|>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "bash",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    },
]
USER = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read the notes, then list the files."},
]


def _steps(reasoning: bool) -> list[dict]:
    steps = [
        {
            "reasoning": "Plan: read the notes first.",
            "tool_calls": [{"name": "read", "arguments": {"path": "notes.txt", "limit": 3}}],
        },
        {
            "reasoning": "Now the listing.",
            "content": "Notes read.",
            "tool_calls": [{"name": "bash", "arguments": {"command": "ls -la"}}],
        },
        {"reasoning": "All seen.", "content": "Done: 2 files."},
    ]
    if not reasoning:
        for s in steps:
            del s["reasoning"]
    return steps


def _sdk_echo(message: dict) -> dict:
    """The assistant message as the OpenAI SDK returns it and a harness sends it back."""
    echo: dict = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content"):
        echo["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        echo["tool_calls"] = message["tool_calls"]
    return echo


async def _session(stack: Stack, rollout: str, *, stream: bool, kwargs: dict | None) -> list:
    messages = list(USER)
    answers = []
    for step in range(3):
        body = {"model": "scripted-qwen", "messages": messages, "tools": TOOLS, "stream": stream}
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        resp = await stack.chat(rollout, body)
        assert resp.status == 200, await resp.text()
        if stream:
            message = _assemble_stream(await resp.read())
        else:
            message = (await resp.json())["choices"][0]["message"]
        answers.append(message)
        messages = [*messages, _sdk_echo(message)]
        for k, tc in enumerate(message.get("tool_calls") or []):
            messages.append(
                {"role": "tool", "tool_call_id": tc["id"], "content": f"out {step}.{k}"}
            )
    return answers


def _after_turn(renderer: LocalRenderer, conversation: list, j: int, kwargs, eot: int) -> list:
    """The ids the template renders after turn ``j`` in the whole conversation (after its
    n-th end of turn, n counted in the render through the turn)."""
    full = renderer.render_sync(
        conversation, TOOLS, add_generation_prompt=True, chat_template_kwargs=kwargs
    )
    through = renderer.render_sync(
        conversation[: j + 1], TOOLS, add_generation_prompt=False, chat_template_kwargs=kwargs
    )
    n, seen = through.count(eot), 0
    for pos, tid in enumerate(full):
        seen += tid == eot
        if seen == n:
            return full[pos + 1 :]
    raise AssertionError("turn end not found")


# Qwen3-2507 Thinking always reasons (its generation prompt opens the block); Instruct never;
# Qwen3-Coder never (no thinking mode: a think block would be content)
CASES = [
    (name, reasoning)
    for name in NAMES
    for reasoning in (True, False)
    if not (name == "qwen3_2507_thinking" and not reasoning)
    and not (name == "qwen3_coder" and reasoning)
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("name", "reasoning"), CASES)
async def test_exact_tokens_session_on_a_published_template(
    make_stack, qwen_tokenizer, name, reasoning, stream
):
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    family = "qwen3_coder" if name == "qwen3_coder" else "qwen3"
    steps = _steps(reasoning)
    kwargs = None if reasoning or "2507" in name else {"enable_thinking": False}
    renderer = LocalRenderer(qwen_tokenizer, template)
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(
            policy=Policy.model_validate({"steps": steps, "final": "Nothing more."}),
            family=family,
            chat_template=template,
        ),
        prompt_mode="exact_tokens",
        renderer=renderer,
        output_parser=family,
    )
    answers = await _session(stack, "r1", stream=stream, kwargs=kwargs)

    for answer, step in zip(answers, steps, strict=True):
        if not stream:  # the test client's stream assembly keeps no reasoning deltas
            assert answer.get("reasoning_content") == step.get("reasoning")
        content = step.get("content", "")
        if family == "qwen3":  # hermes: the text before the first call
            content = answered_content(content, step.get("tool_calls"))
        assert (answer.get("content") or "") == content
        assert [
            (tc["function"]["name"], json.loads(tc["function"]["arguments"]))
            for tc in answer.get("tool_calls") or []
        ] == [(c["name"], c["arguments"]) for c in step.get("tool_calls", [])]

    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert len(chains["chains"]) == 1
    calls = chains["chains"][0]["calls"]
    assert len(calls) == 3
    for c in calls:
        assert c["diagnostics"] == []
    assert [c["linking"]["verdict"] for c in calls[1:]] == ["resolved", "resolved"]

    eot = qwen_tokenizer.convert_tokens_to_ids(IM_END)
    sent = stack.sent
    assert sent[0].prompt_token_ids == renderer.render_sync(
        USER, TOOLS, add_generation_prompt=True, chat_template_kwargs=kwargs
    )
    conversation = list(USER)
    for k, answer in enumerate(answers[:2]):
        conversation.append(
            _sdk_echo(answer)
            if not stream
            else {**_sdk_echo(answer), "reasoning_content": steps[k].get("reasoning")}
        )
        j = len(conversation) - 1
        conversation += [
            {"role": "tool", "tool_call_id": tc["id"], "content": f"out {k}.{i}"}
            for i, tc in enumerate(answer["tool_calls"])
        ]
        head = sent[k].prompt_token_ids + sent[k].generation_token_ids
        want = head + _after_turn(renderer, conversation, j, kwargs, eot)
        assert sent[k + 1].prompt_token_ids == want


@pytest.mark.parametrize(("name", "reasoning"), CASES)
async def test_backend_template_session_on_a_published_template(make_stack, name, reasoning):
    """The engine renders the published template itself; every call is answered, and a link
    the template's re-rendering breaks is refused with its class, never taken."""
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    family = "qwen3_coder" if name == "qwen3_coder" else "qwen3"
    steps = _steps(reasoning)
    kwargs = None if reasoning or "2507" in name else {"enable_thinking": False}
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(
            policy=Policy.model_validate({"steps": steps, "final": "Nothing more."}),
            family=family,
            chat_template=template,
        ),
    )
    await _session(stack, "r1", stream=False, kwargs=kwargs)
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    calls = [c for chain in chains["chains"] for c in chain["calls"]]
    assert len(calls) == 3
    got = [
        (
            c["linking"]["verdict"],
            [
                d["details"]["class"]
                for d in c["diagnostics"]
                if d["kind"] == "parent_digest_mismatch"
            ],
        )
        for c in calls
    ]
    # Instruct-2507 and Qwen3-Coder render no reasoning of history turns: a turn that had
    # some no longer extends token for token, and the link is refused as re-rendered.
    if reasoning and name in ("qwen3_2507_instruct", "qwen3_coder"):
        refused = ("refused", ["template_rerendered"])
        assert got == [("root", []), refused, refused]
        assert len(chains["chains"]) == 3
    else:
        assert got == [("root", []), ("resolved", []), ("resolved", [])]
        assert len(chains["chains"]) == 1
