"""Tier 2: Qwen2.5 / Qwen2.5-Coder Instruct sessions through the proxy on the published Qwen2.5
template (the Qwen2.5 vocabulary), the client echoing each answer as the OpenAI SDK hands it
back (``content: null`` beside ``tool_calls``). Exact-token mode: one token-exact chain, the
scripted engine and the proxy rendering with the same qwen2_5 family, each later prompt the
parent's prompt and generation followed by exactly what the template renders after the
parent's turn, the tool calls the model wrote come back equal (whole and streamed). Backend
mode (the engine renders the template): the same session is answered as vLLM's hermes parser
answers it, so the turn with content beside its calls comes back with the newline before the
first call in its content, which the template writes again: that turn does not re-render as
the model wrote it, and its child is linked by prefix with the refusal kept (vLLM 0.32 does
the same to this session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.qwen2_5 import write_qwen2_5_tokenizer
from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.factories import answered_content
from tests.proxy.conftest import Stack
from tests.proxy.test_exact_tokens import _assemble_stream
from tests.proxy.test_published_families import TOOLS, USER, _after_turn

TEMPLATE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen2_5_instruct.jinja"
)
MODEL = "m"
IM_END = 151645
STEPS = [
    {"tool_calls": [{"name": "read", "arguments": {"path": "notes café.txt", "limit": 3}}]},
    {
        "content": "Notes read.",
        "tool_calls": [
            {"name": "bash", "arguments": {"command": "ls -la\ncat x"}},
            {"name": "bash", "arguments": {"command": "pwd"}},
        ],
    },
    {"content": "Done: 2 files {ok}."},
]


@pytest.fixture(scope="module")
def qwen2_5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_5_tokenizer(tmp_path_factory.mktemp("qwen2_5"), TEMPLATE.read_text())


def _engine(qwen2_5_dir: Path) -> ScriptedEngineConfig:
    policy = Policy.model_validate({"steps": STEPS, "final": "Nothing more."})
    return ScriptedEngineConfig(
        policy=policy, family="qwen2_5", tokenizer_dir=qwen2_5_dir, model_name=MODEL
    )


def _sdk_echo(message: dict) -> dict:
    """The answer as the OpenAI SDK hands it back: ``content`` null when the model wrote
    none (a streamed answer accumulates no content deltas: None too)."""
    echo: dict = {"role": "assistant", "content": message.get("content") or None}
    if message.get("tool_calls"):
        echo["tool_calls"] = message["tool_calls"]
    return echo


async def _session(stack: Stack, *, stream: bool) -> tuple[list[dict], list[dict]]:
    """Three calls, each answer echoed back with its tool results: (answers, echoes)."""
    messages, answers, echoes = list(USER), [], []
    for step in range(3):
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "stream": stream}
        resp = await stack.chat("r1", body)
        assert resp.status == 200, await resp.text()
        if stream:
            message = _assemble_stream(await resp.read())
        else:
            message = (await resp.json())["choices"][0]["message"]
        answers.append(message)
        echoes.append(_sdk_echo(message))
        messages = [*messages, echoes[-1]]
        for k, tc in enumerate(message.get("tool_calls") or []):
            messages.append(
                {"role": "tool", "tool_call_id": tc["id"], "content": f"out {step}.{k}"}
            )
    return answers, echoes


def _calls(message: dict) -> list[tuple[str, str]]:
    return [
        (tc["function"]["name"], tc["function"]["arguments"])
        for tc in message.get("tool_calls") or []
    ]


WRITTEN = [
    ("", [("read", '{"path": "notes café.txt", "limit": 3}')]),
    ("Notes read.", [("bash", '{"command": "ls -la\\ncat x"}'), ("bash", '{"command": "pwd"}')]),
    ("Done: 2 files {ok}.", []),
]
#: what the harness reads (vLLM's hermes parser: the content is the text before the first
#: <tool_call>, its newline included)
ANSWERED = [(answered_content(content, calls), calls) for content, calls in WRITTEN]


@pytest.mark.parametrize("stream", [False, True])
async def test_qwen2_5_exact_tokens_session_is_one_chain(make_stack, qwen2_5_dir, stream):
    stack = await make_stack(
        engine_config=_engine(qwen2_5_dir),
        prompt_mode="exact_tokens",
        model_families={MODEL: "qwen2_5"},
        family_tokenizers={"qwen2_5": qwen2_5_dir},
    )
    answers, echoes = await _session(stack, stream=stream)
    fam = load_family("qwen2_5", tokenizer_dir=qwen2_5_dir)

    assert [((a.get("content") or ""), _calls(a)) for a in answers] == ANSWERED
    assert echoes[0]["content"] is None
    if not stream:
        assert answers[0]["content"] is None
    assert all(a.get("reasoning_content") is None for a in answers)

    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert len(chains["chains"]) == 1
    calls = chains["chains"][0]["calls"]
    assert len(calls) == 3
    assert [c["diagnostics"] for c in calls] == [[], [], []]
    assert [c["linking"]["verdict"] for c in calls[1:]] == ["resolved", "resolved"]

    sent = stack.sent
    assert [s.generation_token_ids for s in sent] == [c["generation_token_ids"] for c in calls]
    assert sent[0].prompt_token_ids == fam.renderer.render_sync(
        USER, TOOLS, add_generation_prompt=True
    )
    conversation = list(USER)
    for k, (answer, echo) in enumerate(zip(answers[:2], echoes, strict=False)):
        assert sent[k].generation_token_ids == fam.write({**echo, "content": WRITTEN[k][0]})
        assert sent[k].generation_token_ids[-1] == IM_END
        conversation.append(echo)
        j = len(conversation) - 1
        conversation += [
            {"role": "tool", "tool_call_id": tc["id"], "content": f"out {k}.{i}"}
            for i, tc in enumerate(answer["tool_calls"])
        ]
        head = sent[k].prompt_token_ids + sent[k].generation_token_ids
        want = head + _after_turn(fam.renderer, conversation, j, None, IM_END)
        assert sent[k + 1].prompt_token_ids == want
    assert fam.renderer.decode(sent[0].generation_token_ids) == (
        '<tool_call>\n{"name": "read", "arguments": {"path": "notes café.txt", "limit": 3}}'
        "\n</tool_call><|im_end|>"
    )
    assert fam.renderer.decode(sent[2].prompt_token_ids).endswith(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nout 1.0\n</tool_response>\n"
        "<tool_response>\nout 1.1\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


async def test_qwen2_5_backend_template_session_is_answered_as_vllm_answers_it(
    make_stack, qwen2_5_dir
):
    stack = await make_stack(engine_config=_engine(qwen2_5_dir))
    answers, echoes = await _session(stack, stream=False)
    assert echoes[0]["content"] is None
    assert [((a.get("content") or ""), _calls(a)) for a in answers] == ANSWERED
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert len(chains["chains"]) == 1
    calls = chains["chains"][0]["calls"]
    assert [c["linking"]["verdict"] for c in calls] == ["root", "resolved", "prefix"]
    assert [c["diagnostics"] for c in calls[:2]] == [[], []]
    [refusal] = calls[2]["diagnostics"]
    assert refusal["kind"] == "parent_digest_mismatch"
    assert refusal["details"]["class"] == "template_rerendered"
    assert refusal["details"]["parent_call_id"] == calls[1]["call_id"]
