"""Tier 4, issue 21: the published Qwen3 chat template, with the real vLLM as the oracle.

``scripts/e2e-vllm`` serves its tiny models with ``tests/fixtures/chat_templates/
qwen3_hybrid.jinja`` (the template Qwen3-0.6B ships). Here:

- the goldens the fast tier compares against are what this vLLM renders (re-rendered with
  ``scripts/render-goldens`` into a temporary directory, equal to the committed ones), and
  the server's own ``/tokenize`` gives the same ids for every case;
- exact-token sessions (a local tokenizer directory, as ``serve --tokenizer DIR``, and vLLM's
  ``/tokenize``) with OpenAI-SDK echoes (``content: null``), reasoning on and off, streamed or
  not, are one chain each; every first prompt equals ``/tokenize``; every later prompt is the
  parent's prompt and generation followed by exactly what vLLM renders after the parent's turn;
- backend-template mode refuses the link the template's re-rendering breaks, with its class.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.realengine.conftest import IM_END, VLLM_URL, RealStack, _stack
from tests.realengine.test_vllm import SYSTEM, TOOLS, USER, _stream

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = ROOT / "tests" / "fixtures" / "chat_templates" / "goldens"
MODEL_DIR = os.environ.get("CAPTURE_PROXY_VLLM_MODEL_DIR", "")
CALL_TEXT = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


@pytest.fixture
async def real_exact_local(aiohttp_client, tmp_path) -> Any:
    """Exact-token mode with the model directory's own tokenizer and template (local)."""
    assert MODEL_DIR, "scripts/e2e-vllm sets CAPTURE_PROXY_VLLM_MODEL_DIR"
    async for stack in _stack(
        aiohttp_client, tmp_path, prompt_mode="exact_tokens", tokenizer=Path(MODEL_DIR)
    ):
        yield stack


def _tokenize(real: RealStack, messages: list, tools: Any, generation: bool, kwargs=None):
    """vLLM's /tokenize chat form (it reads ``reasoning``, not ``reasoning_content``)."""
    sent = [
        {("reasoning" if k == "reasoning_content" else k): v for k, v in m.items()}
        for m in messages
    ]
    body: dict[str, Any] = {"model": real.model, "messages": sent}
    body["add_generation_prompt"] = generation
    if tools:
        body["tools"] = tools
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    resp = real.engine.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def test_goldens_are_what_this_vllm_renders(tmp_path):
    assert VLLM_URL
    subprocess.run(
        [str(ROOT / "scripts" / "render-goldens"), str(tmp_path)],
        check=True,
        timeout=1100,
        cwd=ROOT,
    )
    for committed in sorted(GOLDENS.glob("*.json")):
        fresh = json.loads((tmp_path / committed.name).read_text(encoding="utf-8"))
        assert fresh == json.loads(committed.read_text(encoding="utf-8")), committed.name


async def test_every_golden_case_is_the_servers_tokenize(real: RealStack):
    from tests.support.golden_cases import cases

    golden = json.loads((GOLDENS / "qwen3_hybrid.json").read_text(encoding="utf-8"))["cases"]
    checked = 0
    for case in cases():
        ids = _tokenize(
            real, case["messages"], case["tools"], True, case.get("chat_template_kwargs")
        )
        want = golden[case["name"]]
        assert len(ids) == want["prompt_len"], case["name"]
        if "prompt_token_ids" in want:
            assert ids == want["prompt_token_ids"], case["name"]
        checked += 1
    assert checked == len(golden) == 56


def _sdk_echo(message: dict) -> dict:
    echo: dict = {"role": "assistant", "content": message.get("content") or None}
    if message.get("reasoning_content"):
        echo["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        echo["tool_calls"] = [
            {
                "id": tc["id"],
                "type": "function",
                "function": {"name": tc["name"], "arguments": tc["arguments"]},
            }
            if "name" in tc
            else tc
            for tc in message["tool_calls"]
        ]
    return echo


