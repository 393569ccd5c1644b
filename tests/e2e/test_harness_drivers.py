"""The real Codex CLI and Claude Code run a multi-step tool session against the fake server.

Not through the proxy (its Responses/Messages capture is not built yet): the recording fake
server of tests/support/fake_harness_server.py answers the harness's own API on a loopback
port. Each driver runs one bounded, non-interactive session in a scratch project holding
``notes.txt``; the test checks the sequence of calls the server saw, that the harness really
ran each tool (its output comes back in the next request, the file changed on disk) and that
the final answer is printed. Also: the scripted-engine policies for both harnesses run as
scripted sessions; one failed call is retried; and (with strace) every connection either
harness opens goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.harnesses._process import HarnessResult
from capture_proxy.harnesses.claude_code import find_claude, run_claude
from capture_proxy.harnesses.codex import find_codex, run_codex
from capture_proxy.scripted_engine.policy import Policy
from tests.support.fake_harness_server import (
    CLAUDE_FINAL,
    CODEX_FINAL,
    NOTES_TEXT,
    FakeHarnessServer,
    FakeServerConfig,
    Step,
    ToolCall,
    claude_tool_session,
    codex_tool_session,
    running,
)

CODEX = find_codex()
CLAUDE = find_claude()
ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 90  # a session takes ~1-5 s; a hang fails the test instead of blocking it

needs_codex = [
    pytest.mark.codex,
    pytest.mark.skipif(CODEX is None, reason="Codex CLI not installed (scripts/install-harnesses)"),
]
needs_claude = [
    pytest.mark.claude_code,
    pytest.mark.skipif(
        CLAUDE is None, reason="Claude Code not installed (scripts/install-harnesses)"
    ),
]
pytestmark = [pytest.mark.timeout(300)]

DONE_TEXT = NOTES_TEXT.replace("TODO: count the files", "DONE: counted the files")


def make_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text(NOTES_TEXT, encoding="utf-8")
    return project


async def codex_session(
    tmp_path: Path, config: FakeServerConfig, binary: Path | str | None = None
) -> tuple[HarnessResult, FakeHarnessServer, Path]:
    project = make_project(tmp_path)
    async with running(config) as server:
        result = await asyncio.to_thread(
            run_codex,
            binary or CODEX,
            server.root_url + "/v1",
            project,
            "Do the task.",
            timeout_s=RUN_TIMEOUT_S,
            home_dir=tmp_path / "home",
        )
    return result, server, project


async def claude_session(
    tmp_path: Path, steps: Any, binary: Path | str | None = None, **server_kw: Any
) -> tuple[HarnessResult, FakeHarnessServer, Path]:
    project = make_project(tmp_path)
    config = FakeServerConfig(
        claude_steps=steps(project) if callable(steps) else steps, **server_kw
    )
    async with running(config) as server:
        result = await asyncio.to_thread(
            run_claude,
            binary or CLAUDE,
            server.root_url,
            project,
            "Do the task.",
            timeout_s=RUN_TIMEOUT_S,
            home_dir=tmp_path / "home",
        )
    return result, server, project


def codex_outputs(body: dict[str, Any]) -> dict[str, str]:
    """call_id -> tool output text, from a Responses ``input``."""
    return {
        it["call_id"]: it["output"] if isinstance(it["output"], str) else json.dumps(it["output"])
        for it in body["input"]
        if it.get("type") in ("function_call_output", "custom_tool_call_output")
    }


def last_tool_result(body: dict[str, Any]) -> str:
    """The text of the last ``tool_result`` block of an Anthropic request."""
    block = [b for b in body["messages"][-1]["content"] if b.get("type") == "tool_result"][-1]
    content = block["content"]
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content)
    return str(content)


# --- Codex ----------------------------------------------------------------------------------
@pytest.mark.codex
@pytest.mark.skipif(CODEX is None, reason="Codex CLI not installed (scripts/install-harnesses)")
async def test_codex_runs_a_tool_session(tmp_path: Path):
    result, server, project = await codex_session(
        tmp_path, FakeServerConfig(codex_steps=codex_tool_session())
    )
    assert result.ok, result.describe()
    lines = server.lines()
    assert [(x["method"], x["path"]) for x in lines] == [("POST", "/v1/responses")] * 4
    assert [x["classification"] for x in lines] == [
        "agent-tool(step=0)",
        "agent-tool(step=1)",
        "agent-tool(step=2)",
        "agent-final(step=3)",
    ]
    assert all(x["body"]["stream"] is True for x in lines)
    # each request extends the previous one's input: nothing rewritten, nothing dropped
    for prev, cur in zip(lines, lines[1:], strict=False):
        assert cur["body"]["input"][: len(prev["body"]["input"])] == prev["body"]["input"]
    ls_out = list(codex_outputs(lines[1]["body"]).values())
    assert len(ls_out) == 1 and re.search(r"^notes\.txt$", ls_out[0], re.M), ls_out
    patch_out = [it for it in lines[2]["body"]["input"] if it["type"] == "custom_tool_call_output"]
    assert len(patch_out) == 1 and "Success" in patch_out[0]["output"], patch_out
    cat_out = list(codex_outputs(lines[3]["body"]).values())[-1]
    assert DONE_TEXT.strip() in cat_out, cat_out
    assert (project / "notes.txt").read_text(encoding="utf-8") == DONE_TEXT
    assert CODEX_FINAL in result.stdout


@pytest.mark.codex
@pytest.mark.skipif(CODEX is None, reason="Codex CLI not installed (scripts/install-harnesses)")
async def test_codex_policy_runs(tmp_path: Path):
    steps = policy_steps("codex")
    result, server, _ = await codex_session(tmp_path, FakeServerConfig(codex_steps=steps))
    assert result.ok, result.describe()
    lines = server.lines()
    assert len(lines) == len(steps)
    outputs = [list(codex_outputs(x["body"]).values()) for x in lines[1:]]
    assert "notes.txt" in outputs[0][-1] and "alpha é ✓" in outputs[1][-1], outputs
    assert steps[-1].text in result.stdout


@pytest.mark.codex
@pytest.mark.skipif(CODEX is None, reason="Codex CLI not installed (scripts/install-harnesses)")
async def test_codex_retries_a_500_then_completes(tmp_path: Path):
    config = FakeServerConfig(codex_steps=[Step(text="Fine.")], fail_first=1)
    result, server, _ = await codex_session(tmp_path, config)
    assert result.ok, result.describe()
    assert [x["status"] for x in server.lines()] == [500, 200]
    assert server.lines()[0]["body_raw"] == server.lines()[1]["body_raw"]


# --- Claude Code ----------------------------------------------------------------------------
@pytest.mark.claude_code
@pytest.mark.skipif(CLAUDE is None, reason="Claude Code not installed (scripts/install-harnesses)")
async def test_claude_code_runs_a_tool_session(tmp_path: Path):
    result, server, project = await claude_session(tmp_path, claude_tool_session)
    assert result.ok, result.describe()
    lines = server.lines()
    assert [(x["method"], x["path"], x["query"]) for x in lines] == [
        ("POST", "/v1/messages", "beta=true")
    ] * 4
    assert [x["classification"] for x in lines] == [
        "agent-tool(step=0)",
        "agent-tool(step=1)",
        "agent-tool(step=2)",
        "agent-final(step=3)",
    ]
    bodies = [x["body"] for x in lines]
    assert all(b["stream"] is True for b in bodies)
    assert re.search(r"^notes\.txt$", last_tool_result(bodies[1]), re.M)
    assert "alpha é ✓" in last_tool_result(bodies[2])
    assert "updated successfully" in last_tool_result(bodies[3])
    # the model's turns come back as sent: thinking (with signature), text, tool_use
    first_turn = [m for m in bodies[1]["messages"] if m["role"] == "assistant"][0]["content"]
    assert [b["type"] for b in first_turn] == ["thinking", "text", "tool_use"]
    assert first_turn[0]["signature"].startswith("FakeSig")
    assert (project / "notes.txt").read_text(encoding="utf-8") == DONE_TEXT
    assert CLAUDE_FINAL in result.stdout


@pytest.mark.claude_code
@pytest.mark.skipif(CLAUDE is None, reason="Claude Code not installed (scripts/install-harnesses)")
async def test_claude_code_policy_runs(tmp_path: Path):
    steps = policy_steps("claude_code")
    result, server, project = await claude_session(tmp_path, steps)
    assert result.ok, result.describe()
    bodies = [x["body"] for x in server.lines()]
    assert len(bodies) == len(steps)
    assert "notes.txt" in last_tool_result(bodies[1])
    assert "alpha é ✓" in last_tool_result(bodies[2])
    assert (project / "notes.txt").read_text(encoding="utf-8") == DONE_TEXT
    assert steps[-1].text in result.stdout


@pytest.mark.claude_code
@pytest.mark.skipif(CLAUDE is None, reason="Claude Code not installed (scripts/install-harnesses)")
async def test_claude_code_retries_a_500_then_completes(tmp_path: Path):
    result, server, _ = await claude_session(tmp_path, [Step(text="Fine.")], fail_first=1)
    assert result.ok, result.describe()
    assert [x["status"] for x in server.lines()] == [500, 200]


# --- offline: every connect() goes to loopback ------------------------------------------------
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
@pytest.mark.parametrize(
    "harness",
    [
        pytest.param("codex", marks=needs_codex),
        pytest.param("claude_code", marks=needs_claude),
    ],
)
async def test_harness_connects_only_to_loopback(tmp_path: Path, harness: str):
    trace = tmp_path / "connect.trace"
    real = CODEX if harness == "codex" else CLAUDE
    wrapper = tmp_path / "traced"
    wrapper.write_text(
        f'#!/bin/sh\nexec strace -f -qq -e trace=connect -o "{trace}" "{real}" "$@"\n'
    )
    wrapper.chmod(0o755)
    if harness == "codex":
        result, server, _ = await codex_session(
            tmp_path, FakeServerConfig(codex_steps=codex_tool_session()), binary=wrapper
        )
    else:
        result, server, _ = await claude_session(tmp_path, claude_tool_session, binary=wrapper)
    assert result.ok, result.describe()
    inet = [
        line
        for line in trace.read_text().splitlines()
        if "connect(" in line and ("AF_INET" in line or "AF_INET6" in line)
    ]
    assert inet, "no TCP connection traced"
    outside = [
        line for line in inet if f"htons({server.port})" not in line or "127.0.0.1" not in line
    ]
    assert not outside, "connections beyond the fake server:\n" + "\n".join(outside)


def policy_steps(harness: str) -> list[Step]:
    """The scripted-engine policy of a harness as fake-server steps (same tools, same
    arguments), so the real harness proves it accepts and executes them."""
    policy = Policy.load(ROOT / "capture_proxy" / "policies" / f"{harness}.json")
    return [
        Step(
            text=s.content,
            reasoning=s.reasoning,
            tool_calls=tuple(
                ToolCall(c.name, c.arguments_raw or c.arguments) for c in s.tool_calls
            ),
        )
        for s in policy.steps
    ]
