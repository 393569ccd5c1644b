"""Exact-token mode answers per ``tool_choice`` as vLLM 0.32's chat completions do.

``tests/fixtures/parser_goldens/tool_choice/<serving>.json`` (``scripts/parser-goldens``, with
vLLM's own serving code: ``tests/support/vllm_tool_choice_oracle.py``) holds, for every
generated text of ``tests.support.parser_cases`` and every request shape of
``tests.support.tool_choice_cases.CHOICES`` (no tools, ``none``, ``auto``, ``required``, a
named function, ``parallel_tool_calls: false``), vLLM's non-streamed answer. For every family
the serving names:

- the parse for the request's tool choice (``families.tool_choice.choice_parser``) gives
  vLLM's content, reasoning and tool calls, and ``finish_reason`` vLLM's finish reason after
  the engine's ``stop``;
- the stream (the text in pieces of 1, 2, 3, 5 and 8 characters, and whole) gives the same;
- a case the proxy answers differently on purpose for ``auto`` (``deviation`` in
  ``parser_cases``) is checked against the proxy's own ``auto`` answer with the tool choice's
  rule applied, not vLLM's.

Compared as ``tests/families/test_parser_goldens.py`` compares (a missing and an empty content
alike; no tool-call ids).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.families import get_parser
from capture_proxy.families.parsing import ParsedMessage
from capture_proxy.families.tool_choice import choice_parser, finish_reason, tool_choice_of
from tests.families.test_parser_goldens import fed_in_pieces
from tests.support.parser_cases import SERVINGS, cases
from tests.support.tool_choice_cases import CHOICES

GOLDENS = Path(__file__).resolve().parents[1] / "fixtures" / "parser_goldens" / "tool_choice"
PIECES = (1, 2, 3, 5, 8, 0)


def _golden(serving: str) -> dict[str, Any]:
    return json.loads((GOLDENS / f"{serving}.json").read_text(encoding="utf-8"))


GOLDEN = {serving: _golden(serving) for serving in SERVINGS}
DEVIATIONS = {
    (serving, name) for serving, by in cases().items() for name, c in by.items() if "deviation" in c
}
CASES = [
    (serving, family, name, choice)
    for serving, golden in GOLDEN.items()
    for family in golden["families"]
    for name in golden["cases"]
    for choice in CHOICES
]


def _body(choice: str, tools: Any) -> dict[str, Any]:
    fields = dict(CHOICES[choice])
    if fields.pop("tools", None):
        fields["tools"] = tools
    return fields


def _answer(content: Any, reasoning: Any, calls: list[dict[str, Any]], finish: Any) -> dict:
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "tool_calls": calls,
        "finish_reason": finish,
    }


def _vllm(answer: dict[str, Any]) -> dict[str, Any]:
    return _answer(
        answer["content"], answer["reasoning"], answer["tool_calls"], answer["finish_reason"]
    )


def _proxy(msg: ParsedMessage, body: dict[str, Any]) -> dict[str, Any]:
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in msg.tool_calls
    ]
    finish = finish_reason(tool_choice_of(body), "stop", bool(calls))
    return _answer(msg.content, msg.reasoning, calls, finish)


def _parse(family: str, case: dict[str, Any], body: dict[str, Any]) -> ParsedMessage:
    parser = choice_parser(get_parser(family), tool_choice_of(body))
    return parser.parse(
        case["text"], "seed", tools=body.get("tools"), in_reasoning=case["in_reasoning"]
    )


def _stream(family: str, case: dict[str, Any], body: dict[str, Any], size: int) -> ParsedMessage:
    parser = choice_parser(get_parser(family), tool_choice_of(body))
    stream = parser.stream("seed", body.get("tools"), in_reasoning=case["in_reasoning"])
    return fed_in_pieces(stream, case["text"], size)


@pytest.mark.parametrize(("serving", "family", "name", "choice"), CASES)
def test_answer_per_tool_choice_is_vllms(serving: str, family: str, name: str, choice: str):
    golden = GOLDEN[serving]
    case = golden["cases"][name]
    body = _body(choice, golden["tools"])
    got = _proxy(_parse(family, case, body), body)
    if (serving, name) in DEVIATIONS:
        # the proxy's own auto answer for this text (docs/families.md), with the tool
        # choice's rule: the same reasoning; beside tools the same message, one call when
        # parallel calls are off
        auto = _proxy(_parse(family, case, _body("auto", golden["tools"])), body)
        assert got["reasoning"] == auto["reasoning"]
        if choice.startswith(("auto", "required", "named")):
            single = CHOICES[choice].get("parallel_tool_calls") is False
            assert got["tool_calls"] == auto["tool_calls"][: 1 if single else None]
            assert got["content"] == auto["content"] or not (auto["content"] or "").strip()
        return
    assert got == _vllm(case["answers"][choice]["whole"])


@pytest.mark.parametrize(("serving", "family", "name", "choice"), CASES)
def test_stream_per_tool_choice_is_the_whole_answer(
    serving: str, family: str, name: str, choice: str
):
    golden = GOLDEN[serving]
    case = golden["cases"][name]
    body = _body(choice, golden["tools"])
    whole = _proxy(_parse(family, case, body), body)
    for size in PIECES:
        assert _proxy(_stream(family, case, body, size), body) == whole, size


def test_none_drops_the_calls_of_a_parser_without_a_call_free_stream():
    class _Calls:
        family = "x"

        def stream(self, id_seed: str, tools: Any = None, *, in_reasoning: bool = False) -> Any:
            return get_parser("qwen2_5").stream(id_seed, tools)

    body = {"tools": GOLDEN["hermes"]["tools"], "tool_choice": "none"}
    text = 'Hi.\n<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>'
    msg = choice_parser(_Calls(), tool_choice_of(body)).parse(text, "seed")  # type: ignore[arg-type]
    assert (msg.content, msg.tool_calls) == ("Hi.\n", [])
