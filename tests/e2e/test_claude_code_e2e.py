"""Tier 3: the real Claude Code (2.1.328) drives a multi-step tool session through the proxy.

Stack (``harness_stack``): the scripted engine (vLLM dialect, real Qwen tokenizer, context
length 32768) and a real proxy server on loopback ports, a temporary SQLite store, the proxy
token set to Claude Code's dummy key (it sends it as ``x-api-key``, which is really checked),
and ``claude -p`` with ``ANTHROPIC_BASE_URL`` at ``.../ng-rollout/<id>/training-token-capture``
(it appends ``/v1/messages?beta=true``). The policy (``capture_proxy/policies/claude_code.json``):
reasoning + text + ``Bash ls``; ``Read notes.txt``; ``Edit`` turning the TODO line into DONE;
a final answer. So Claude Code really runs three tools between four model calls, in both
prompt modes.

What Claude Code sent through the proxy (its traffic, checked here over REST):

- 4 calls, all ``POST .../v1/messages?beta=true``, ``stream: true``, ``max_tokens: 32000``,
  ``thinking: {"type": "adaptive", "display": "omitted"}``; no side call (title, quota,
  count_tokens) in ``-p`` mode.
- A ``role: "system"`` message INSIDE ``messages``, right after the task: the ``# Environment``
  block, a one-block list with ``cache_control`` in the first request and a plain string from
  the second on. The Messages codec refused it (every call was a 400) until it was accepted as
  a canonical system message in its place; both forms give the same canonical message, so the
  change between calls does not break the chain.
- Thinking comes back as the block we streamed: ``thinking: ""`` (display omitted) and our
  sealed ``signature``, so the reasoning text reaches the engine again.
- ``Edit``'s ``tool_use.input`` is REBUILT, not echoed: it comes back as ``{"replace_all":
  false, "file_path", "old_string", "new_string"}``, the schema default put first, which the
  model never wrote. ``Bash``/``Read`` inputs come back equal.
- Tool results: ``Bash`` ``ls`` -> ``notes.txt`` (``is_error: false``); ``Read`` -> ``cat -n``
  style ``1\\tTODO: ...``; ``Edit`` -> ``The file notes.txt has been updated successfully. ...``.

Harness notes: Claude Code adds no assistant message the model did not write; the rewritten
``Edit`` input is a rewrite of the model's own turn (kept in every later request), not a note
added and dropped, so it needs no module under ``harness_notes/``: the linker finds that turn
by its tool-call ids (``turn_rewritten``) and the tokens decide.

Chains:

- exact-token mode: ONE chain of the 4 calls, every link ``resolved`` and token-exact (the
  proxy splices the parent's own tokens, so the rewritten Edit input never reaches the engine:
  the 4th call records ``turn_rewritten`` and still links). Every call records
  ``max_tokens_clamped`` (32000 asked, the engine's context left given).
- backend-template mode: ONE chain, but the 4th call is a branch: its digest parent (the Edit
  call) is refused, ``parent_digest_mismatch`` class ``template_rerendered`` (the template
  renders the rewritten input ``{"replace_all": false, ...}``, not what the model generated),
  found by tool-call ids (``turn_rewritten``); it is linked to its deepest token-exact
  ancestor, the Read call (verdict ``prefix``). Chain: 1 <- 2 <- 3, 2 <- 4.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.harnesses.claude_code import API_KEY, find_claude, run_claude
from capture_proxy.scripted_engine.policy import Policy
from tests.e2e.harness_stack import (
    DONE_TEXT,
    MAX_MODEL_LEN,
    NOTES_LINES,
    POLICIES,
    PROMPT_MODES,
    check_engine_calls,
    extends,
    full,
    harness_stack,
    make_project,
    new_tool_results,
    run_harness,
)

CLAUDE = find_claude()

pytestmark = [
    pytest.mark.claude_code,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        CLAUDE is None, reason="Claude Code not installed (run scripts/install-harnesses)"
    ),
]

POLICY_PATH = POLICIES / "claude_code.json"
ROLLOUT = "e2e-claude-code-0"
TASK = "List the files, read notes.txt and mark its TODO as done."
RUN_TIMEOUT_S = 90  # a session takes a few seconds; a hang fails instead of blocking
CALLS = 4  # Bash, Read, Edit, answer
MAX_TOKENS = 32000  # what Claude Code asks for an unknown model
READ_OUTPUT = "".join(f"{i}\t{line}\n" for i, line in enumerate(NOTES_LINES, 1)) + "4\t"
EDIT_OUTPUT = (
    "The file notes.txt has been updated successfully. (file state is current in your "
    "context — no need to Read it back)"
)
TURN_REWRITTEN = (
    "the last model-authored turn was rewritten by the harness; found by its tool-call ids"
)


async def run_claude_session(stack: Any, tmp_path: Path, rollout: str) -> tuple[Any, Path]:
    """One ``claude -p`` session in a scratch project through the proxy's capture path."""
    assert CLAUDE is not None
    project = make_project(tmp_path)
    result = await run_harness(
        run_claude,
        CLAUDE,
        stack.capture_root(rollout),
        project,
        TASK,
        timeout_s=RUN_TIMEOUT_S,
        home_dir=tmp_path / "home",
    )
    assert result.ok, result.describe()
    return result, project


