"""Tier 3: the real Codex CLI (0.169.0) drives a multi-step tool session through the proxy.

Stack (``harness_stack``): the scripted engine (vLLM dialect, real Qwen tokenizer) and a real
proxy server on loopback ports, a temporary SQLite store, the proxy token set to Codex's dummy
key (so its ``Authorization: Bearer`` is really checked), and ``codex exec`` with its provider
``base_url`` at ``.../ng-rollout/<id>/training-token-capture/v1`` (``wire_api = "responses"``,
the driver's model catalog: ``apply_patch`` is offered as a freeform tool). The policy
(``capture_proxy/policies/codex.json``): reasoning + text + ``exec_command ls``;
``exec_command cat notes.txt``; ``apply_patch`` (freeform) turning the TODO line into DONE; a
final answer. So Codex really runs three tools between four model calls, in both prompt modes.

What Codex sent through the proxy (its traffic, checked here over REST):

- 4 calls, all ``POST .../v1/responses``, ``stream: true``, ``store: false``; no side call
  (title, summary, compaction), no ``previous_response_id``: the whole history each time, an
  exact prefix extension of the previous request plus our output items and the tool outputs.
- The items come back as we streamed them: the ``reasoning`` item with our ``summary``,
  ``content`` (``reasoning_text``) and sealed ``encrypted_content`` (so the reasoning text
  reaches the engine again), the ``message``, the ``function_call`` (arguments byte-identical)
  and the ``custom_tool_call`` for ``apply_patch`` (raw patch ``input``).
- Tool outputs: ``exec_command`` output wrapped (``Chunk ID: ..\\nWall time: ..\\nProcess
  exited with code 0\\nOriginal token count: N\\nOutput:\\n<stdout>``); ``apply_patch``:
  ``Exit code: 0\\nWall time: .. seconds\\nOutput:\\nSuccess. Updated the following
  files:\\nM notes.txt\\n``.
- Before the task: two ``developer`` items (base instructions, skills) and a ``user``
  ``<environment_context>`` item; no ``instructions`` field.

Harness notes: Codex adds no assistant message or model-side item the model did not write
(every assistant turn of every request is exactly an answer the proxy gave), so it needs no
module under ``harness_notes/``.

Chains, both modes: ONE chain of the 4 calls, every link ``resolved`` and token-exact, no
diagnostics but ``tools_not_rendered`` on each call (Codex always sends a ``namespace`` tool,
``multi_agent_v1``, which no chat template renders). In exact-token mode the engine got token ids,
exactly the stored prompt ids.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.harnesses.codex import API_KEY, find_codex, run_codex
from capture_proxy.scripted_engine.policy import Policy
from tests.e2e.harness_stack import (
    DONE_TEXT,
    NOTES_TEXT,
    POLICIES,
    PROMPT_MODES,
    check_engine_calls,
    extends,
    harness_stack,
    make_project,
    new_tool_results,
    run_harness,
)

CODEX = find_codex()

pytestmark = [
    pytest.mark.codex,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        CODEX is None, reason="Codex CLI not installed (run scripts/install-harnesses)"
    ),
]

POLICY_PATH = POLICIES / "codex.json"
ROLLOUT = "e2e-codex-0"
TASK = "List the files, show notes.txt and mark its TODO as done."
RUN_TIMEOUT_S = 90  # a session takes a few seconds; a hang fails instead of blocking
CALLS = 4  # ls, cat, apply_patch, answer
EXEC_OUTPUT = re.compile(
    r"Chunk ID: [0-9a-f]+\nWall time: [0-9.]+ seconds\nProcess exited with code 0\n"
    r"Original token count: \d+\nOutput:\n(?P<stdout>.*)",
    re.S,
)
PATCH_OUTPUT = re.compile(
    r"Exit code: 0\nWall time: [0-9.]+ seconds\nOutput:\n"
    r"Success\. Updated the following files:\nM notes\.txt\n"
)


async def run_codex_session(stack: Any, tmp_path: Path, rollout: str) -> tuple[Any, Path]:
    """One ``codex exec`` session in a scratch project through the proxy's capture path."""
    assert CODEX is not None
    project = make_project(tmp_path)
    result = await run_harness(
        run_codex,
        CODEX,
        stack.capture_root(rollout) + "/v1",
        project,
        TASK,
        timeout_s=RUN_TIMEOUT_S,
        home_dir=tmp_path / "home",
    )
    assert result.ok, result.describe()
    return result, project


def _stdout_of(tool_message: dict[str, Any]) -> str:
    match = EXEC_OUTPUT.fullmatch(tool_message["content"])
    assert match, tool_message["content"]
    return match["stdout"]


