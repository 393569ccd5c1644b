"""The Codex and Claude Code policies load and call only tools the real harness offers.

The offered tools come from the recorded sessions in tests/fixtures (the first request's
``tools``): each scripted call names an offered tool and passes every required parameter, and
no parameter the schema lacks. A freeform (``custom``) tool, Codex's ``apply_patch``, reaches
the engine as a function of one string parameter, ``input`` (tests/e2e/test_codex_e2e.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.scripted_engine.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "capture_proxy" / "policies"
FIXTURES = ROOT / "tests" / "fixtures"


def offered_schemas(harness: str) -> dict[str, dict[str, Any]]:
    """Tool name -> JSON schema of the parameters, from the recording's first request."""
    first = json.loads((FIXTURES / harness / "01_tool_session.jsonl").read_text().splitlines()[0])
    tools = first["body"]["tools"]
    if harness == "codex":  # Responses API: {"type": "function", "name", "parameters"}
        freeform = {"properties": {"input": {"type": "string"}}, "required": ["input"]}
        schemas = {t["name"]: t["parameters"] for t in tools if t.get("type") == "function"}
        return schemas | {t["name"]: freeform for t in tools if t.get("type") == "custom"}
    return {t["name"]: t["input_schema"] for t in tools}  # Anthropic: {"name", "input_schema"}


@pytest.mark.parametrize("harness", ["codex", "claude_code"])
def test_policy_calls_tools_the_harness_offers(harness: str):
    policy = Policy.load(POLICIES / f"{harness}.json")
    schemas = offered_schemas(harness)
    calls = [c for step in policy.steps for c in step.tool_calls]
    assert calls, "the policy makes no tool call"
    assert policy.steps[-1].tool_calls == [] and policy.steps[-1].content, "ends with an answer"
    for call in calls:
        assert call.name in schemas, f"{call.name} not offered; offered: {sorted(schemas)}"
        schema = schemas[call.name]
        args = json.loads(call.arguments_text())
        missing = set(schema.get("required", [])) - set(args)
        assert not missing, f"{call.name} lacks required {missing}"
        unknown = set(args) - set(schema.get("properties", {}))
        assert not unknown, f"{call.name} has parameters the schema lacks: {unknown}"


def test_policies_use_the_shell_and_a_file_read():
    codex = [c.name for s in Policy.load(POLICIES / "codex.json").steps for c in s.tool_calls]
    claude = [
        c.name for s in Policy.load(POLICIES / "claude_code.json").steps for c in s.tool_calls
    ]
    assert codex == ["exec_command", "exec_command", "apply_patch"]
    assert claude == ["Bash", "Read", "Edit"]
