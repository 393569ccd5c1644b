"""Issue 21, gpt-oss: the gpt_oss family renders what vLLM's own harmony path renders.

vLLM 0.32 renders gpt-oss with harmony, not with the jinja template: the golden
(``goldens/gpt_oss.json``) is what ``tests/support/vllm_oracle.py`` gets from vLLM's chat path
for a ``gpt_oss`` model, in process (``build_harmony_preamble``,
``parse_chat_inputs_to_harmony_messages``, ``render_for_completion``, with vLLM's oss-harmony
0.0.11), the o200k vocabulary from quicktok-v1 (no download) and the date pinned with
``VLLM_SYSTEM_START_DATE=2026-01-01`` (the family's ``system_start_date``).

Every first-call prompt (56 cases) is vLLM's, id for id (or by the sha256 of its text where
the golden keeps only that), and every tail after a continued turn (38) is vLLM's ids after
the parent's turn. Where the family once differed (each now rendered as vLLM does): the
``Current date:``; a history tool call in ``commentary json``; the tool result's header
``functions.N<|channel|>commentary to=assistant``; on a tool-call turn the content before the
reasoning; a later system or developer message as a developer message with ``# Instructions``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from capture_proxy.families import load_family
from capture_proxy.families.base import ModelFamily
from capture_proxy.families.gpt_oss import HarmonyRenderer, load_gpt_oss_encoding
from capture_proxy.families.hf_template import tail_context
from tests.support.golden_cases import cases

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "goldens"
CASES = {c["name"]: c for c in cases()}
DATE = "2026-01-01"
#: cases whose golden keeps the prompt's text sha256 only (no ids)
BY_SHA = 39


@pytest.fixture(scope="module")
def family() -> ModelFamily:
    return load_family("gpt_oss", system_start_date=DATE)


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


def test_first_call_prompt_is_vllms_for_every_case(family, golden):
    by_ids = by_sha = 0
    for name, case in CASES.items():
        want = golden["cases"][name]
        ids = family.renderer.render_sync(
            case["messages"], case["tools"], add_generation_prompt=True
        )
        text = family.renderer.decode(ids)
        assert hashlib.sha256(text.encode()).hexdigest() == want["prompt_text_sha256"], name
        if "prompt_token_ids" in want:
            assert ids == want["prompt_token_ids"], name
            by_ids += 1
        else:
            by_sha += 1
    assert (by_ids + by_sha, by_sha) == (56, BY_SHA)


def test_tail_is_vllms_text_after_the_parents_turn(family, golden):
    checked = 0
    for name, case in CASES.items():
        j, msgs = case["turn_index"], case["messages"]
        if j is None or j == len(msgs) - 1:
            continue
        tail = family.renderer.render_tail_sync(
            tail_context(msgs, j), msgs[j + 1 :], case["tools"], end_of_turn_text="<|end|>"
        )
        assert tail is not None, name
        assert tail == golden["cases"][name]["tail_token_ids"], name
        checked += 1
    assert checked == 38


def test_start_date_unset_is_todays_at_each_render():
    days = iter(["2026-03-04", "2026-03-05"])
    renderer = HarmonyRenderer(load_gpt_oss_encoding(), today=lambda: next(days))
    msgs = [{"role": "user", "content": "hi"}]
    first, second = (
        renderer.decode(renderer.render_sync(msgs, None, add_generation_prompt=True))
        for _ in range(2)
    )
    assert "\nCurrent date: 2026-03-04\n" in first
    assert "\nCurrent date: 2026-03-05\n" in second
