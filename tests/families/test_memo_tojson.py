"""The template's remembered ``tojson`` (``families.template_render.MemoTojson``): the same text
as transformers' filter for every value, remembered only for values whose pickle is equal."""

from __future__ import annotations

import json

import pytest

from capture_proxy.families.template_render import MemoTojson


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' filter (``chat_template_utils``), counting its calls."""
    _tojson.calls += 1  # type: ignore[attr-defined]
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file — whole.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}


def test_a_tool_sent_again_is_written_once():
    memo, _tojson.calls = MemoTojson(_tojson), 0  # type: ignore[attr-defined]
    first = memo(TOOL)
    again = memo(json.loads(json.dumps(TOOL)))  # the next call's tools: equal, not the same
    assert first == again == json.dumps(TOOL, ensure_ascii=False)
    assert _tojson.calls == 1  # type: ignore[attr-defined]


def test_values_whose_json_texts_differ_are_not_taken_for_each_other():
    memo = MemoTojson(_tojson)
    values = [
        {"a": None},
        {"a": float("nan")},
        {"a": float("inf")},
        {"a": 1},
        {"a": 1.0},
        {"a": True},
        {"a": "1"},
        {"b": 1, "a": 2},
        {"a": 2, "b": 1},
        [1, 2],
        [2, 1],
        {"a": -0.0},
        {"a": 0.0},
    ]
    for _ in range(2):  # the second round from memory
        for value in values:
            assert memo(value) == json.dumps(value, ensure_ascii=False), value


def test_other_options_and_types_are_the_filters_own():
    memo, _tojson.calls = MemoTojson(_tojson), 0  # type: ignore[attr-defined]
    for _ in range(2):
        assert memo(TOOL, indent=4) == json.dumps(TOOL, ensure_ascii=False, indent=4)
        assert memo(TOOL, ensure_ascii=True) == json.dumps(TOOL)
        assert memo(TOOL, sort_keys=True) == json.dumps(TOOL, ensure_ascii=False, sort_keys=True)
        assert memo("é") == '"é"'
    assert _tojson.calls == 8  # type: ignore[attr-defined]


def test_memory_is_bounded():
    memo = MemoTojson(_tojson, max_entries=3, max_chars=64)
    for i in range(10):
        memo({"i": i})
    memo({"big": "x" * 100})  # past max_chars: not kept
    assert len(memo._texts) == 3
    assert memo({"i": 9}) == '{"i": 9}'


def test_what_is_not_plain_data_is_the_filters_own():
    from markupsafe import Markup

    memo, _tojson.calls = MemoTojson(_tojson), 0  # type: ignore[attr-defined]
    cyclic: list = []
    cyclic.append(cyclic)
    for _ in range(2):
        assert memo({"a": Markup("<b>")}) == '{"a": "<b>"}'
        with pytest.raises(ValueError, match="Circular reference"):
            memo(cyclic)
    assert _tojson.calls == 4  # type: ignore[attr-defined]
