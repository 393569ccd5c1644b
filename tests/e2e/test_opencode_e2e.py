"""Tier 3: the real OpenCode CLI drives a multi-step session through the proxy.

Stack: the scripted engine (vLLM dialect, real Qwen tokenizer) on a loopback port, the proxy
in front of it on another loopback port (a real server: OpenCode is an external process) with
a temporary SQLite store, and ``opencode run`` pointed at the proxy's capture path. The
policy (``capture_proxy/policies/opencode.json``) makes the agent ``read`` a file, run ``ls``
with ``bash`` and then answer, so OpenCode really executes two tools between model calls.

Every test here runs in both prompt modes (``PROMPT_MODES``): ``backend_template`` (the engine
renders the chat template, ``/v1/chat/completions``) and ``exact_tokens`` (the proxy splices the
prompt from the parent's stored tokens and calls the engine's tokens-in ``/v1/completions``).

Checked over REST afterwards: the title request is a chain of its own, the agent calls form
exactly one chain whose links extend each other token for token, every captured generation
is exactly what the engine sampled, OpenCode's real tool output is in the next request, and
nothing is incomplete or diagnosed. A ``run -c`` follow-up turn must extend the same chain
and send no new title request. In exact-token mode the engine got token ids, exactly the
stored prompt ids, and every child's prompt begins with its parent's prompt + generation.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.harnesses.opencode import (
    MODEL_ID,
    OpencodeResult,
    find_opencode,
    run_opencode,
)
from capture_proxy.scripted_engine.app import build_scripted_engine_app
from capture_proxy.scripted_engine.policy import Policy
from capture_proxy.scripted_engine.state import SENT_CALLS, ScriptedEngineConfig, SentCall
from capture_proxy.store.sqlite import SQLiteStore

OPENCODE = find_opencode()

pytestmark = [
    pytest.mark.opencode,
    pytest.mark.timeout(360),  # two bounded runs of at most RUN_TIMEOUT_S + 20 s each
    pytest.mark.skipif(
        OPENCODE is None,
        reason="OpenCode CLI not installed (run scripts/install-opencode, or set OPENCODE_BIN)",
    ),
]

POLICY_PATH = Path(__file__).resolve().parents[2] / "capture_proxy" / "policies" / "opencode.json"
ROLLOUT = "e2e-opencode-0"
NOTES_LINES = ["TODO: count the files", "alpha é ✓", "  indented beta"]
# ls in the project dir: our file plus the opencode.json that run_opencode writes
LS_OUTPUT = "notes.txt\nopencode.json\n"
AGENT_CALLS_PER_TURN = 3  # read, bash, answer
RUN_TIMEOUT_S = 120  # above OpenCode's ~70 s retry loop, so a dead endpoint fails, not hangs
PROMPT_MODES = ["backend_template", "exact_tokens"]


@dataclass(frozen=True)
class E2EStack:
    """The scripted engine and a real proxy server in front of it, in one prompt mode."""

    client: TestClient  # the proxy (read API)
    base_url: str  # the capture path OpenCode talks to
    sent: list[SentCall]  # what the engine answered, in arrival order
    prompt_mode: str


async def start_stack(
    aiohttp_server: Any,
    aiohttp_client: Any,
    tokenizer: Any,
    tmp_path: Path,
    *,
    policy: Policy,
    rollout: str,
    prompt_mode: str,
) -> E2EStack:
    """Engine + proxy on loopback ports, store in ``tmp_path/store``. In ``exact_tokens`` mode
    the proxy renders with the engine's ``/tokenize`` (no local tokenizer) and generates over
    ``/v1/completions``, the defaults."""
    # serving the model OpenCode is configured with (the engine refuses other names)
    engine_app = build_scripted_engine_app(
        ScriptedEngineConfig(policy=policy, model_name=MODEL_ID), tokenizer
    )
    engine = await aiohttp_server(engine_app, host="127.0.0.1", port=0)
    settings = Settings.model_validate(
        {
            "backend": f"http://127.0.0.1:{engine.port}",
            "store": tmp_path / "store",
            "prompt_mode": prompt_mode,
        }
    )
    proxy = await aiohttp_server(
        build_proxy_app(settings, SQLiteStore(tmp_path / "store")), host="127.0.0.1", port=0
    )
    client = await aiohttp_client(proxy)
    base_url = f"http://127.0.0.1:{proxy.port}/ng-rollout/{rollout}/training-token-capture/v1"
    return E2EStack(client, base_url, engine_app[SENT_CALLS], prompt_mode)


def check_engine_prompts(prompt_mode: str, calls: list[dict[str, Any]], sent: list[SentCall]):
    """Each stored call is exactly one engine call, over the endpoint of its prompt mode. In
    exact-token mode the engine got token ids (``prompt``), exactly the stored prompt ids, and
    a linked child's ids begin with its parent's prompt + generation, as the engine saw them."""
    by_id = {c["call_id"]: c for c in calls}
    for call in calls:
        body = _sent_for(sent, call["prompt_token_ids"]).request_body
        if prompt_mode == "backend_template":
            assert "messages" in body and "prompt" not in body, call["call_id"]
            continue
        assert "messages" not in body, call["call_id"]
        assert body["prompt"] == call["prompt_token_ids"], call["call_id"]
        parent = by_id.get(call["parent_call_id"])
        if parent is not None:
            head = parent["prompt_token_ids"] + parent["generation_token_ids"]
            assert body["prompt"][: len(head)] == head, call["call_id"]


def _read_wrapper(path: Path, lines: list[str]) -> str:
    """OpenCode 1.18.33's ``read`` tool result for a whole small file."""
    numbered = "".join(f"{i}: {line}\n" for i, line in enumerate(lines, start=1))
    return (
        f"<path>{path}</path>\n<type>file</type>\n<content>\n{numbered}\n"
        f"(End of file - total {len(lines)} lines)\n</content>"
    )


