"""Exact-token mode's output parsers give the answer vLLM 0.32's own parsers give.

``tests/fixtures/parser_goldens/<serving>.json`` (written by ``scripts/parser-goldens`` with
vLLM's parser objects, ``tests/support/vllm_parser_oracle.py``) holds, per generated text of
``tests.support.parser_cases``, what vLLM's chat serving answers when started with that
family's tool-call (and reasoning) parser. For every family the serving names:

- the whole parse (``parse``, the non-streamed answer) equals vLLM's non-streamed answer;
- the stream (``stream``: the text fed in pieces of 1, 2, 3, 5 and 8 characters and whole, as
  the proxy's stream path feeds engine pieces, deltas joined as a client joins them) equals the
  whole parse, so the stored response is what a streaming harness received;
- a case marked as a deviation has the proxy's documented answer instead, and vLLM's differs
  (the deviation is real; docs/families.md says why).

Compared: content (a missing and an empty content alike: whether an empty content is ``null``
or ``""`` is the answer's shape, not the parse), reasoning, and each tool call's name and
exact arguments text. Tool-call ids are not (vLLM's are random).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.families import get_parser
from capture_proxy.families.parsing import ParsedMessage, StreamParser, apply_deltas
from tests.support.parser_cases import SERVINGS, cases

GOLDENS = Path(__file__).resolve().parents[1] / "fixtures" / "parser_goldens"
PIECES = (1, 2, 3, 5, 8, 0)  # 0: the whole text at once


def _golden(serving: str) -> dict[str, Any]:
    return json.loads((GOLDENS / f"{serving}.json").read_text(encoding="utf-8"))


GOLDEN = {serving: _golden(serving) for serving in SERVINGS}
CASES = [
    (serving, family, name)
    for serving, golden in GOLDEN.items()
    for family in golden["families"]
    for name in golden["cases"]
]


def _answer(content: Any, reasoning: Any, calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": content or None, "reasoning": reasoning or None, "tool_calls": calls}


def _vllm(answer: dict[str, Any]) -> dict[str, Any]:
    return _answer(answer["content"], answer["reasoning"], answer["tool_calls"])


def _proxy(msg: ParsedMessage) -> dict[str, Any]:
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in msg.tool_calls
    ]
    return _answer(msg.content, msg.reasoning, calls)


def _parse(family: str, case: dict[str, Any], tools: Any) -> ParsedMessage:
    return get_parser(family).parse(
        case["text"], "seed", tools=tools, in_reasoning=case["in_reasoning"]
    )


def _stream(family: str, case: dict[str, Any], tools: Any, size: int) -> ParsedMessage:
    stream = get_parser(family).stream("seed", tools, in_reasoning=case["in_reasoning"])
    return fed_in_pieces(stream, case["text"], size)


def fed_in_pieces(stream: StreamParser, text: str, size: int) -> ParsedMessage:
    """``text`` fed to ``stream`` in pieces of ``size`` characters (0: whole), then finished;
    the message its deltas make. No delta may be empty."""
    deltas = []
    step = size or max(len(text), 1)
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i : i + step])
    deltas += stream.finish()
    for d in deltas:
        assert d.content != "" and d.reasoning != ""  # never an empty delta
    return apply_deltas(deltas)


def test_goldens_are_vllms_answers_to_the_current_cases():
    current = cases()
    for serving, golden in GOLDEN.items():
        assert golden["vllm_version"] == "0.32.0"
        spec = SERVINGS[serving]
        assert (golden["tool_parser"], golden["reasoning_parser"]) == (
            spec["tool_parser"],
            spec["reasoning_parser"],
        )
        assert golden["families"] == spec["families"]
        assert set(golden["cases"]) == set(current[serving]), f"{serving}: scripts/parser-goldens"
        for name, case in golden["cases"].items():
            want = current[serving][name]
            assert case["text"] == want["text"], name
            assert case.get("deviation") == want.get("deviation"), name
            assert golden["tools"] == want["tools"]


@pytest.mark.parametrize(("serving", "family", "name"), CASES)
def test_parser_answers_as_vllm(serving: str, family: str, name: str) -> None:
    golden = GOLDEN[serving]
    case = golden["cases"][name]
    whole = _proxy(_parse(family, case, golden["tools"]))
    vllm = _vllm(case["whole"])
    deviation = case.get("deviation")
    if deviation is None:
        assert whole == vllm
    else:
        assert whole == deviation["proxy"]
        assert vllm != deviation["proxy"]
    for size in PIECES:
        assert _proxy(_stream(family, case, golden["tools"], size)) == whole, size