def _after_turn(real: RealStack, conversation: list, j: int, kwargs) -> list[int]:
    full = _tokenize(real, conversation, TOOLS, True, kwargs)
    n = _tokenize(real, conversation[: j + 1], TOOLS, False, kwargs).count(IM_END)
    seen = 0
    for pos, tid in enumerate(full):
        seen += tid == IM_END
        if seen == n:
            return full[pos + 1 :]
    raise AssertionError("turn end not found")


async def _exact_session(real: RealStack, rollout: str, *, reasoning: bool, stream: bool):
    kwargs = None if reasoning else {"enable_thinking": False}
    think = "<think>\nList them.\n</think>\n\n" if reasoning else ""
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    call_ids, answers = [], []
    for text in (think + CALL_TEXT, think + "Done."):
        _, forced = real.forced(text)
        body = {
            "model": real.model,
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": 64,
            **forced,
        }
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if stream:
            call_id, chunks = await _stream(real, rollout, body)
            from tests.realengine.test_vllm import _assemble_stream

            message = _assemble_stream(chunks)
        else:
            resp = await real.chat(rollout, body)
            assert resp.status == 200, await resp.text()
            call_id = resp.headers["X-Capture-Call-Id"]
            message = (await resp.json())["choices"][0]["message"]
            assert message.get("reasoning_content") == ("List them." if reasoning else None)
        call_ids.append(call_id)
        answers.append(message)
        echo = _sdk_echo(message)
        if stream and reasoning:
            echo["reasoning_content"] = "List them."  # the test's stream assembly drops it
        messages.append(echo)
        for tc in echo.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": "README.md"})
    assert [tc["function"]["name"] for tc in messages[2]["tool_calls"]] == ["bash"]
    assert messages[2]["content"] is None  # the SDK echo that broke sessions before

    records = [await real.get_json(f"/captures/calls/{c}") for c in call_ids]
    assert records[0]["prompt_token_ids"] == _tokenize(real, [SYSTEM, USER], TOOLS, True, kwargs)
    head = records[0]["prompt_token_ids"] + records[0]["generation_token_ids"]
    assert records[1]["prompt_token_ids"] == head + _after_turn(real, messages[:4], 2, kwargs)
    for r in records:
        assert not [d for d in r["diagnostics"] if d["kind"].startswith("exact_prompt")]
    chains = await real.get_json(f"/captures/rollouts/{rollout}/chains")
    shapes = [[(c["call_id"], c["parent_call_id"]) for c in ch["calls"]] for ch in chains["chains"]]
    assert shapes == [[(call_ids[0], None), (call_ids[1], call_ids[0])]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("reasoning", [True, False], ids=["thinking", "no_thinking"])
async def test_exact_tokens_session_with_a_local_tokenizer(real_exact_local, reasoning, stream):
    await _exact_session(
        real_exact_local, f"pub-local-{reasoning}-{stream}", reasoning=reasoning, stream=stream
    )


@pytest.mark.parametrize("reasoning", [True, False], ids=["thinking", "no_thinking"])
async def test_exact_tokens_session_rendered_by_vllm(real_exact, reasoning):
    await _exact_session(real_exact, f"pub-engine-{reasoning}", reasoning=reasoning, stream=False)


async def test_backend_mode_names_the_rerendered_turn(real: RealStack):
    """The template drops the reasoning of a turn once a new user query follows: in
    backend-template mode the child's prompt no longer extends the parent's tokens, and the
    link is refused as ``template_rerendered``."""
    rollout = "pub-backend"
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    call_ids = []
    for text in ("<think>\nGreet.\n</think>\n\nHello.", "Bye."):
        _, forced = real.forced(text)
        resp = await real.chat(
            rollout, {"model": real.model, "messages": messages, "max_tokens": 32, **forced}
        )
        assert resp.status == 200, await resp.text()
        call_ids.append(resp.headers["X-Capture-Call-Id"])
        message = (await resp.json())["choices"][0]["message"]
        messages += [
            {"role": "assistant", "content": message["content"]},
            {"role": "user", "content": "Again."},
        ]
    child = await real.get_json(f"/captures/calls/{call_ids[1]}")
    assert child["parent_call_id"] is None
    mismatch = [d for d in child["diagnostics"] if d["kind"] == "parent_digest_mismatch"]
    assert [d["details"]["class"] for d in mismatch] == ["template_rerendered"]
