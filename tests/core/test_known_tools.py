"""Facts of known tools values (``core.known_tools``) and the per-call steps that use them: exact
texts and addresses, keys that tell 1, 1.0 and true apart, the bound in bytes, validation of
new values only (and the same 400 for a bad value every time), the record's encoding, and the
Responses and Messages fronts converting a tools value once."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from capture_proxy.core.fronts.base import Api, InvalidFrontRequest
from capture_proxy.core.fronts.chat import ChatCodec
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.fronts.responses import ResponsesCodec
from capture_proxy.core.json_bodies import InvalidRequest
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.known_tools import KnownTools
from capture_proxy.core.linking.digests import canonical_json as sorted_json
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.requests import validate_chat_request
from capture_proxy.core.stored_form import canonical_json, json_sha256, received_refs

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file ✓",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def _tools(x: Any = 1, name: str = "read", pad: int = 0) -> list[dict[str, Any]]:
    tools = copy.deepcopy(TOOLS)
    tools[0]["function"]["name"] = name
    tools[0]["function"]["parameters"]["x"] = x
    tools[0]["function"]["description"] += "." * pad
    return tools


def _chat(tools: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, **extra}


def test_facts_exact_values():
    facts = KnownTools().facts(TOOLS)
    text = (
        '[{"type":"function","function":{"name":"read","description":"Read a file ✓",'
        '"parameters":{"type":"object","properties":{"path":{"type":"string"}},'
        '"required":["path"]}}}]'
    )
    assert facts.key == text.encode()
    assert facts.text == text == canonical_json(TOOLS)
    assert facts.sha256 == "57771d9d39500e3978c404bb49d21982c54e1493e89059f0ec1c8df8128c5480"
    assert facts.sha256 == json_sha256(text)
    assert (
        facts.sorted_text
        == (
            '[{"function":{"description":"Read a file ✓","name":"read","parameters":'
            '{"properties":{"path":{"type":"string"}},"required":["path"],"type":"object"}},'
            '"type":"function"}]'
        ).encode()
    )
    assert facts.sorted_text == sorted_json(TOOLS).encode()
    assert not facts.valid and facts.forms == {}


def test_equal_values_share_facts_and_keys_tell_numbers_apart():
    known = KnownTools()
    first = known.facts(_tools())
    assert known.facts(json.loads(json.dumps(_tools()))) is first
    assert len(known) == 1
    # Python's == makes these equal; their JSON values differ, so their facts do too.
    assert _tools(1) == _tools(1.0) == _tools(True)
    one_float, true = known.facts(_tools(1.0)), known.facts(_tools(True))
    assert len({id(first), id(one_float), id(true)}) == 3 and len(known) == 3
    for facts, spelled in ((first, b'"x":1}'), (one_float, b'"x":1.0}'), (true, b'"x":true}')):
        assert facts.key is not None and spelled in facts.key
        assert facts.text is not None and facts.text.encode() == facts.key
    assert len({first.sha256, one_float.sha256, true.sha256}) == 3


def test_a_value_orjson_cannot_write_is_derived_every_time():
    known = KnownTools()
    big = _tools(2**70)
    facts = known.facts(big)
    assert facts.key is None and facts.sorted_text is None and len(known) == 0
    assert facts.text == canonical_json(big) and '"x":1180591620717411303424' in facts.text
    assert facts.sha256 == json_sha256(facts.text)
    assert known.facts(big) is not facts


def test_bounded_by_bytes_least_recently_used_out_first():
    one = KnownTools().facts(_tools(name="t0"))
    known = KnownTools(max_bytes=3 * one.size)
    a, b, c = (known.facts(_tools(name=f"t{i}")) for i in range(3))
    assert len(known) == 3 and known.kept_bytes == a.size + b.size + c.size <= known.max_bytes
    assert known.facts(_tools(name="t0")) is a  # used: now the most recent
    d = known.facts(_tools(name="t3"))  # b, the least recently used, goes
    assert len(known) == 3 and known.kept_bytes <= known.max_bytes
    assert known.facts(_tools(name="t0")) is a and known.facts(_tools(name="t3")) is d
    assert known.facts(_tools(name="t2")) is c
    assert known.facts(_tools(name="t1")) is not b  # derived again (and a went)
    # a value larger than the bound is not kept
    assert known.facts(_tools(pad=10 * known.max_bytes)) is not None and len(known) == 3


def test_forms_count_against_the_bound_and_go_with_their_facts():
    known = KnownTools(max_bytes=10_000)
    facts = known.facts(_tools())
    before = known.kept_bytes
    known.keep_form(facts, "responses", ("form",), 1000)
    assert facts.forms == {"responses": ("form",)} and known.kept_bytes == before + 1000
    known.keep_form(facts, "responses", ("other",), 1000)  # kept once
    assert facts.forms == {"responses": ("form",)} and known.kept_bytes == before + 1000
    known.keep_form(facts, "messages", ("big",), 20_000)  # past the bound: the entry goes
    assert len(known) == 0 and known.kept_bytes == 0
    unkept = KnownTools().facts(_tools(2**70))
    known.keep_form(unkept, "responses", ("form",), 10)
    assert unkept.forms == {} and known.kept_bytes == 0


# -- validation ---------------------------------------------------------------------------------


def test_valid_tools_are_validated_once():
    known = KnownTools()
    facts = known.facts(_tools())
    validate_chat_request(_chat(_tools()), tools_facts=facts)
    assert facts.valid
    again = known.facts(_tools())
    assert again is facts
    # known valid: not validated again (this value's facts say valid; the model is not built)
    req = validate_chat_request(_chat(_tools()), tools_facts=again)
    assert req.tools is None
    # the other fields still are
    with pytest.raises(InvalidRequest, match="'temperature'"):
        validate_chat_request(_chat(_tools(), temperature="hot"), tools_facts=again)


def test_bad_tools_fail_with_the_same_message_every_time():
    known = KnownTools()
    bad = [{"type": "function", "function": {"name": ""}}]
    with pytest.raises(InvalidRequest) as plain:
        validate_chat_request(_chat(bad))
    messages = []
    for _ in range(2):
        facts = known.facts(copy.deepcopy(bad))
        with pytest.raises(InvalidRequest) as exc:
            validate_chat_request(_chat(copy.deepcopy(bad)), tools_facts=facts)
        assert not facts.valid
        messages.append((str(exc.value), exc.value.param))
    assert len(known) == 1  # the second failure came from the memo's (unvalidated) facts
    assert messages[0] == messages[1] == (str(plain.value), plain.value.param)
    assert messages[0][1] == "tools.0.function.name"
    # a value that is not a function tool: the same message as without the memo too
    hosted = [{"type": "web_search", "function": {"name": "x"}}]
    with pytest.raises(InvalidRequest) as plain:
        validate_chat_request(_chat(hosted))
    for _ in range(2):
        with pytest.raises(InvalidRequest) as exc:
            validate_chat_request(_chat(hosted), tools_facts=known.facts(copy.deepcopy(hosted)))
        assert str(exc.value) == str(plain.value)
        assert "the engine renders function tools only" in str(exc.value)


def test_a_valid_value_is_not_taken_for_one_that_differs_in_1_10_or_true():
    known = KnownTools()
    one = known.facts(_tools(1))
    validate_chat_request(_chat(_tools(1)), tools_facts=one)
    assert one.valid
    for x in (1.0, True):
        other = known.facts(_tools(x))
        assert other is not one and not other.valid
        assert other.text == canonical_json(_tools(x)) != one.text


def test_the_chat_front_validates_known_tools_once_and_names_bad_ones_every_time():
    codec, known, known_tools = ChatCodec(), KnownMessages(), KnownTools()
    first = codec.parse(_chat(_tools()), known=known, known_tools=known_tools)
    second = codec.parse(_chat(_tools()), known=known, known_tools=known_tools)
    assert first.tools_facts is second.tools_facts and second.tools_facts is not None
    assert second.tools_facts.valid and second.received_tools_facts is None
    bad = _chat([{"type": "function"}])
    with pytest.raises(InvalidFrontRequest) as plain:
        codec.parse(copy.deepcopy(bad), known=known)
    for _ in range(2):
        with pytest.raises(InvalidFrontRequest) as exc:
            codec.parse(copy.deepcopy(bad), known=known, known_tools=known_tools)
        assert str(exc.value) == str(plain.value) == "'tools.0.function' is required"


# -- the record's encoding ----------------------------------------------------------------------


def test_the_request_encoding_from_facts_is_the_one_derived():
    known = KnownTools()
    tools = _tools(True)
    messages = [{"role": "user", "content": "hi"}]
    derived = RequestEncoding.of(messages, tools)
    memo = RequestEncoding.of(messages, tools, None, known.facts(_tools(True)))
    assert (memo.tools_text, memo.tools_sha256) == (derived.tools_text, derived.tools_sha256)
    assert memo.tools_text == canonical_json(tools)


def test_received_values_take_known_texts_by_identity_only():
    tools = _tools(pad=600)
    equal = copy.deepcopy(tools)
    known = [(tools, "K" * 2000, "f" * 64)]
    inline, refs = received_refs({"tools": tools, "copy": equal}, blobs := {}, known=known)
    assert inline == {} and refs is not None
    assert refs["tools"] == "f" * 64 and blobs["f" * 64] == "K" * 2000
    assert refs["copy"] == json_sha256(canonical_json(equal))


# -- the Responses and Messages fronts ----------------------------------------------------------

RESPONSES_TOOLS = [
    {"type": "function", "name": "read", "parameters": {"type": "object", "x": 1}},
    {"type": "custom", "name": "apply_patch", "description": "Patch files"},
    {"type": "web_search"},
]
MESSAGES_TOOLS = [
    {"name": "Read", "description": "Read a file", "input_schema": {"type": "object", "x": 1}},
    {"type": "web_search_20250305", "name": "web_search"},
]


def _responses(tools: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", "tools": tools, "tool_choice": "auto"}


def _messages(tools: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "tools": tools}  # fmt: skip


@pytest.mark.parametrize(
    ("codec", "body", "tools"),
    [
        (ResponsesCodec(), _responses, RESPONSES_TOOLS),
        (MessagesCodec(), _messages, MESSAGES_TOOLS),
    ],
)
def test_a_front_converts_a_tools_value_once(codec: Any, body: Any, tools: Any) -> None:
    known_tools = KnownTools()
    plain = codec.parse(body(copy.deepcopy(tools)))
    first = codec.parse(body(copy.deepcopy(tools)), known_tools=known_tools)
    second = codec.parse(body(copy.deepcopy(tools)), known_tools=known_tools)
    for parsed in (first, second):
        assert parsed.chat == plain.chat and parsed.options == plain.options
        assert parsed.diagnostics == plain.diagnostics
        facts = parsed.tools_facts
        assert facts is not None and facts.text == canonical_json(plain.chat["tools"])
        assert facts.sorted_text == sorted_json(plain.chat["tools"]).encode()
        received = parsed.received_tools_facts
        assert received is not None and received.text == canonical_json(tools)
    assert second.chat["tools"] is first.chat["tools"]  # converted once, shared read-only
    assert second.tools_facts is first.tools_facts
    assert second.received_tools_facts is first.received_tools_facts
    assert len(known_tools) == 1 and set(first.received_tools_facts.forms) == {codec.api}
    # 1.0 for 1: converted for itself
    other = copy.deepcopy(tools)
    schema = "parameters" if codec.api is Api.RESPONSES else "input_schema"
    other[0][schema]["x"] = 1.0
    third = codec.parse(body(other), known_tools=known_tools)
    assert third.chat["tools"] is not first.chat["tools"]
    assert third.tools_facts is not None and '"x":1.0' in (third.tools_facts.text or "")


@pytest.mark.parametrize(
    ("codec", "body", "bad", "message"),
    [
        (ResponsesCodec(), _responses, [{"type": "function"}], "'tools.0.name' is required"),
        (MessagesCodec(), _messages, [{"name": "Read"}], "tools.0.input_schema: must be"),
    ],
)
def test_a_front_names_bad_tools_every_time(codec: Any, body: Any, bad: Any, message: str):
    known_tools = KnownTools()
    with pytest.raises(InvalidFrontRequest) as plain:
        codec.parse(body(copy.deepcopy(bad)))
    assert str(plain.value).startswith(message)
    for _ in range(2):
        with pytest.raises(InvalidFrontRequest) as exc:
            codec.parse(body(copy.deepcopy(bad)), known_tools=known_tools)
        assert (str(exc.value), exc.value.param) == (str(plain.value), plain.value.param)
    assert len(known_tools) == 1
    facts = known_tools.facts(bad)
    assert facts.forms == {}
