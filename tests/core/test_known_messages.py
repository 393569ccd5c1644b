"""Facts of known messages (``core.known_messages``) and the per-call steps that use them:
validation of new messages only, digests and canonical texts equal to those derived from the
messages, check_extension skipping known-equal messages, and the engine echo check."""

from __future__ import annotations

import json

import numpy as np
import pytest

from capture_proxy.core.assembly import CallContext
from capture_proxy.core.capture import prepare_request
from capture_proxy.core.engine_formats import Piece
from capture_proxy.core.json_bodies import InvalidRequest
from capture_proxy.core.known_messages import (
    KnownMessages,
    message_digests,
    same_messages,
    turn_payloads,
)
from capture_proxy.core.linking.digests import history_digest
from capture_proxy.core.records import CallStatus
from capture_proxy.core.requests import validate_chat_request
from capture_proxy.core.splice import SpliceRefused, check_extension
from capture_proxy.core.stored_form import MessageDigests, canonical_json
from capture_proxy.core.tokens_in_assembly import TokensInAssembler, echo_matches


def _tool_turn(i: int) -> list[dict]:
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "read", "arguments": json.dumps({"filePath": f"m{i}.py", "é": i})},
    }
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": f"file {i} ✓"},
    ]


def _history(turns: int) -> list[dict]:
    out = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    for i in range(turns):
        out += _tool_turn(i)
    return out


def _fresh(messages: list[dict]) -> list[dict]:
    """The same messages as new objects, as a harness's next request parses them."""
    return json.loads(json.dumps(messages))


def test_equal_values_share_facts_and_keys_tell_numbers_apart():
    known = KnownMessages()
    first = known.facts(_history(2))
    again = known.facts(_fresh(_history(2)))
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert len(known) == 6
    # Python's == makes these equal; their JSON values differ, so their facts do too.
    one, one_float, true = known.facts(
        [{"role": "user", "content": "x", "n": v} for v in (1, 1.0, True)]
    )
    assert [one.key, one_float.key, true.key] == [
        b'{"role":"user","content":"x","n":1}',
        b'{"role":"user","content":"x","n":1.0}',
        b'{"role":"user","content":"x","n":true}',
    ]
    assert not one.same_value(one_float) and not one.same_value(true)


def test_facts_give_the_digests_and_texts_derived_from_the_messages():
    known = KnownMessages()
    messages = _history(3)
    known.facts(messages[:-2])  # an earlier request
    facts = known.facts(messages)
    derived = MessageDigests.of(messages)
    assert message_digests(facts) == derived
    assert [f.text for f in facts] == [canonical_json(m) for m in messages]
    assert history_digest(messages, turn_payloads(facts)) == history_digest(messages)
    assert [f.turn is not None for f in facts] == [m["role"] == "assistant" for m in messages]


def test_a_message_orjson_cannot_write_gets_unkept_facts():
    known = KnownMessages()
    big = {"role": "user", "content": "x", "n": 2**70}
    (facts,) = known.facts([big])
    assert facts.key is None and len(known) == 0
    assert facts.text == '{"role":"user","content":"x","n":1180591620717411303424}'
    assert not facts.same_value(known.facts([big])[0])


def test_the_bound_evicts_least_recently_used_facts():
    known = KnownMessages(max_bytes=3 * 300)  # each of these: about 260 bytes
    messages = [{"role": "user", "content": f"m{i}"} for i in range(4)]
    first = known.facts(messages[:3])
    known.facts(messages[:1])  # m0 used again: m1 is now the least recently used
    known.facts(messages[3:4])
    assert len(known) == 3
    fresh = _fresh(messages)
    ((m0,), (m2,), (m1,)) = (known.facts([fresh[i]]) for i in (0, 2, 1))
    assert m0 is first[0] and m2 is first[2]
    assert m1 is not first[1] and m1.key == first[1].key  # evicted, derived again


def test_validation_skips_validated_messages_and_marks_new_ones():
    known = KnownMessages()
    body = {"model": "m", "messages": _history(2)}
    facts = known.facts(body["messages"])
    validate_chat_request(body, facts)
    assert all(f.valid for f in facts)
    # A known-valid message is not looked at again; a new bad one is named at its position.
    nxt = {"model": "m", "messages": [*_fresh(body["messages"]), {"role": "robot"}]}
    with pytest.raises(InvalidRequest) as err:
        validate_chat_request(nxt, known.facts(nxt["messages"]))
    assert err.value.param == "messages.6.role"
    with pytest.raises(InvalidRequest) as plain:
        validate_chat_request(nxt)
    assert str(plain.value) == str(err.value)


