import json

import numpy as np
import pytest

from capture_proxy.core.capture import prepare_request
from capture_proxy.core.linking.digests import (
    canonical_arguments,
    child_digest,
    child_digest_after,
    history_digest,
    request_digest,
)
from capture_proxy.core.linking.index import LinkIndex
from capture_proxy.core.linking.mismatch import (
    DecodedTexts,
    MismatchClass,
    classify_mismatch,
    first_difference,
)
from capture_proxy.core.linking.verdicts import ReasonKind, Verdict
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


class TestIndex:
    def test_verdicts(self):
        index = LinkIndex()
        index.add("a", 1.0, child_digest="d1", request_digest="q1")
        assert index.resolve(None, "q0").verdict is Verdict.ROOT
        res = index.resolve("d1", "q2")
        assert (res.verdict, res.parent_call_id, res.retry_of) == (Verdict.RESOLVED, "a", None)
        res = index.resolve("zz", "q2")
        assert res.verdict is Verdict.UNRESOLVED and res.reason.kind is ReasonKind.NO_MATCH
        assert res.reason.text == "no captured call produced the last model-authored turn"

    def test_an_identical_request_is_a_retry_only_on_an_explicit_signal(self):
        index = LinkIndex()
        index.add("a", 1.0, child_digest="d1", request_digest="q1", status="complete")
        # Identical and the earlier one answered: a sibling sample, not a retry.
        assert index.resolve(None, "q1").retry_of is None
        # The harness says it retries (x-stainless-retry-count > 0): the latest identical.
        index.add("a2", 2.0, child_digest="d1", request_digest="q1", status="complete")
        assert index.resolve(None, "q1", retry_requested=True).retry_of == "a2"
        # The latest identical call failed or was left incomplete: its retry.
        index.add("a3", 3.0, child_digest=None, request_digest="q1", status="failed")
        assert index.resolve(None, "q1").retry_of == "a3"
        index.add("a3", 3.0, child_digest=None, request_digest="q1", status="incomplete")
        assert index.resolve(None, "q1").retry_of == "a3"

    def test_candidates_prefer_no_child_yet_then_the_earliest(self):
        # Parallel sub-agents A and B answered alike (one child digest): A1, B1, then A2.
        index = LinkIndex()
        key = {"num_tokens": 5, "tokens_sha256": b"x" * 32}
        index.add("A1", 1.0, child_digest="d", request_digest="qa", status="complete", **key)
        index.add("B1", 2.0, child_digest="d", request_digest="qb", status="complete", **key)
        got = index.resolve("d", "qa2")
        assert [c.call_id for c in got.candidates] == ["A1", "B1"]
        assert got.parent_call_id == "A1"
        # A2 took A1 as its parent: B2 now prefers B1, which has no child yet.
        index.add(
            "A2", 3.0, child_digest="dA2", request_digest="qa2", status="complete",
            parent_call_id="A1", **key,
        )
        got = index.resolve("d", "qb2")
        assert [c.call_id for c in got.candidates] == ["B1", "A1"]

    def test_a_retry_supersedes_the_call_it_retried_as_a_candidate(self):
        index = LinkIndex()
        key = {"num_tokens": 5, "tokens_sha256": b"x" * 32}
        index.add("a", 1.0, child_digest="d1", request_digest="q1", status="complete", **key)
        index.add(
            "a2", 2.0, child_digest="d1", request_digest="q1", status="complete",
            retry_of="a", **key,
        )
        assert [c.call_id for c in index.resolve("d1", "q9").candidates] == ["a2", "a"]

    def test_candidates_are_scoped_by_model(self):
        index = LinkIndex()
        index.add("t", 1.0, child_digest="d", request_digest="q", model="small", status="complete")
        got = index.resolve("d", "q2", model="big")
        assert got.verdict is Verdict.UNRESOLVED and got.candidates == ()
        assert got.reason.kind is ReasonKind.MODEL_SCOPE
        assert got.reason.text == (
            "the matching turns come from a call to another model: the turns were produced by "
            "model small, this call is to big"
        )
        assert index.resolve("d", "q2", model="small").parent_call_id == "t"

    def test_an_unmatched_history_whose_last_turn_is_a_captured_output_is_history_edited(self):
        turn = {"role": "assistant", "content": "ls", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
        ]}
        index = LinkIndex()
        index.add("p", 1.0, child_digest="d", request_digest="q", status="complete",
                  response=turn)
        got = index.resolve("other", "q2", last_turn=turn)
        assert got.verdict is Verdict.UNRESOLVED
        assert got.reason.kind is ReasonKind.HISTORY_EDITED
        assert got.reason.text == (
            "the last model-authored turn is a captured call's output, but the history before "
            "it was edited"
        )
        assert got.mismatch["class"] == "history_edited"
        assert got.mismatch["parent_call_id"] == "p"
        # The same turn with other tool-call ids: named as such, not as a foreign turn.
        renamed = {**turn, "tool_calls": [{**turn["tool_calls"][0], "id": "toolu_9"}]}
        got = index.resolve("other", "q3", last_turn=renamed)
        assert got.reason.kind is ReasonKind.TOOL_CALL_IDS
        assert got.reason.text == (
            "the last model-authored turn equals a captured call's output but for its "
            "tool-call ids"
        )
        assert got.mismatch["parent_call_id"] == "p"
        foreign = {"role": "assistant", "content": "never said"}
        assert index.resolve("other", "q4", last_turn=foreign).reason.kind is ReasonKind.NO_MATCH

    def test_prefix_ancestor_is_the_deepest_token_exact_call_of_the_model(self):
        from capture_proxy.core.codec import token_digest

        def key(prompt, gen):
            p, g = np.asarray(prompt, np.uint32), np.asarray(gen, np.uint32)
            return {"num_tokens": len(prompt) + len(gen), "tokens_sha256": token_digest(p, g)}

        index = LinkIndex()
        index.add("a", 1.0, child_digest="da", request_digest="qa", model="m",
                  status="complete", **key([1, 2], [3]))
        index.add("b", 2.0, child_digest="db", request_digest="qb", model="m",
                  status="complete", **key([1, 2, 3, 4], [5]))
        index.add("c", 3.0, child_digest="dc", request_digest="qc", model="other",
                  status="complete", **key([1, 2, 3, 4, 5], [6]))
        prompt = np.asarray([1, 2, 3, 4, 5, 6, 7], np.uint32)
        assert index.prefix_ancestor(prompt, model="m", exclude="x") == "b"
        assert index.prefix_ancestor(prompt, model="other", exclude="x") == "c"
        assert index.prefix_ancestor(prompt[:3], model="m", exclude="x") == "a"
        assert index.prefix_ancestor(np.asarray([9], np.uint32), model="m", exclude="x") is None

    def test_source_history_refuses_note_parents(self):
        index = LinkIndex()
        index.add("note", 1.0, child_digest="d1", request_digest="q1", harness_note=True)
        assert index.resolve("d1", "q2").verdict is Verdict.RESOLVED
        res = index.resolve("d1", "q2", refuse_note_parents=True)
        assert res.verdict is Verdict.UNRESOLVED and res.reason.kind is ReasonKind.NOTE_PARENT
        assert res.reason.text == "parent prompt carried a rewritten harness note (source_history)"


