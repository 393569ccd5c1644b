"""Tier 2: exact-token mode keeps chains exact where backend-template mode must refuse them."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from capture_proxy.core.sse import SSEStreamDecoder
from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.families.qwen_vocab import load_chat_template
from capture_proxy.harnesses.recorded import load_recording, replay, replay_engine_config
from capture_proxy.scripted_engine.app import ScriptedEngineConfig
from capture_proxy.scripted_engine.policy import Policy
from tests.proxy.conftest import Stack
from tests.proxy.test_capture import USER, _body
from tests.proxy.test_chains_rest import _echo

# Every turn's content is sampled one character at a time: ids the tokenizer would never
# produce for that text, as real models do (e.g. "_Ski" + "nny" instead of "_Skinny").
SPLIT_POLICY = Policy.model_validate(
    {
        "title": "Skinny title",
        "steps": [
            {
                "content": "Skinny first look.",
                "token_split": "characters",
                "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}],
            },
            {
                "content": "Then the notes, unskinnied.",
                "token_split": "characters",
                "tool_calls": [{"name": "read", "arguments": {"filePath": "notes.txt"}}],
            },
            {"content": "Done: all skinny.", "token_split": "characters"},
        ],
    }
)


async def _session(
    stack: Stack, rollout: str, *, stream: bool = False, tool_output: str = "out {step}"
) -> list[str]:
    messages = list(USER)
    ids = []
    for step in range(3):
        resp = await stack.chat(rollout, _body(messages, stream=stream))
        assert resp.status == 200, await resp.text()
        ids.append(resp.headers["X-Capture-Call-Id"])
        if stream:
            message = _assemble_stream(await resp.read())
        else:
            message = (await resp.json())["choices"][0]["message"]
        messages.append(_echo(message))
        for tc in message.get("tool_calls") or []:
            content = tool_output.format(step=step)
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": content})
    return ids


def _assemble_stream(raw: bytes) -> dict:
    decoder = SSEStreamDecoder()
    events = [*decoder.feed(raw), *decoder.close()]
    import json

    assert events[-1].data == "[DONE]"
    content, calls = "", {}
    for e in events[:-1]:
        for choice in json.loads(e.data)["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(
                    tc["index"],
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = tc.get("id") or slot["id"]
                slot["function"]["name"] += (tc.get("function") or {}).get("name") or ""
                slot["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


async def _chains(stack: Stack, rollout: str) -> list[list[str]]:
    chains = await stack.get_json(f"/captures/rollouts/{rollout}/chains")
    assert chains["incomplete"] is False
    return [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]]


async def test_backend_template_mode_must_refuse_retokenized_links(make_stack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY))
    ids = await _session(stack, "r1")
    assert await _chains(stack, "r1") == [[i] for i in ids]
    summary = await stack.get_json("/captures/rollouts/r1")
    assert summary["linking"]["links_refused"] == {"retokenized": 2}


DIALECTS = ["vllm_completions", "vllm_generate", "sglang_generate"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_exact_tokens_mode_keeps_one_exact_chain(
    make_stack, qwen_tokenizer_dir, stream, dialect
):
    # vllm_generate answers carry no text: it needs a local tokenizer to decode them.
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY, enable_scale_out=True),
        prompt_mode="exact_tokens",
        tokens_in_dialect=dialect,
        tokenizer=qwen_tokenizer_dir if dialect == "vllm_generate" else None,
    )
    ids = await _session(stack, "r1", stream=stream)
    assert await _chains(stack, "r1") == [ids]
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    calls = chains["chains"][0]["calls"]
    for parent, child in zip(calls, calls[1:], strict=False):
        prefix = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert child["prompt_token_ids"][: len(prefix)] == prefix
        assert child["linking"]["verdict"] == "resolved"
    # What was stored is exactly what the engine saw and sampled, over its tokens-in endpoint.
    assert [c["prompt_token_ids"] for c in calls] == [s.prompt_token_ids for s in stack.sent]
    assert [c["generation_token_ids"] for c in calls] == [
        s.generation_token_ids for s in stack.sent
    ]
    assert all("messages" not in s.request_body for s in stack.sent)
    assert [c["response_message"]["tool_calls"][0]["function"]["name"] for c in calls[:2]] == [
        "bash",
        "read",
    ]
    assert calls[2]["response_message"]["content"] == "Done: all skinny."
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "tool_calls", "stop"]


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_completions_echo_is_asked_only_when_configured(make_stack, stream):
    ids_by_echo = {}
    for echo in (False, True):
        stack = await make_stack(
            engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY),
            prompt_mode="exact_tokens",
            tokens_in_echo_prompt=echo,
        )
        rollout = f"r-echo-{echo}"
        ids = await _session(stack, rollout, stream=stream)
        assert await _chains(stack, rollout) == [ids]
        bodies = [s.request_body for s in stack.sent]
        assert [b.get("return_token_ids") for b in bodies] == [True if echo else None] * 3
        assert all(b["return_tokens_as_token_ids"] is True for b in bodies)
        chains = await stack.get_json(f"/captures/rollouts/{rollout}/chains")
        calls = chains["chains"][0]["calls"]
        assert all(c["status"] == "complete" for c in calls)
        ids_by_echo[echo] = [(c["prompt_token_ids"], c["generation_token_ids"]) for c in calls]
        assert [c[1] for c in ids_by_echo[echo]] == [s.generation_token_ids for s in stack.sent]
    assert ids_by_echo[False] == ids_by_echo[True]


async def test_exact_tokens_answer_has_the_chat_shape(make_stack):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY), prompt_mode="exact_tokens"
    )
    resp = await stack.chat("r1", _body(USER))
    body = await resp.json()
    assert body["object"] == "chat.completion"
    assert set(body["choices"][0]) == {
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
    }
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        # vLLM's hermes parser: the text before the first <tool_call>, its newline included
        "content": "Skinny first look.\n",
        "tool_calls": [
            {
                "id": body["choices"][0]["message"]["tool_calls"][0]["id"],
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls"}'},
            }
        ],
    }
    assert body["usage"]["completion_tokens"] == len(stack.sent[0].generation_token_ids)
    assert "prompt_token_ids" not in body


EXACT_EXPECTED = {
    # file, template -> chains (recorded seq numbers): one agent chain per session.
    ("01_multistep", "keep_reasoning"): [[1], [2, 3, 4, 5, 6, 7]],
    ("02_step_limit_obeyed", "keep_reasoning"): [[1], [2, 3, 4, 5, 6, 7]],
    ("03_step_limit_ignored", "keep_reasoning"): [[1], [2, 3, 4, 5, 6, 7]],
    ("05_reasoning_default", "drop_reasoning"): [[1], [2, 3, 4, 5]],
    ("06_reasoning_interleaved", "drop_reasoning"): [[1], [2, 3, 4]],
    ("05_reasoning_default", "keep_reasoning"): [[1], [2, 3, 4, 5]],
}


@pytest.mark.parametrize(("name", "template"), list(EXACT_EXPECTED), ids=str)
async def test_recorded_sessions_form_one_chain_in_exact_mode(
    make_stack, fixtures_dir, name, template
):
    recording = load_recording(fixtures_dir / "opencode" / "logs" / f"{name}.jsonl")
    stack = await make_stack(
        engine_config=replay_engine_config(recording, tokenizer_template=template),
        prompt_mode="exact_tokens",
    )
    calls = await replay(
        recording, str(stack.client.make_url("/ng-rollout/r1/training-token-capture/v1"))
    )
    assert [c.status for c in calls] == [200] * len(recording)
    seq_of = {c.call_id: c.seq for c in calls}
    chains = await _chains(stack, "r1")
    assert [[seq_of[i] for i in chain] for chain in chains] == EXACT_EXPECTED[(name, template)]
    detail = await stack.get_json("/captures/rollouts/r1/chains")
    for chain in detail["chains"]:
        for parent, child in zip(chain["calls"], chain["calls"][1:], strict=False):
            prefix = parent["prompt_token_ids"] + parent["generation_token_ids"]
            assert child["prompt_token_ids"][: len(prefix)] == prefix
            assert not [d for d in child["diagnostics"] if d["kind"] == "parent_digest_mismatch"]


async def test_tokenizer_directory_setting_renders_locally(make_stack, tmp_path):
    from capture_proxy.cli import main

    assert main(["export-tokenizer", str(tmp_path / "tok")]) == 0
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY),
        prompt_mode="exact_tokens",
        tokenizer=tmp_path / "tok",
    )
    ids = await _session(stack, "r1")
    assert await _chains(stack, "r1") == [ids]


async def test_per_model_override_selects_the_mode(make_stack):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY),
        prompt_mode_by_model={"scripted-qwen": "exact_tokens"},
    )
    ids = await _session(stack, "r1")
    assert await _chains(stack, "r1") == [ids]
    assert all("prompt" in s.request_body for s in stack.sent)  # /v1/completions bodies


class _CountingRenderer(LocalRenderer):
    """Our template and tokenizer, noting how many messages each render was given."""

    def __init__(self, tokenizer, template: str | None = None) -> None:
        super().__init__(tokenizer, template or load_chat_template("keep_reasoning"))
        self.full: list[int] = []
        self.tails: list[int] = []
        #: per tail render, whether it ran on the event loop's thread
        self.on_loop: list[bool] = []

    def render_sync(self, messages, tools, **kwargs):
        self.full.append(len(messages))
        return super().render_sync(messages, tools, **kwargs)

    def render_tail_sync(self, context, new_messages, tools, **kwargs):
        self.tails.append(len(context) + len(new_messages))
        self.on_loop.append(threading.current_thread() is threading.main_thread())
        return super().render_tail_sync(context, new_messages, tools, **kwargs)


async def _counting_stack(make_stack, qwen_tokenizer) -> tuple[_CountingRenderer, Stack]:
    """An exact-token stack rendering through a ``_CountingRenderer``."""
    renderer = _CountingRenderer(qwen_tokenizer)
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY),
        prompt_mode="exact_tokens",
        renderer=renderer,
    )
    return renderer, stack


async def _assert_one_spliced_chain(stack: Stack, rollout: str, ids: list[str], sent) -> None:
    """The rollout is one chain of ``ids`` whose prompts are the ones the engine got
    (``sent``), each spliced (no exact-prompt diagnostic)."""
    assert await _chains(stack, rollout) == [ids]
    chains = await stack.get_json(f"/captures/rollouts/{rollout}/chains")
    calls = chains["chains"][0]["calls"]
    assert [c["prompt_token_ids"] for c in calls] == [s.prompt_token_ids for s in sent]
    for c in calls:
        assert not [d for d in c["diagnostics"] if d["kind"].startswith("exact_prompt")]


async def test_resolved_calls_render_only_their_new_messages(make_stack, qwen_tokenizer):
    """Issue 16: a resolved call's prompt is the parent's ids extended by the rendering of the
    new messages only; the history is never rendered again."""
    renderer, stack = await _counting_stack(make_stack, qwen_tokenizer)
    ids = await _session(stack, "r1")
    assert renderer.full == [len(USER)]  # the root only
    # Each tail: system + user + the continued turn + its tool result.
    assert renderer.tails == [len(USER) + 2, len(USER) + 2]
    await _assert_one_spliced_chain(stack, "r1", ids, stack.sent)


async def test_a_large_new_message_renders_off_the_loop(make_stack, qwen_tokenizer):
    # A tail whose new messages are small renders on the loop (no thread hop); one carrying a
    # file the agent read (20 KB) renders in a worker thread: tokenizing it would hold the
    # loop for milliseconds. The ids are the same either way (one chain, the engine's prompts).
    renderer, stack = await _counting_stack(make_stack, qwen_tokenizer)
    small = await _session(stack, "small")
    big_output = "line {step}: " + "def f(x):\n    return x + 1\n" * 800  # about 20 KB
    large = await _session(stack, "large", tool_output=big_output)
    assert renderer.on_loop == [True, True, False, False]
    assert renderer.full == [len(USER), len(USER)]
    assert renderer.tails == [len(USER) + 2] * 4
    await _assert_one_spliced_chain(stack, "small", small, stack.sent[:3])
    await _assert_one_spliced_chain(stack, "large", large, stack.sent[3:])


async def test_a_template_whose_context_is_not_a_prefix_falls_back_to_a_full_render(
    make_stack, qwen_tokenizer
):
    """Where the tail cannot be found (the template renders the messages before the continued
    turn differently once more follow: here the system turn counts the messages), the whole
    conversation is rendered and spliced, the link is kept, and the fallback is recorded."""
    template = load_chat_template("keep_reasoning").replace(
        '{{- "<|im_start|>system\\n" -}}',
        '{{- "<|im_start|>system\\n" + (messages | length | string) -}}',
    )
    assert "messages | length | string" in template
    renderer = _CountingRenderer(qwen_tokenizer, template)
    policy = Policy.model_validate({"steps": [{"content": "Hello.", "reasoning": "Greet them."}]})
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=policy),
        prompt_mode="exact_tokens",
        renderer=renderer,
    )
    messages = list(USER)
    ids = []
    for follow_up in ("Again.", "Once more."):
        resp = await stack.chat("r1", _body(messages))
        assert resp.status == 200, await resp.text()
        ids.append(resp.headers["X-Capture-Call-Id"])
        messages += [_echo((await resp.json())["choices"][0]["message"])]
        messages.append({"role": "user", "content": follow_up})
    assert await _chains(stack, "r1") == [ids]
    child = await stack.get_json(f"/captures/calls/{ids[1]}")
    assert [d for d in child["diagnostics"] if d["kind"] == "exact_prompt_full_render"] == [
        {"kind": "exact_prompt_full_render", "details": {"reason": "template_not_prefix_stable"}}
    ]
    parent = await stack.get_json(f"/captures/calls/{ids[0]}")
    head = parent["prompt_token_ids"] + parent["generation_token_ids"]
    assert child["prompt_token_ids"][: len(head)] == head


MOE = (2, 2, 8)  # layers, top_k, experts


@pytest.mark.parametrize("dialect", ["vllm_completions", "vllm_generate", "sglang_generate"])
async def test_exact_tokens_mode_stores_routed_experts_of_new_rows_only(
    make_stack, qwen_tokenizer_dir, dialect
):
    """Issue 17 item 1: every tokens-in dialect asks for routed experts (only the rows after
    the parent's), stores them and checks their count."""
    from capture_proxy.scripted_engine.moe import expert_rows

    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY, moe=MOE, enable_scale_out=True),
        prompt_mode="exact_tokens",
        tokens_in_dialect=dialect,
        tokenizer=qwen_tokenizer_dir if dialect == "vllm_generate" else None,
        routed_experts_shape=MOE[:2],
    )
    ids = await _session(stack, "r1")
    assert await _chains(stack, "r1") == [ids]
    rows_end = 0
    for call_id, sent in zip(ids, stack.sent, strict=True):
        rec = await stack.get_json(f"/captures/calls/{call_id}")
        seq = sent.prompt_token_ids + sent.generation_token_ids
        assert rec["routed_experts_start"] == rows_end
        want = expert_rows(seq, MOE, rows_end)
        assert np.asarray(rec["routed_experts"]).tolist() == want.tolist()
        assert not [d for d in rec["diagnostics"] if d["kind"] == "routed_experts_mismatch"]
        rows_end = len(seq) - 1
    starts = [
        s.request_body.get(
            "routed_experts_prompt_start", s.request_body.get("routed_experts_start_len", 0)
        )
        for s in stack.sent
    ]
    assert starts[0] == 0 and all(s > 0 for s in starts[1:])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("max_model_len", "model_name", "answered"),
    [
        (None, "served-qwen", "served-qwen"),  # the id comes with ready()'s /v1/models
        (32768, "served-qwen", "served-qwen"),  # /v1/models not needed for it: asked lazily
        (32768, "", ""),  # the engine names no model: the empty string, never null
    ],
)
async def test_an_answer_to_a_request_without_a_model_names_the_served_model(
    make_stack, stream, max_model_len, model_name, answered
):
    # (also serving the name _body gives, for the last request)
    engine = ScriptedEngineConfig(model_name=model_name, model_aliases=(_body(USER)["model"],))
    stack = await make_stack(
        engine_config=engine, prompt_mode="exact_tokens", max_model_len=max_model_len
    )
    body = _body(USER, stream=stream)
    del body["model"]
    resp = await stack.chat("r1", body)
    assert resp.status == 200, await resp.text()
    if stream:
        decoder = SSEStreamDecoder()
        chunks = [
            json.loads(e.data) for e in [*decoder.feed(await resp.read())] if e.data != "[DONE]"
        ]
        assert chunks and {c["model"] for c in chunks} == {answered}
    else:
        assert (await resp.json())["model"] == answered
    call = await stack.get_json(f"/captures/calls/{resp.headers['X-Capture-Call-Id']}")
    assert call["model"] is None  # the record keeps the request as sent
    # a request that names its model is answered with that name
    named = await stack.chat("r2", _body(USER))
    assert (await named.json())["model"] == _body(USER)["model"]