@pytest.mark.parametrize("prompt_mode", PROMPT_MODES)
async def test_codex_session_is_one_exact_chain(
    qwen_tokenizer, tmp_path: Path, prompt_mode: str
) -> None:
    policy = Policy.load(POLICY_PATH)
    async with harness_stack(
        qwen_tokenizer, tmp_path, policy=policy, prompt_mode=prompt_mode, proxy_token=API_KEY
    ) as stack:
        t0 = time.monotonic()
        result, project = await run_codex_session(stack, tmp_path, ROLLOUT)

        # the harness really ran the tools and printed the final answer
        assert policy.steps[-1].content in result.stdout, result.describe()
        assert (project / "notes.txt").read_text(encoding="utf-8") == DONE_TEXT

        summary = await stack.get(f"/captures/rollouts/{ROLLOUT}")
        assert summary["num_calls"] == CALLS and summary["num_complete"] == CALLS, summary
        assert (summary["num_incomplete"], summary["num_failed"]) == (0, 0), summary
        assert (summary["num_chains"], summary["num_roots"]) == (1, 1), summary
        assert summary["incomplete"] is False
        only_unrendered = {"rollout": [], "calls_by_kind": {"tools_not_rendered": CALLS}}
        assert summary["diagnostics"] == only_unrendered, summary

        body = await stack.get(f"/captures/rollouts/{ROLLOUT}/chains")
        assert body["unlinked_calls"] == [] and body["incomplete"] is False
        assert body["diagnostics"] == only_unrendered
        (chain,) = body["chains"]
        calls = chain["calls"]
        assert len(calls) == CALLS
        assert chain["chain_id"] == calls[0]["call_id"]
        assert calls[0]["parent_call_id"] is None
        assert calls[0]["linking"]["verdict"] == "root"
        for call in calls:
            assert call["api"] == "responses" and call["status"] == "complete", call["call_id"]
            assert call["stream"] is True, call["call_id"]
            (unrendered,) = call["diagnostics"]
            assert unrendered["kind"] == "tools_not_rendered", call["call_id"]
            assert [t["type"] for t in unrendered["details"]["tools"]] == ["namespace"]
        # one chain, token-exact: every child's prompt begins with parent prompt + generation
        for parent, child in zip(calls, calls[1:], strict=False):
            assert child["parent_call_id"] == parent["call_id"]
            assert child["linking"]["verdict"] == "resolved", child["linking"]
            assert child["linking"]["digest_parent_call_id"] == parent["call_id"]
            assert extends(child, parent), child["call_id"]
        check_engine_calls(stack, calls)

        details = [await stack.get(f"/captures/calls/{c['call_id']}") for c in calls]
        print(
            f"\ncodex e2e [{prompt_mode}]: {time.monotonic() - t0:.1f}s "
            f"(run {result.duration_s:.1f}s); chain {chain['chain_id']} calls={len(calls)}"
        )
        for d in details:
            print(
                f"  {d['call_id']} parent={d['parent_call_id']} "
                f"verdict={d['linking']['verdict']} prompt={d['num_prompt_tokens']} "
                f"gen={d['num_generation_tokens']} finish={d['finish_reason']}"
            )
    _check_codex_turns(details, policy)


def _check_codex_turns(details: list[dict[str, Any]], policy: Policy) -> None:
    """The answers, and Codex's real tool outputs in the next request's canonical messages."""
    ls_call, cat_call, patch_call, answer_call = details
    for d in details:
        names = {t["function"]["name"] for t in d["request_tools"]}
        assert {"exec_command", "apply_patch"} <= names, names
        # the freeform apply_patch tool is offered to the engine as one string parameter
        (patch_tool,) = [t for t in d["request_tools"] if t["function"]["name"] == "apply_patch"]
        assert patch_tool["function"]["parameters"]["required"] == ["input"]
        first_user = [m for m in d["request_messages"] if m["role"] == "user"][-1]
        assert first_user["content"] == TASK

    (ls_tc,) = ls_call["response_message"]["tool_calls"]
    assert ls_tc["function"] == {"name": "exec_command", "arguments": '{"cmd": "ls"}'}
    # vLLM's hermes parser keeps the text before <tool_call> as it is: in exact-token mode the
    # proxy parses as it does (the scripted engine, in backend-template mode, answers the
    # policy's message)
    content = ls_call["response_message"]["content"]
    assert content in (policy.steps[0].content, policy.steps[0].content + "\n")
    assert (content == policy.steps[0].content) == (ls_call["prompt_mode"] == "backend_template")
    assert ls_call["response_message"]["reasoning_content"] == policy.steps[0].reasoning
    (ls_out,) = new_tool_results(cat_call, ls_call)
    assert ls_out["tool_call_id"] == ls_tc["id"]
    assert _stdout_of(ls_out) == "notes.txt\n"  # the file the test created, and only it

    (cat_tc,) = cat_call["response_message"]["tool_calls"]
    assert json.loads(cat_tc["function"]["arguments"]) == {"cmd": "cat notes.txt"}
    (cat_out,) = new_tool_results(patch_call, cat_call)
    assert cat_out["tool_call_id"] == cat_tc["id"]
    assert _stdout_of(cat_out) == NOTES_TEXT

    (patch_tc,) = patch_call["response_message"]["tool_calls"]
    assert patch_tc["function"]["name"] == "apply_patch"
    patch = policy.steps[2].tool_calls[0].arguments["input"]
    assert json.loads(patch_tc["function"]["arguments"]) == {"input": patch}
    (patch_out,) = new_tool_results(answer_call, patch_call)
    assert patch_out["tool_call_id"] == patch_tc["id"]
    assert PATCH_OUTPUT.fullmatch(patch_out["content"]), patch_out["content"]

    assert answer_call["response_message"]["content"] == policy.steps[3].content
    assert not answer_call["response_message"].get("tool_calls")
    assert answer_call["finish_reason"] == "stop"

    # Codex hands every earlier answer back as it was given (reasoning included): the last
    # request's assistant turns are exactly the first three answers
    turns = [m for m in answer_call["request_messages"] if m["role"] == "assistant"]
    assert turns == [d["response_message"] for d in details[:3]]
    # no assistant message the model did not write: no harness note
    before_task = answer_call["request_messages"][: _index_of_task(answer_call)]
    assert [m["role"] for m in before_task] == ["system", "system", "user"]
    assert before_task[2]["content"].startswith("<environment_context>")


def _index_of_task(detail: dict[str, Any]) -> int:
    return next(i for i, m in enumerate(detail["request_messages"]) if m["content"] == TASK)
