"""Canonical turns and the chained digests (``core.linking.digests``)."""

import json

import numpy as np

from capture_proxy.core.capture import prepare_request
from capture_proxy.core.known_messages import KnownMessages, turn_payloads
from capture_proxy.core.linking.digests import (
    canonical_arguments,
    child_digest,
    child_digest_after,
    history_digest,
    request_digest,
)
from harness_notes import default_registry
from harness_notes.opencode import STEP_LIMIT_NOTE

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "bash", "arguments": '{\n  "command" : "echo \'caf\\u00e9\'",  "n": 1\n}'},
}
ECHO = {
    "id": "call_1",
    "type": "function",
    "function": {
        "name": "bash",
        "arguments": json.dumps(
            {"command": "echo 'caf\u00e9'", "n": 1}, separators=(",", ":"), ensure_ascii=False
        ),
    },
}
SYSTEM_USER = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def test_opencode_reserialised_arguments_are_canonically_equal():
    assert (
        canonical_arguments(CALL["function"]["arguments"])
        == canonical_arguments(ECHO["function"]["arguments"])
        == '{"command":"echo \'caf\u00e9\'","n":1}'
    )
    assert canonical_arguments("not json {") == "not json {"


def test_content_null_empty_and_absent_are_the_same():
    base = [*SYSTEM_USER]
    a = history_digest([*base, {"role": "assistant", "content": None, "tool_calls": [CALL]}])
    b = history_digest([*base, {"role": "assistant", "content": "", "tool_calls": [ECHO]}])
    c = history_digest([*base, {"role": "assistant", "tool_calls": [ECHO]}])
    assert a == b == c


def test_reasoning_is_not_part_of_the_digest():
    a = history_digest(
        [*SYSTEM_USER, {"role": "assistant", "content": "x", "reasoning_content": "r"}]
    )
    b = history_digest([*SYSTEM_USER, {"role": "assistant", "content": "x"}])
    assert a == b


def test_digest_changes_with_content_order_ids_and_arguments():
    one = {"role": "assistant", "content": "a"}
    two = {"role": "assistant", "content": "b"}
    assert history_digest([one, two]) != history_digest([two, one])
    other_id = {**ECHO, "id": "call_2"}
    assert history_digest([{"role": "assistant", "tool_calls": [ECHO]}]) != history_digest(
        [{"role": "assistant", "tool_calls": [other_id]}]
    )
    other_args = {**ECHO, "function": {"name": "bash", "arguments": '{"command":"ls"}'}}
    assert history_digest([{"role": "assistant", "tool_calls": [ECHO]}]) != history_digest(
        [{"role": "assistant", "tool_calls": [other_args]}]
    )


def test_user_and_tool_messages_do_not_take_part():
    turn = {"role": "assistant", "content": "a"}
    assert history_digest([*SYSTEM_USER, turn]) == history_digest(
        [{"role": "user", "content": "other"}, turn, {"role": "tool", "content": "t"}]
    )
    assert history_digest(SYSTEM_USER) is None


def test_child_digest_is_what_the_next_request_computes():
    response = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    parent_key = child_digest(SYSTEM_USER, response)
    next_request = [
        *SYSTEM_USER,
        {"role": "assistant", "content": "", "tool_calls": [ECHO]},
        {"role": "tool", "tool_call_id": "call_1", "content": "out"},
    ]
    assert history_digest(next_request) == parent_key


def test_request_digest_ignores_stream_fields_only():
    body = {"model": "m", "messages": SYSTEM_USER, "temperature": 0.5}
    assert request_digest(body) == request_digest({**body, "stream": True, "stream_options": {}})
    assert request_digest(body) != request_digest({**body, "temperature": 0.6})


