"""Policy file format and step choice (pure, no event loop)."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from capture_proxy.scripted_engine.policy import Policy, Step, step_index, tool_call_id
from harness_notes.opencode import STEP_LIMIT_NOTE_TEXT

POLICY = Policy.model_validate(
    {
        "title": "T",
        "steps": [
            {"content": "a", "tool_calls": [{"name": "read", "arguments": {"p": "é", "n": 1}}]},
            {"reasoning": "r", "tool_calls": [{"name": "x", "arguments_raw": '{ "k" : 1 }'}]},
            {"content": "done"},
        ],
        "final": "F",
    }
)
U = {"role": "user", "content": "go"}
A = {"role": "assistant", "content": ""}
T = {"role": "tool", "content": "r"}


def test_step_index_counts_assistants_after_last_user():
    assert step_index([U]) == 0
    assert step_index([U, A, T, A, T]) == 2
    assert step_index([U, A, T, A, T, U]) == 0
    assert step_index([{"role": "system", "content": "s"}, A]) == 1


def test_choose_walks_steps_then_final_and_title_without_tools():
    assert POLICY.choose([U], True).content == "a"
    assert POLICY.choose([U, A, T], True).reasoning == "r"
    assert POLICY.choose([U, A, T, A, T], True).content == "done"
    assert POLICY.choose([U, A, T, A, T, A, T], True).content == "F"
    assert POLICY.choose([U, A, T, A, T, A, U, A], True).reasoning == "r"
    assert POLICY.choose([U, A, T], False) == Step(content="T")


def test_arguments_are_hermes_json_or_raw():
    # json.dumps defaults, as Hermes-format models write and the template's tojson re-renders.
    msg = POLICY.steps[0].assistant_message("seed")
    assert msg["tool_calls"][0]["function"] == {"name": "read", "arguments": '{"p": "é", "n": 1}'}
    raw = POLICY.steps[1].assistant_message("seed")
    assert raw["tool_calls"][0]["function"]["arguments"] == '{ "k" : 1 }'
    assert raw["reasoning_content"] == "r" and raw["content"] == ""


def test_tool_call_ids_are_deterministic_and_openai_like():
    a = POLICY.steps[0].assistant_message("seed")["tool_calls"][0]["id"]
    assert a == POLICY.steps[0].assistant_message("seed")["tool_calls"][0]["id"]
    assert a != POLICY.steps[0].assistant_message("other")["tool_calls"][0]["id"]
    assert a.startswith("call_") and len(a) == 29
    assert tool_call_id("s", 0) != tool_call_id("s", 1)


def test_default_policy_and_file_loading(tmp_path):
    default = Policy.default()
    assert [bool(s.tool_calls) for s in default.steps] == [True, True, False]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"steps": [{"content": "hi"}]}))
    assert Policy.load(path).steps[0].content == "hi"


def test_unknown_fields_are_refused():
    with pytest.raises(ValidationError):
        Policy.model_validate({"steps": [{"contents": "typo"}]})


RULED = Policy.model_validate(
    {
        "steps": [{"tool_calls": [{"name": "read", "arguments": {"filePath": "n"}}]}] * 3,
        "rules": [
            {"when_last_message_contains": "MAXIMUM STEPS", "step": {"content": "stopping"}},
            {"when_last_message_contains": "STEPS", "step": {"content": "never: first wins"}},
            {"when_last_message_contains": "ping", "step": {"content": "pong"}},
        ],
    }
)
NOTE = {"role": "user", "content": "CRITICAL - MAXIMUM STEPS REACHED\n\nRespond with text only."}


def test_rules_match_the_last_message_in_order_before_step_selection():
    # the note forwarded as a user message: without the rule, step 0 (a tool call) again
    assert RULED.choose([U, A, T, A, T, NOTE], True) == Step(content="stopping")
    assert RULED.choose([U, A, T, A, T, {**NOTE, "role": "assistant"}], True).content == (
        "stopping"
    )
    assert RULED.choose([U, A, T, A, T], True).tool_calls  # no match: step selection
    assert RULED.choose([NOTE, A, T], True).tool_calls  # only the LAST message counts
    parts = {
        "role": "tool",
        "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "ping"}],
    }
    assert RULED.choose([U, A, parts], True).content == "pong"  # any role, text parts joined
    assert RULED.choose([U, {"role": "assistant", "content": None}], True).tool_calls
    assert RULED.choose([NOTE], False).content == "stopping"  # rules come before the title
    assert RULED.choose([], True).tool_calls
    with pytest.raises(ValidationError):
        Policy.model_validate({"rules": [{"when_last_message_contains": "", "step": {}}]})


def test_opencode_step_limit_policy_obeys_the_note():
    root = Path(__file__).resolve().parents[2]
    policy = Policy.load(root / "capture_proxy" / "policies" / "opencode_step_limit.json")
    assert all(s.tool_calls for s in policy.steps)
    note = {"role": "user", "content": STEP_LIMIT_NOTE_TEXT}
    answer = policy.choose([U, A, T, A, T, note], True)
    assert answer.content and not answer.tool_calls


def test_rules_on_the_first_and_last_user_message():
    policy = Policy.model_validate(
        {
            "steps": [{"content": "step 0"}],
            "rules": [
                {"when_first_user_message_contains": "count lines", "step": {"content": "sub"}},
                {"when_last_user_message_contains": "say hello", "step": {"content": "Hello."}},
            ],
        }
    )
    sub = [
        {"role": "system", "content": "x"},
        {"role": "user", "content": [{"type": "text", "text": "Please count lines."}]},
        {"role": "system", "content": "deferred tools"},
    ]
    assert policy.choose(sub, has_tools=True).content == "sub"
    later = [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "now say hello"},
        {"role": "system", "content": "deferred tools"},
    ]
    assert policy.choose(later, has_tools=True).content == "Hello."
    assert policy.choose([{"role": "user", "content": "task"}], has_tools=True).content == "step 0"
    assert policy.choose([{"role": "system", "content": "x"}], has_tools=True).content == "step 0"


@pytest.mark.parametrize(
    "conditions",
    [{}, {"when_last_message_contains": "a", "when_first_user_message_contains": "b"}],
)
def test_a_rule_has_exactly_one_condition(conditions):
    with pytest.raises(ValueError, match="exactly one of"):
        Policy.model_validate({"rules": [{**conditions, "step": {"content": "x"}}]})