def _kinds(call: dict[str, Any]) -> list[str]:
    return [d["kind"] for d in call["diagnostics"]]


@pytest.mark.parametrize("prompt_mode", PROMPT_MODES)
async def test_claude_code_session_chains(qwen_tokenizer, tmp_path: Path, prompt_mode: str):
    policy = Policy.load(POLICY_PATH)
    async with harness_stack(
        qwen_tokenizer, tmp_path, policy=policy, prompt_mode=prompt_mode, proxy_token=API_KEY
    ) as stack:
        t0 = time.monotonic()
        result, project = await run_claude_session(stack, tmp_path, ROLLOUT)

        # the harness really ran the tools and printed the final answer
        assert policy.steps[-1].content in result.stdout, result.describe()
        assert (project / "notes.txt").read_text(encoding="utf-8") == DONE_TEXT

        exact = prompt_mode == "exact_tokens"
        summary = await stack.get(f"/captures/rollouts/{ROLLOUT}")
        assert summary["num_calls"] == CALLS and summary["num_complete"] == CALLS, summary
        assert (summary["num_incomplete"], summary["num_failed"]) == (0, 0), summary
        assert (summary["num_chains"], summary["num_roots"]) == (1, 1), summary
        assert summary["incomplete"] is False

        body = await stack.get(f"/captures/rollouts/{ROLLOUT}/chains")
        assert body["unlinked_calls"] == [] and body["incomplete"] is False
        by_kind = (
            {"max_tokens_clamped": CALLS, "turn_rewritten": 1}
            if exact
            else {"parent_digest_mismatch": 1, "turn_rewritten": 1}
        )
        assert body["diagnostics"] == {"rollout": [], "calls_by_kind": by_kind}
        assert summary["diagnostics"] == body["diagnostics"]
        (chain,) = body["chains"]
        calls = chain["calls"]
        assert len(calls) == CALLS
        bash, read, edit, answer = calls
        assert chain["chain_id"] == bash["call_id"]
        assert bash["parent_call_id"] is None and bash["linking"]["verdict"] == "root"
        for call in calls:
            assert call["api"] == "messages" and call["status"] == "complete", call["call_id"]
            assert call["stream"] is True, call["call_id"]
        for parent, child in [(bash, read), (read, edit)]:
            assert child["parent_call_id"] == parent["call_id"]
            assert child["linking"]["verdict"] == "resolved", child["linking"]
            assert extends(child, parent), child["call_id"]
        # the answer call's digest parent is always the Edit call (found by tool-call ids:
        # Claude Code rebuilt Edit's input, so the turn no longer digests as the answer was)
        assert answer["linking"]["digest_parent_call_id"] == edit["call_id"]
        rewritten = {
            "kind": "turn_rewritten",
            "details": {"parent_call_id": edit["call_id"], "reason": TURN_REWRITTEN},
        }
        if exact:
            # the proxy splices Edit's own tokens: the rewritten input never reaches the
            # engine, the tokens chain and the link is kept
            assert answer["parent_call_id"] == edit["call_id"]
            assert answer["linking"]["verdict"] == "resolved", answer["linking"]
            assert extends(answer, edit)
            for call in calls:
                clamped = {
                    "kind": "max_tokens_clamped",
                    "details": {
                        "requested": MAX_TOKENS,
                        "max_tokens": MAX_MODEL_LEN - call["num_prompt_tokens"],
                    },
                }
                extra = [rewritten] if call is answer else []
                assert _diagnostics(call) == [clamped, *extra], call["call_id"]
        else:
            # the engine renders the rewritten input {"replace_all": false, ...}: not what the
            # model generated, so the tokens do not chain; the link to Edit is refused
            # (template_rerendered) and the call is linked to its deepest token-exact
            # ancestor, the Read call: a branch beside Edit
            assert not extends(answer, edit)
            assert answer["parent_call_id"] == read["call_id"]
            assert answer["linking"]["verdict"] == "prefix", answer["linking"]
            assert extends(answer, read)
            assert [_kinds(c) for c in calls] == [
                [],
                [],
                [],
                ["turn_rewritten", "parent_digest_mismatch"],
            ]
            got_rewritten, mismatch = _diagnostics(answer)
            assert got_rewritten == rewritten
            assert mismatch["details"]["parent_call_id"] == edit["call_id"]
            assert mismatch["details"]["class"] == "template_rerendered"
            # the first differing token is inside Edit's generation (its tool-call JSON)
            position = mismatch["details"]["position"]
            head = full(edit)
            assert edit["num_prompt_tokens"] < position < len(head)
            assert answer["prompt_token_ids"][:position] == head[:position]
            assert answer["prompt_token_ids"][position] != head[position]
        check_engine_calls(stack, calls)

        details = [await stack.get(f"/captures/calls/{c['call_id']}") for c in calls]
        print(
            f"\nclaude code e2e [{prompt_mode}]: {time.monotonic() - t0:.1f}s "
            f"(run {result.duration_s:.1f}s); chain {chain['chain_id']} calls={len(calls)}"
        )
        for d in details:
            print(
                f"  {d['call_id']} parent={d['parent_call_id']} "
                f"verdict={d['linking']['verdict']} prompt={d['num_prompt_tokens']} "
                f"gen={d['num_generation_tokens']} finish={d['finish_reason']}"
            )
    _check_claude_turns(details, policy)


