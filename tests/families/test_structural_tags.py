"""Exact-token mode constrains a generation as vLLM 0.32's chat completions do.

``tests/fixtures/parser_goldens/tool_choice/constraints.json`` (``scripts/parser-goldens``,
vLLM's own ``Parser.adjust_request``: ``tests/support/vllm_tool_choice_oracle.py``) holds the
``structured_outputs`` vLLM puts on the engine request for each serving, tool list and request
shape; ``families.structural_tags.tool_constraint`` must give the same, the structural tag's
JSON text byte for byte (None where vLLM sends no constraint).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.families import get_parser
from capture_proxy.families.structural_tags import ToolConstraintError, tool_constraint
from capture_proxy.families.tool_choice import tool_choice_of
from tests.support.tool_choice_cases import CHOICES

GOLDEN = json.loads(
    (
        Path(__file__).resolve().parents[1]
        / "fixtures"
        / "parser_goldens"
        / "tool_choice"
        / "constraints.json"
    ).read_text(encoding="utf-8")
)
SERVING_FAMILY = {"hermes": "qwen2_5", "hermes_qwen3": "qwen3", "qwen3_coder": "qwen3_coder"}
SERVING_FAMILY["llama3_json"] = "llama3"
CASES = [
    (serving, tools, choice)
    for serving, by_tools in GOLDEN["servings"].items()
    for tools, by_choice in by_tools.items()
    for choice in by_choice
]


def _body(choice: str, tools: Any) -> dict[str, Any]:
    fields = dict(CHOICES[choice])
    fields.pop("tools")
    return {**fields, "tools": tools}


@pytest.mark.parametrize(("serving", "tools", "choice"), CASES)
def test_constraint_is_vllms(serving: str, tools: str, choice: str):
    body = _body(choice, GOLDEN["tools"][tools])
    fmt = get_parser(SERVING_FAMILY[serving]).tool_call_format  # type: ignore[attr-defined]
    got = tool_constraint(fmt, body["tools"], tool_choice_of(body), body)
    assert got == GOLDEN["servings"][serving][tools][choice]


def test_goldens_cover_every_format_and_shape():
    assert set(SERVING_FAMILY) == set(GOLDEN["servings"])
    constrained = {
        choice
        for by_tools in GOLDEN["servings"].values()
        for by_choice in by_tools.values()
        for choice, so in by_choice.items()
        if so is not None
    }
    # required, named and a single call always; auto only with a strict tool or one call
    assert {"required", "named", "auto", "auto_single", "required_single"} <= constrained


def test_no_tools_or_none_is_unconstrained():
    tools = GOLDEN["tools"]["agent"]
    for body in ({}, {"tools": tools, "tool_choice": "none"}):
        assert tool_constraint("hermes", body.get("tools"), tool_choice_of(body), body) is None


def test_a_family_without_a_tag_refuses_required_naming_tool_choice():
    body = {"tools": GOLDEN["tools"]["agent"], "tool_choice": "required"}
    with pytest.raises(ToolConstraintError) as err:
        tool_constraint(None, body["tools"], tool_choice_of(body), body)
    assert err.value.param == "tool_choice"


def test_auto_constraint_beside_own_structured_output_is_refused():
    body = {
        "tools": GOLDEN["tools"]["strict_bash"],
        "tool_choice": "auto",
        "response_format": {"type": "json_object"},
    }
    with pytest.raises(ToolConstraintError) as err:
        tool_constraint("hermes", body["tools"], tool_choice_of(body), body)
    assert err.value.param == "response_format"


def test_required_replaces_own_structured_output():
    body = {
        "tools": GOLDEN["tools"]["agent"],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    got = tool_constraint("hermes", body["tools"], tool_choice_of(body), body)
    assert got == GOLDEN["servings"]["hermes"]["agent"]["required"]