async def _opencode(project: Path, home: Path, base_url: str, prompt: str, **kw: Any):
    assert OPENCODE is not None
    result: OpencodeResult = await asyncio.wait_for(
        asyncio.to_thread(
            run_opencode,
            OPENCODE,
            base_url,
            project,
            prompt,
            home_dir=home,
            timeout_s=RUN_TIMEOUT_S,
            **kw,
        ),
        timeout=RUN_TIMEOUT_S + 20,  # run_opencode kills the process group itself first
    )
    assert result.ok, result.describe()
    return result


async def _get(client: TestClient, path: str) -> Any:
    resp = await client.get(path)
    assert resp.status == 200, await resp.text()
    return await resp.json()


def _sent_for(sent: list[SentCall], prompt_ids: list[int]) -> SentCall:
    matches = [s for s in sent if s.prompt_token_ids == prompt_ids]
    assert len(matches) == 1, f"{len(matches)} engine calls have this call's prompt ids"
    return matches[0]


async def _check_rollout(
    stack: E2EStack, *, agent_calls: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Assert the rollout's exact shape; return (title call, agent chain calls) with details."""
    client, sent = stack.client, stack.sent
    summary = await _get(client, f"/captures/rollouts/{ROLLOUT}")
    total = agent_calls + 1
    assert summary["num_calls"] == total, summary
    assert summary["num_complete"] == total, summary
    assert (summary["num_incomplete"], summary["num_failed"]) == (0, 0), summary
    assert (summary["num_chains"], summary["num_roots"]) == (2, 2), summary
    assert summary["incomplete"] is False, summary
    assert summary["diagnostics"] == {"rollout": [], "calls_by_kind": {}}, summary

    body = await _get(client, f"/captures/rollouts/{ROLLOUT}/chains")
    assert body["rollout_id"] == ROLLOUT
    assert body["unlinked_calls"] == []
    assert body["incomplete"] is False
    assert body["diagnostics"] == {"rollout": [], "calls_by_kind": {}}
    chains = sorted(body["chains"], key=lambda c: len(c["calls"]))
    assert [len(c["calls"]) for c in chains] == [1, agent_calls], [
        [x["call_id"] for x in c["calls"]] for c in chains
    ]
    assert sorted(c["num_calls"] for c in summary["chains"]) == [1, agent_calls]

    # every call carries exactly what the engine sampled for that prompt
    assert len(sent) == total, [len(s.prompt_token_ids) for s in sent]
    for chain in chains:
        for call in chain["calls"]:
            s = _sent_for(sent, call["prompt_token_ids"])
            assert call["generation_token_ids"] == s.generation_token_ids, call["call_id"]
            assert call["generation_log_probs"] == pytest.approx(s.generation_log_probs)
            assert call["status"] == "complete" and call["diagnostics"] == []
            assert call["stream"] is True  # OpenCode always streams
    check_engine_prompts(stack.prompt_mode, [c for ch in chains for c in ch["calls"]], sent)

    (title,) = chains[0]["calls"]
    assert title["parent_call_id"] is None
    assert chains[0]["chain_id"] == title["call_id"]
    title_detail = await _get(client, f"/captures/calls/{title['call_id']}")
    assert not title_detail["request_tools"], "the title request offers no tools"

    agent = chains[1]["calls"]
    assert chains[1]["chain_id"] == agent[0]["call_id"]
    assert agent[0]["parent_call_id"] is None
    for parent, child in zip(agent, agent[1:], strict=False):
        assert child["parent_call_id"] == parent["call_id"]
        head = parent["prompt_token_ids"] + parent["generation_token_ids"]
        assert child["prompt_token_ids"][: len(head)] == head, child["call_id"]
        assert len(child["prompt_token_ids"]) > len(head)  # tool result / user message between
        assert child["linking"]["verdict"] == "resolved", child["linking"]
    details = [await _get(client, f"/captures/calls/{c['call_id']}") for c in agent]
    for d in details:
        assert {t["function"]["name"] for t in d["request_tools"]} >= {"read", "bash"}
    return title_detail, details


def _tool_messages(call: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in call["request_messages"] if m["role"] == "tool"]


def _check_turn_tools(details: list[dict[str, Any]], first: int, notes: Path) -> None:
    """Calls ``first``..``first+2`` are one user turn: read, bash, answer (tools really ran)."""
    read_call, bash_call, answer_call = details[first : first + 3]
    before = len(_tool_messages(read_call))
    read_result = _tool_messages(bash_call)[before:]
    assert [m["content"] for m in read_result] == [_read_wrapper(notes, NOTES_LINES)]
    (read_tc,) = read_call["response_message"]["tool_calls"]
    assert read_result[0]["tool_call_id"] == read_tc["id"]
    assert read_tc["function"]["name"] == "read"

    ls_result = _tool_messages(answer_call)[before + 1 :]
    assert [m["content"] for m in ls_result] == [LS_OUTPUT]
    (bash_tc,) = bash_call["response_message"]["tool_calls"]
    assert ls_result[0]["tool_call_id"] == bash_tc["id"]
    assert bash_tc["function"]["name"] == "bash"
    assert not answer_call["response_message"].get("tool_calls")


@pytest.mark.parametrize("prompt_mode", PROMPT_MODES)
async def test_opencode_session_is_one_exact_chain(
    aiohttp_server, aiohttp_client, qwen_tokenizer, tmp_path: Path, prompt_mode: str
) -> None:
    policy = Policy.load(POLICY_PATH)
    stack = await start_stack(
        aiohttp_server,
        aiohttp_client,
        qwen_tokenizer,
        tmp_path,
        policy=policy,
        rollout=ROLLOUT,
        prompt_mode=prompt_mode,
    )
    client, base_url = stack.client, stack.base_url

    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    notes = (project / "notes.txt").resolve()
    notes.write_text("\n".join(NOTES_LINES) + "\n", encoding="utf-8")

    # turn 1: a new session (title request + read, bash, answer)
    t0 = time.monotonic()
    first = await _opencode(project, home, base_url, "Read notes.txt, then list the files.")
    assert policy.steps[-1].content in first.stdout, first.describe()
    title, details = await _check_rollout(stack, agent_calls=AGENT_CALLS_PER_TURN)
    assert title["response_message"]["content"] == policy.title
    _check_turn_tools(details, 0, notes)
    agent_chain = details[0]["call_id"]

    # turn 2: `run -c` continues the session: no title request, the chain grows by 3
    second = await _opencode(project, home, base_url, "Do it again, please.", continue_session=True)
    assert policy.steps[-1].content in second.stdout, second.describe()
    title2, details2 = await _check_rollout(stack, agent_calls=2 * AGENT_CALLS_PER_TURN)
    assert title2["call_id"] == title["call_id"], "a continued session sends no title request"
    assert details2[0]["call_id"] == agent_chain
    assert [d["call_id"] for d in details2[:3]] == [d["call_id"] for d in details]
    _check_turn_tools(details2, AGENT_CALLS_PER_TURN, notes)
    users = [m for m in details2[3]["request_messages"] if m["role"] == "user"]
    assert users[-1]["content"] == '"Do it again, please."'

    summary = await _get(client, f"/captures/rollouts/{ROLLOUT}")
    print(
        f"\nopencode e2e [{prompt_mode}]: {time.monotonic() - t0:.1f}s "
        f"(runs {first.duration_s:.1f}s + {second.duration_s:.1f}s); chains: "
        + "; ".join(f"{c['chain_id']} calls={c['num_calls']}" for c in summary["chains"])
    )
    for d in [title, *details2]:
        print(
            f"  {d['call_id']} parent={d['parent_call_id']} prompt={d['num_prompt_tokens']} "
            f"gen={d['num_generation_tokens']} finish={d['finish_reason']}"
        )