def _diagnostics(call: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"kind": d["kind"], "details": d["details"]} for d in call["diagnostics"]]


def _check_claude_turns(details: list[dict[str, Any]], policy: Policy) -> None:
    """The answers, and Claude Code's real tool output in the next request's canonical
    messages."""
    bash, read, edit, answer = details
    for d in details:
        names = {t["function"]["name"] for t in d["request_tools"]}
        assert {"Bash", "Read", "Edit"} <= names, names
        # Claude Code's `# Environment` system message inside `messages`, after the task,
        # canonical in every call (a one-block list first, then a string)
        roles = [m["role"] for m in d["request_messages"][:3]]
        assert roles == ["system", "user", "system"], roles
        assert d["request_messages"][1]["content"] == TASK
        assert d["request_messages"][2]["content"].startswith("# Environment\n")
        assert d["request_messages"][2] == bash["request_messages"][2]

    (bash_tc,) = bash["response_message"]["tool_calls"]
    assert json.loads(bash_tc["function"]["arguments"]) == {
        "command": "ls",
        "description": "List files",
    }
    # vLLM's hermes parser keeps the text before <tool_call> as it is: in exact-token mode the
    # proxy parses as it does (the scripted engine, in backend-template mode, answers the
    # policy's message)
    content = bash["response_message"]["content"]
    assert content in (policy.steps[0].content, policy.steps[0].content + "\n")
    assert (content == policy.steps[0].content) == (bash["prompt_mode"] == "backend_template")
    assert bash["response_message"]["reasoning_content"] == policy.steps[0].reasoning
    (ls_out,) = new_tool_results(read, bash)
    assert ls_out == {"role": "tool", "tool_call_id": bash_tc["id"], "content": "notes.txt"}

    (read_tc,) = read["response_message"]["tool_calls"]
    assert json.loads(read_tc["function"]["arguments"]) == {"file_path": "notes.txt"}
    (read_out,) = new_tool_results(edit, read)
    assert read_out == {"role": "tool", "tool_call_id": read_tc["id"], "content": READ_OUTPUT}

    (edit_tc,) = edit["response_message"]["tool_calls"]
    model_input = policy.steps[2].tool_calls[0].arguments
    assert json.loads(edit_tc["function"]["arguments"]) == model_input
    (edit_out,) = new_tool_results(answer, edit)
    assert edit_out == {"role": "tool", "tool_call_id": edit_tc["id"], "content": EDIT_OUTPUT}

    assert answer["response_message"]["content"] == policy.steps[3].content
    assert not answer["response_message"].get("tool_calls")
    assert answer["finish_reason"] == "stop"

    # the last request's assistant turns: the first two exactly as answered (thinking
    # included, from the sealed signature); the Edit turn rebuilt with "replace_all": false
    # put first
    turns = [m for m in answer["request_messages"] if m["role"] == "assistant"]
    assert turns[:2] == [bash["response_message"], read["response_message"]]
    (echoed_edit,) = turns[2]["tool_calls"]
    assert echoed_edit["id"] == edit_tc["id"]
    assert echoed_edit["function"]["arguments"] == json.dumps(
        {"replace_all": False, **model_input}, ensure_ascii=False
    )
    assert len(turns) == 3  # no assistant message the model did not write: no harness note