def test_validation_reports_fields_in_field_order():
    bad_message = [{"role": "user", "content": 5}]
    with pytest.raises(InvalidRequest) as err:
        validate_chat_request({"model": 1, "messages": bad_message})
    assert err.value.param == "model"
    with pytest.raises(InvalidRequest) as err:
        validate_chat_request({"model": "m", "messages": bad_message, "stream": "yes"})
    assert err.value.param == "messages.0.content"
    with pytest.raises(InvalidRequest) as err:
        validate_chat_request({"model": "m", "messages": [], "stream": "yes"})
    assert err.value.param == "messages"


def test_validation_with_facts_still_finds_a_lone_surrogate_outside_messages():
    known = KnownMessages()
    body = {"model": "m", "messages": _history(1), "user": "\ud800"}
    with pytest.raises(InvalidRequest) as err:
        validate_chat_request(body, known.facts(body["messages"]))
    assert err.value.param == "user"


def test_check_extension_trusts_known_equal_messages_only():
    known = KnownMessages()
    parent = _history(2)
    child = [*_fresh(parent), *_tool_turn(2)]
    same = same_messages(known.facts(parent), known.facts(child))
    assert same == [True] * len(parent)
    assert check_extension(parent, child, same) == len(parent)
    edited = _fresh(child)
    edited[1]["content"] = "went"
    same = same_messages(known.facts(parent), known.facts(edited))
    assert same[1] is False
    with pytest.raises(SpliceRefused) as err:
        check_extension(parent, edited, same)
    assert err.value.message_index == 1


def test_prepare_request_carries_facts_past_a_rewritten_note():
    class Note:
        key, text = "step_limit", "You have reached the step limit."

    class Notes:
        def match_trailing_note(self, messages):
            return Note() if messages[-1].get("content") == "MAX STEPS" else None

    known = KnownMessages()
    messages = [*_history(1), {"role": "assistant", "content": "MAX STEPS"}]
    facts = known.facts(messages)
    prepared = prepare_request({"model": "m", "messages": messages}, Notes(), facts)
    assert prepared.linking_facts == facts[:-1]
    assert prepared.message_facts is not None
    assert prepared.message_facts[:-1] == facts[:-1]
    assert prepared.message_facts[-1].text == (
        '{"role":"user","content":"You have reached the step limit."}'
    )
    assert message_digests(prepared.message_facts) == MessageDigests.of(prepared.body["messages"])


CTX = CallContext("call-1", "r1", 100.0, False, "/v1/completions", {"model": "m"})


@pytest.mark.parametrize(
    ("echo", "matches"),
    [
        ([5, 6, 7], True),
        ([5, 6, 8], False),
        ([5, 6], False),
        ([5, 6, 7.0], False),
        ([5, 6, 2**70], False),
        ("5,6,7", False),
    ],
)
def test_the_engine_echo_must_be_the_prompt_id_for_id(echo, matches):
    prompt = np.array([5, 6, 7], dtype=np.uint32)
    assert echo_matches(echo, prompt, None) is matches
    asm = TokensInAssembler(CTX, prompt)
    asm.add(
        Piece(
            token_ids=[9],
            log_probs=[-0.5],
            prompt_token_ids=echo,
            saw_token_ids=True,
            saw_log_probs=True,
            finish_reason="stop",
        )
    )
    record = asm.finish(
        response_message={"role": "assistant", "content": "x"},
        finish_reason="stop",
        latency_ms=1.0,
        http_status=200,
    )
    assert (record.status is CallStatus.COMPLETE) is matches


def test_message_digests_from_remembered_chain_steps_are_those_of_the_messages():
    # A history's messages repeat after the same ones at each call (their chain step is
    # remembered), and the same message may also stand elsewhere (another history, or moved):
    # every answer is MessageDigests.of the messages, whatever was seen before.
    known = KnownMessages()
    system = {"role": "system", "content": "be brief"}
    turns = [{"role": "user", "content": f"q{i}"} for i in range(6)]
    histories = [
        [system, *turns[:2]],
        [system, *turns[:4]],
        [system, *turns[:6]],
        [turns[0], system, *turns[1:3]],  # the system message after another one
        [system, *turns[:6]],
        [*turns[:6]],
        [system, *turns[:6]],
    ]
    for messages in histories:
        facts = known.facts(messages)
        assert message_digests(facts) == MessageDigests.of(messages)
        assert facts[-1].chain == (
            MessageDigests.of(messages).chain[-2],
            MessageDigests.of(messages).chain[-1],
        )