def test_prepare_rewrites_a_trailing_note_and_leaves_it_out_of_linking():
    history = [
        *SYSTEM_USER,
        {"role": "assistant", "content": "", "tool_calls": [ECHO]},
        {"role": "tool", "tool_call_id": "call_1", "content": "out"},
    ]
    body = {
        "model": "m",
        "messages": [*history, {"role": "assistant", "content": STEP_LIMIT_NOTE.text}],
    }
    prepared = prepare_request(body, default_registry())
    assert prepared.harness_note == "opencode.step_limit"
    assert prepared.body["messages"][-1] == {"role": "user", "content": STEP_LIMIT_NOTE.text}
    assert prepared.body["messages"][:-1] == history
    assert prepared.linking_messages == history
    assert body["messages"][-1]["role"] == "assistant"  # the original is not modified
    plain = prepare_request({"messages": history}, default_registry())
    assert plain.harness_note is None and plain.body == {"messages": history}


def test_extends_by_digest():
    from capture_proxy.core.linking.digests import extends_by_digest
    from capture_proxy.core.stored_form import token_digest

    p, g = np.array([1, 2, 3], np.uint32), np.array([4, 5], np.uint32)
    key = token_digest(p, g)
    assert extends_by_digest(np.array([1, 2, 3, 4, 5, 9], np.uint32), 5, key)
    assert extends_by_digest(np.array([1, 2, 3, 4, 5], np.uint32), 5, key)
    assert not extends_by_digest(np.array([1, 2, 3, 4, 6, 9], np.uint32), 5, key)
    assert not extends_by_digest(np.array([1, 2, 3, 4], np.uint32), 5, key)


def test_canonical_json_matches_the_stdlib_form():
    import json

    from capture_proxy.core.linking.digests import canonical_json

    for value in [{"b": 1, "a": [1.5, "caf\u00e9", None, True]}, {"n": 2**70}, "x", [], {}]:
        assert canonical_json(value) == json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )


def test_child_digest_after_the_requests_digest_equals_the_whole_history_digest():
    answer = {"content": "done", "tool_calls": [CALL]}
    histories = [
        list(SYSTEM_USER),
        [*SYSTEM_USER, {"role": "assistant", "content": "", "tool_calls": [ECHO]}],
        [
            *SYSTEM_USER,
            {"role": "assistant", "content": "a", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "out"},
            {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
            {"role": "user", "content": "more"},
        ],
    ]
    for messages in histories:
        expected = child_digest(messages, answer)
        assert child_digest_after(history_digest(messages), answer) == expected
    # A root's children and a child's children differ.
    assert child_digest_after(None, answer) != child_digest_after(
        history_digest(histories[1]), answer
    )


def test_last_linking_item_is_the_last_of_the_linking_items():
    from capture_proxy.core.linking.digests import last_linking_item, linking_items

    a1, a2 = {"role": "assistant", "content": "1"}, {"role": "assistant", "content": "2"}
    for history in ([], SYSTEM_USER, [*SYSTEM_USER, a1], [*SYSTEM_USER, a1, a2, *SYSTEM_USER]):
        items = linking_items(history)
        assert last_linking_item(history) is (items[-1] if items else None)


def test_a_parent_digest_from_remembered_steps_is_the_one_of_the_history():
    # Each message's facts remember the step its item took (after which digest): histories
    # that repeat, grow, reorder, carry images (an item only before a later turn) or share
    # messages give history_digest's value without the steps, every time.
    known = KnownMessages()
    image = {"type": "image", "sha256": "ab" * 32}
    user = {"role": "user", "content": "task"}
    pic = {"role": "user", "content": [{"type": "text", "text": "see"}, image]}
    turns = [{"role": "assistant", "content": f"a{i}", "tool_calls": [CALL]} for i in range(4)]
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    histories = [
        [user],
        [user, turns[0], tool],
        [user, turns[0], tool, turns[1], pic],
        [user, turns[0], tool, turns[1], pic, turns[2]],
        [user, turns[1], tool, turns[0]],
        [pic, turns[0], tool, turns[1], pic, turns[2], turns[3]],
        [user, turns[0], tool, turns[1], pic, turns[2]],
        [turns[2], turns[2], turns[2]],
    ]
    for messages in [*histories, *histories]:
        facts = known.facts(messages)
        payloads = turn_payloads(facts)
        assert history_digest(messages, payloads, facts) == history_digest(messages), messages
    assert history_digest([user], [None], known.facts([user])) is None