async def test_the_served_model_name_is_asked_again_after_a_failure(aiohttp_server):
    from aiohttp import ClientSession, web

    from capture_proxy.core.engine_formats import get_dialect
    from capture_proxy.families import get_parser
    from capture_proxy.proxy.engine_render import EngineRenderer
    from capture_proxy.proxy.exact import ExactTokens

    answers = [web.Response(status=500, text="not ready"), web.json_response({"data": []})]
    asked = []

    async def models(request: web.Request) -> web.Response:
        asked.append(1)
        return answers[len(asked) - 1]

    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app)
    base = str(server.make_url("")).rstrip("/")
    async with ClientSession() as session:
        exact = ExactTokens(
            EngineRenderer(session, base), get_parser("qwen"), get_dialect("vllm_completions")
        )
        assert await exact.served_model_name(session, base) == ""  # 500: not kept
        assert await exact.served_model_name(session, base) == ""  # no model: kept
        assert await exact.served_model_name(session, base) == ""
    assert len(asked) == 2


def test_loading_a_tokenizer_is_logged_with_its_time(qwen_tokenizer_dir, tmp_path, caplog):
    """``serve --tokenizer DIR`` takes seconds before "serving on": it says what it loads."""
    import logging
    import re

    import aiohttp

    from capture_proxy.app import make_exact_tokens
    from capture_proxy.config import Settings

    caplog.set_level(logging.INFO, logger="capture_proxy")
    settings = Settings(
        backend="http://127.0.0.1:9",
        store=tmp_path / "s",
        prompt_mode="exact_tokens",
        tokens_in_dialect="vllm_generate",
        tokenizer=qwen_tokenizer_dir,
    )
    make_exact_tokens(settings, aiohttp.ClientSession.__new__(aiohttp.ClientSession))
    lines = [r.getMessage() for r in caplog.records if "tokenizer" in r.getMessage()]
    assert lines[0] == (
        f"loading the tokenizer and chat template from {qwen_tokenizer_dir} (setting tokenizer)"
    )
    assert re.fullmatch(
        rf"loaded the tokenizer from {re.escape(str(qwen_tokenizer_dir))} in \d+\.\d s", lines[1]
    )


@pytest.mark.parametrize("mode", ["backend_template", "exact_tokens"])
async def test_each_call_carries_its_prompt_mode(make_stack, mode):
    stack = await make_stack(
        engine_config=ScriptedEngineConfig(policy=SPLIT_POLICY, enable_scale_out=True),
        prompt_mode=mode,
    )
    ids = await _session(stack, "r1", stream=False)
    assert len(ids) == 3
    for call_id in ids:
        call = await stack.get_json(f"/captures/calls/{call_id}")
        assert call["prompt_mode"] == mode
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    listed = [c for ch in chains["chains"] for c in ch["calls"]] + chains["unlinked_calls"]
    assert sorted(c["call_id"] for c in listed) == sorted(ids)
    assert [c["prompt_mode"] for c in listed] == [mode] * 3
    summary = await stack.get_json("/captures/rollouts/r1")
    assert summary["prompt_modes"] == {mode: 3}
