"""Issue 21, gpt-oss: the gpt_oss family's harmony renders against vLLM's own harmony path.

vLLM 0.32 renders gpt-oss with openai-harmony, not with the jinja template: the golden
(``goldens/gpt_oss.json``) is what ``tests/support/vllm_oracle.py`` gets from vLLM's chat path
for a ``gpt_oss`` model, in process (``build_harmony_preamble``,
``parse_chat_inputs_to_harmony_messages``, ``render_for_completion``, with vLLM's oss-harmony
0.0.11), the o200k vocabulary from quicktok-v1 (no download) and the date pinned with
``VLLM_SYSTEM_START_DATE=2026-01-01``.

The family does not render what vLLM renders yet. These tests pin exactly how it differs, so
that any other difference fails: with these five rewrites of the family's text, every
first-call prompt (56 cases) and every tail after a continued turn (38) is vLLM's, character
for character (the counts of cases each rewrite is needed for are asserted too):

- ``date``: vLLM's system message has ``Current date: <day>`` (the server's local date, or
  ``VLLM_SYSTEM_START_DATE``); the family renders none;
- ``json``: vLLM renders a history tool call as ``commentary json``; the family as
  ``commentary <|constrain|>json`` (what gpt-oss itself writes);
- ``tool_header``: a tool result's header is ``functions.N<|channel|>commentary to=assistant``
  in oss-harmony 0.0.11 (vLLM's), ``functions.N to=assistant<|channel|>commentary`` in the
  openai-harmony 0.0.8 the family renders with;
- ``order``: on a tool-call turn with content and reasoning vLLM renders the content
  (commentary) before the reasoning (analysis); the family after;
- ``developer``: a system or developer message after the first becomes a developer message
  with a ``# Instructions`` section in vLLM; the family renders its bare text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.base import ModelFamily
from capture_proxy.families.hf_template import tail_context
from tests.support.golden_cases import cases

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "goldens"
CASES = {c["name"]: c for c in cases()}
DATE = "2026-01-01"
_ANALYSIS = r"<\|start\|>assistant<\|channel\|>analysis<\|message\|>((?:(?!<\|end\|>).)*)<\|end\|>"
_COMMENTARY = (
    r"<\|start\|>assistant<\|channel\|>commentary<\|message\|>((?:(?!<\|end\|>).)*)<\|end\|>"
)
_TOOL_HEADER = r"<\|start\|>functions\.([^ <]*) to=assistant<\|channel\|>commentary<\|message\|>"
_DEVELOPER = "<|start|>developer<|message|>"


def vllm_form(text: str) -> tuple[str, set[str]]:
    """The family's render text rewritten as vLLM renders it, and the rewrites it needed."""
    used: set[str] = set()

    def sub(rule: str, new: str) -> None:
        nonlocal text
        if new != text:
            used.add(rule)
            text = new

    cutoff = "Knowledge cutoff: 2024-06\n"
    sub("date", text.replace(cutoff, f"{cutoff}Current date: {DATE}\n", 1))
    sub(
        "json",
        text.replace("commentary <|constrain|>json<|message|>", "commentary json<|message|>"),
    )
    sub(
        "tool_header",
        re.sub(
            _TOOL_HEADER,
            r"<|start|>functions.\1<|channel|>commentary to=assistant<|message|>",
            text,
        ),
    )
    swapped = (
        r"<|start|>assistant<|channel|>commentary<|message|>\2<|end|>"
        r"<|start|>assistant<|channel|>analysis<|message|>\1<|end|>"
    )
    sub("order", re.sub(_ANALYSIS + _COMMENTARY, swapped, text, flags=re.S))
    head, sep, rest = text.partition(_DEVELOPER)
    sub("developer", head + sep + rest.replace(_DEVELOPER, f"{_DEVELOPER}# Instructions\n\n"))
    return text, used


@pytest.fixture(scope="module")
def family() -> ModelFamily:
    return load_family("gpt_oss")


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((GOLDEN / "gpt_oss.json").read_text(encoding="utf-8"))


def test_golden_is_vllms_harmony_path_for_every_case(golden):
    assert golden["vllm_version"] == "0.32.0"
    assert golden["renderer"] == "vLLM's harmony path (oss-harmony 0.0.11)"
    assert golden["start_date"] == DATE
    assert golden["end_of_turn_token"] == ["<|end|>", "<|call|>", "<|return|>"]
    assert set(golden["cases"]) == set(CASES)
    assert [k for k, g in golden["cases"].items() if "error" in g] == []


def test_first_call_prompt_is_vllms_but_for_five_named_differences(family, golden):
    rules: Counter[str] = Counter()
    for name, case in CASES.items():
        want = golden["cases"][name]
        ids = family.renderer.render_sync(
            case["messages"], case["tools"], add_generation_prompt=True
        )
        assert ids != want.get("prompt_token_ids"), name  # the date, at least
        text, used = vllm_form(family.renderer.decode(ids))
        assert hashlib.sha256(text.encode()).hexdigest() == want["prompt_text_sha256"], name
        if "prompt_token_ids" in want:
            assert text == family.renderer.decode(want["prompt_token_ids"]), name
        rules.update(used)
    assert dict(rules) == {"date": 56, "json": 38, "tool_header": 38, "order": 15, "developer": 16}


def test_tail_is_vllms_but_for_the_tool_result_header(family, golden):
    rules: Counter[str] = Counter()
    checked = 0
    for name, case in CASES.items():
        j, msgs = case["turn_index"], case["messages"]
        if j is None or j == len(msgs) - 1:
            continue
        tail = family.renderer.render_tail_sync(
            tail_context(msgs, j), msgs[j + 1 :], case["tools"], end_of_turn_text="<|end|>"
        )
        assert tail is not None, name
        text, used = vllm_form(family.renderer.decode(tail))
        assert text == family.renderer.decode(golden["cases"][name]["tail_token_ids"]), name
        rules.update(used)
        checked += 1
    assert checked == 38
    # a tail holds no history tool call (the continued turn is the model's own tokens)
    assert dict(rules) == {"tool_header": 33}
