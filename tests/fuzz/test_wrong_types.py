"""Wrong JSON types for every field of every front's request (issue 34).

Each front (chat completions, Responses, Anthropic Messages) gets a rich valid body: top-level
options, messages or input items of every kind, content parts, tool definitions, tool calls.
Every field in it, at every depth, is replaced in turn by a value of each JSON type it does not
have (object, array, string, number, bool, null). Every answer must be below 500; a 4xx is in
the API's error shape and, for OpenAI's APIs, its ``param`` names a field. Hypothesis draws the
(field, type) pairs; ``test_every_field_and_type`` sends all of them once, derandomized.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import OUTCOMES
from tests.fuzz.served import ServedProxy
from tests.fuzz.test_hostile_requests import FUZZ, JSON_HEADERS, _capture, _rollout, check

_TOOL_FN = {"name": "ls", "description": "list", "parameters": {"type": "object"}}
BODIES: dict[str, dict[str, Any]] = {
    "chat": {
        "model": "scripted-qwen",
        "max_tokens": 16,
        "temperature": 0.5,
        "stream": False,
        "stop": ["\n\n"],
        "tools": [{"type": "function", "function": _TOOL_FN}],
        "tool_choice": "auto",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        ],
    },
    "responses": {
        "model": "scripted-qwen",
        "max_output_tokens": 16,
        "instructions": "Be brief.",
        "temperature": 0.5,
        "tools": [{"type": "function", **_TOOL_FN}],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        ],
    },
    "messages": {
        "model": "scripted-qwen",
        "max_tokens": 16,
        "system": [{"type": "text", "text": "Be brief."}],
        "temperature": 0.5,
        "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "c1", "name": "ls", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "a.txt"}],
            },
        ],
    },
}
WRONG: dict[str, Any] = {
    "object": {"x": 1},
    "array": [1],
    "string": "x",
    "number": 7,
    "bool": True,
    "null": None,
}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every field's path (dict keys and list indexes) below the top, depth first."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in items:
        yield (*prefix, key)
        if isinstance(child, dict | list):
            yield from _paths(child, (*prefix, key))


def _get(body: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        body = body[key]
    return body


CASES = sorted(
    (api, path, kind)
    for api, body in BODIES.items()
    for path in _paths(body)
    for kind in WRONG
    if kind != _kind(_get(body, path))
)


def _send(proxy: ServedProxy, api: str, path: tuple[Any, ...], kind: str) -> None:
    body = copy.deepcopy(BODIES[api])
    parent = _get(body, path[:-1])
    parent[path[-1]] = copy.deepcopy(WRONG[kind])
    rollout = _rollout()
    url = _capture(rollout, api)
    answer = proxy.send("POST", url, JSON_HEADERS, json.dumps(body).encode())
    where = ".".join(str(p) for p in path)
    assert answer.status < 500, (api, where, kind, answer.body[:300])
    check(proxy, f"wrong types {api}", url, answer, rollout, model_call=True)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, qwen_tokenizer) -> Iterator[ServedProxy]:
    served = ServedProxy(tmp_path_factory.mktemp("fuzz-types"), qwen_tokenizer)
    served.start()
    try:
        yield served
    finally:
        served.stop()


def test_the_bodies_are_valid(proxy: ServedProxy) -> None:
    for api, body in BODIES.items():
        answer = proxy.send(
            "POST", _capture(_rollout(), api), JSON_HEADERS, json.dumps(body).encode()
        )
        assert answer.status == 200, (api, answer.body[:300])


def test_every_field_and_type(proxy: ServedProxy) -> None:
    assert len(CASES) > 300  # every field of the three bodies, each wrong type
    for api, path, kind in CASES:
        _send(proxy, api, path, kind)
    assert sum(OUTCOMES[f"wrong types {api}"].total() for api in BODIES) >= len(CASES)


@FUZZ
@given(case=st.sampled_from(CASES))
def test_a_drawn_field_and_type(proxy: ServedProxy, case: tuple[str, tuple[Any, ...], str]) -> None:
    _send(proxy, *case)


def test_a_responses_role_object_is_a_400_naming_the_field(proxy: ServedProxy) -> None:
    body = {"model": "scripted-qwen", "input": [{"role": {}}]}
    answer = proxy.send(
        "POST", _capture(_rollout(), "responses"), JSON_HEADERS, json.dumps(body).encode()
    )
    assert answer.status == 400, answer.body[:300]
    assert answer.json()["error"]["param"] == "input.0.role"