def test_first_difference():
    a = np.array([1, 2, 3], dtype=np.uint32)
    assert first_difference(a, np.array([1, 2, 3, 4], dtype=np.uint32)) is None
    assert first_difference(a, np.array([1, 9, 3, 4], dtype=np.uint32)) == 1
    assert first_difference(a, np.array([1, 2], dtype=np.uint32)) == 2


P = np.array([10, 11, 12], dtype=np.uint32)
G = np.array([20, 21, 99], dtype=np.uint32)


@pytest.mark.parametrize(
    ("child", "texts", "reasoning", "expected"),
    [
        ([10, 11, 12, 20, 21, 99, 5], None, None, None),
        ([10, 13, 12, 20, 21, 99, 5], None, None, (1, MismatchClass.HISTORY_EDITED)),
        # Same text "p" + "ab" + "<e>", split differently: 20 21 -> 22.
        (
            [10, 11, 12, 22, 99, 5],
            DecodedTexts("p", "pab<e>", "pab<e>\nx"),
            None,
            (3, MismatchClass.RETOKENIZED),
        ),
        # Reasoning dropped by the template.
        (
            [10, 11, 12, 21, 99, 5],
            DecodedTexts("p", "p<think>r</think>ab<e>", "pab<e>\nx"),
            "r",
            (3, MismatchClass.TEMPLATE_RERENDERED),
        ),
        # Arguments re-serialised: text differs, no reasoning involved.
        (
            [10, 11, 12, 20, 23, 5],
            DecodedTexts("p", 'p{"a" : 1}', 'p{"a":1}'),
            None,
            (4, MismatchClass.TEMPLATE_RERENDERED),
        ),
        ([10, 11, 12, 20, 23, 5], None, None, (4, MismatchClass.TEMPLATE_RERENDERED)),
    ],
    ids=[
        "chains",
        "history-edited",
        "retokenized",
        "reasoning-dropped",
        "args-rerendered",
        "no-text",
    ],
)
def test_mismatch_classes(child, texts, reasoning, expected):
    got = classify_mismatch(
        P, G, np.array(child, dtype=np.uint32), texts=texts, parent_reasoning=reasoning
    )
    if expected is None:
        assert got is None
    else:
        assert (got.position, got.mismatch_class) == expected


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


def test_other_stop_token_at_the_end_is_named():
    # The parent stopped on <|endoftext|> (151643); the template closes turns with 151645.
    prompt = np.array([1, 2], dtype=np.uint32)
    gen = np.array([5, 151643], dtype=np.uint32)
    child = np.array([1, 2, 5, 151645, 198], dtype=np.uint32)
    got = classify_mismatch(prompt, gen, child)
    assert (got.position, got.mismatch_class) == (3, MismatchClass.TEMPLATE_RERENDERED)
    assert got.explanation == (
        "the parent stopped on token 151643; the template closes the turn with 151645"
    )


def test_extends_by_digest():
    from capture_proxy.core.codec import token_digest
    from capture_proxy.core.linking.digests import extends_by_digest

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


def test_link_index_replaces_what_it_knows_of_a_call_and_orders_matches():
    index = LinkIndex()
    index.add("c1", 1.0, child_digest=None, request_digest="req")  # the request arrived
    assert index.resolve(None, "req", retry_requested=True).retry_of == "c1"
    index.add("c1", 1.0, child_digest="d1", request_digest="req", status="complete")  # stored
    index.add("c2", 2.0, child_digest="d1", request_digest="req", status="complete", retry_of="c1")
    got = index.resolve("d1", "req", retry_requested=True)
    assert (got.verdict, got.parent_call_id, got.retry_of) == (Verdict.RESOLVED, "c2", "c2")
    index.add("c2", 2.0, child_digest="d2", request_digest="other", status="complete")
    got = index.resolve("d1", "other", retry_requested=True)
    assert (got.parent_call_id, got.retry_of) == ("c1", "c2")
    assert index.resolve("d2", "req").parent_call_id == "c2"
    assert index.resolve("d3", "new").verdict is Verdict.UNRESOLVED
    assert len(index.entries) == 2
