"""Tier 2: an exact-token Llama 3.x session (the published Llama 3.3 template, Meta's
vocabulary) is one token-exact chain, the scripted engine and the proxy rendering with the same
llama3 family, and the tool calls the model wrote come back equal (whole and streamed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.llama3 import write_llama3_tokenizer
from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.proxy.conftest import Stack
from tests.proxy.test_model_families import TOOLS, USER, _as_written, _session

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "llama3_3.jinja"
MODEL = "agent-model"
EOT = 128009
# Llama 3.x writes one tool call per turn and no content beside it; no reasoning.
STEPS = [
    {"tool_calls": [{"name": "read", "arguments": {"path": "notes café.txt", "limit": 3}}]},
    {"tool_calls": [{"name": "bash", "arguments": {"command": "ls -la\ncat x"}}]},
    {"content": "Done: 2 files {ok}."},
]
WRITTEN = [
    {
        "reasoning_content": None,
        "content": "",
        "tool_calls": [("read", '{"path": "notes café.txt", "limit": 3}')],
    },
    {
        "reasoning_content": None,
        "content": "",
        "tool_calls": [("bash", '{"command": "ls -la\\ncat x"}')],
    },
    {"reasoning_content": None, "content": "Done: 2 files {ok}.", "tool_calls": []},
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama3_tokenizer(tmp_path_factory.mktemp("llama3"), TEMPLATE.read_text())


async def _stack(make_stack, llama_dir: Path) -> Stack:
    policy = Policy.model_validate({"steps": STEPS, "final": "Nothing more."})
    return await make_stack(
        engine_config=ScriptedEngineConfig(
            policy=policy, family="llama3", tokenizer_dir=llama_dir, model_name=MODEL
        ),
        prompt_mode="exact_tokens",
        model_families={MODEL: "llama3"},
        family_tokenizers={"llama3": llama_dir},
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_llama3_session_is_one_exact_chain(make_stack, llama_dir, stream):
    stack = await _stack(make_stack, llama_dir)
    answers = await _session(stack, stream=stream)
    fam = load_family("llama3", tokenizer_dir=llama_dir)

    assert [_as_written(a) for a in answers] == WRITTEN
    for answer in answers[:2]:
        (tc,) = answer["tool_calls"]
        assert tc["id"].startswith("call_") and len(tc["id"]) == 29
    assert answers[2].get("tool_calls") in (None, [])

    chains = await stack.get_json("/captures/rollouts/r1/chains")
    assert len(chains["chains"]) == 1
    calls = chains["chains"][0]["calls"]
    assert len(calls) == 3
    for parent, child in zip(calls, calls[1:], strict=False):
        prefix = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert child["prompt_token_ids"][: len(prefix)] == prefix
        assert child["linking"]["verdict"] == "resolved"
        assert child.get("diagnostics", []) == []

    # Exact ids: each generation is the family's writing of the step closed by <|eot_id|>;
    # each prompt is the published template's render of the conversation so far.
    sent = stack.sent
    assert [s.generation_token_ids for s in sent] == [c["generation_token_ids"] for c in calls]
    conversation = list(USER)
    for k, s in enumerate(sent):
        assert s.prompt_token_ids == fam.renderer.render_sync(
            conversation, TOOLS, add_generation_prompt=True
        )
        turn = {"role": "assistant", "content": answers[k].get("content")}
        if answers[k].get("tool_calls"):
            turn["tool_calls"] = answers[k]["tool_calls"]
        assert s.generation_token_ids == fam.write(turn)
        assert s.generation_token_ids[-1] == EOT
        conversation.append(turn)
        conversation += [
            {"role": "tool", "tool_call_id": tc["id"], "content": f"out {k}.{j}"}
            for j, tc in enumerate(answers[k].get("tool_calls") or [])
        ]
    assert fam.renderer.decode(sent[0].generation_token_ids) == (
        '{"name": "read", "parameters": {"path": "notes café.txt", "limit": 3}}<|eot_id|>'
    )
    assert fam.renderer.decode(sent[2].prompt_token_ids[-23:]).endswith(
        '<|start_header_id|>ipython<|end_header_id|>\n\n"out 1.0"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
