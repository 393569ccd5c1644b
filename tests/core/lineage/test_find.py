"""Lineage edges between the chains of a rollout: each harness scenario gives exactly the
expected edge with its evidence; unrelated sessions stay unjoined; the order of the records
does not matter."""

from __future__ import annotations

import json
import random
from typing import Any

from capture_proxy.core.chains import build_chains
from capture_proxy.core.lineage import LineageKind, LineageRules, find_lineage
from capture_proxy.core.lineage.find import count_by_kind
from capture_proxy.core.lineage.messages import text_sha256
from capture_proxy.core.records import CallRecord, CallStatus
from harness_notes.claude_code import INTERRUPTED_TURN_TEXT
from harness_notes.codex import SUMMARY_PREFIX
from tests.factories import record

TASK = "Fix the failing test in tests/test_math.py and run the suite."
SUB_PROMPT = (
    "Search the repository for every caller of parse_config and list the files with line "
    "numbers; do not edit anything."
)
SUMMARY_BODY = (
    "The user asked to fix the failing test. I read tests/test_math.py, found the off-by-one "
    "in add(), fixed it and the suite passes except one slow test."
)


def user(text: str | list[str]) -> dict[str, Any]:
    if isinstance(text, list):
        return {"role": "user", "content": [{"type": "text", "text": t} for t in text]}
    return {"role": "user", "content": text}


def assistant(text: str | None = None, calls: list[tuple[str, str, dict[str, Any]]] = ()):  # type: ignore[assignment]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in calls
        ]
    return message


def tool(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def call(
    call_id: str,
    created_at: float,
    prompt: list[int],
    generation: list[int],
    messages: list[dict[str, Any]],
    answer: dict[str, Any],
    retry_of: str | None = None,
) -> CallRecord:
    r = record(call_id, prompt, generation, created_at=created_at)
    r.request_messages = messages
    r.response_message = answer
    r.retry_of = retry_of
    return r


SYSTEM = {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.328.a1f;"}
FORK_SYSTEM = {
    "role": "system",
    "content": "x-anthropic-billing-header: cc_version=2.1.328.9c2; cc_is_subagent=true;",
}


def lineage_of(records: list[CallRecord]) -> dict[str, list[dict[str, Any]]]:
    chains = build_chains("r1", records)
    return {k: [e.to_json() for e in v] for k, v in find_lineage(chains).items()}


def main_turn() -> CallRecord:
    answer = assistant(None, [("toolu_1", "Agent", {"description": "find", "prompt": SUB_PROMPT})])
    return call("m1", 1.0, [1, 2, 3], [4, 5], [SYSTEM, user(TASK)], answer)


def test_a_sub_agent_is_spawned_by_the_call_of_its_agent_tool() -> None:
    sub = call(
        "s1",
        2.0,
        [100, 101],
        [102],
        [
            {"role": "system", "content": "sub"},
            user(["<system-reminder>x</system-reminder>", SUB_PROMPT]),
        ],
        assistant("found 3 callers"),
    )
    assert lineage_of([main_turn(), sub]) == {
        "s1": [
            {
                "kind": "spawned_by",
                "chain_id": "m1",
                "from_call_id": "m1",
                "evidence": {
                    "rule": "claude_code.spawn_tool",
                    "tool_name": "Agent",
                    "tool_call_id": "toolu_1",
                    "field": "prompt",
                    "message_index": 1,  # after the system message
                    "text_sha256": text_sha256(SUB_PROMPT),
                    "num_chars": len(SUB_PROMPT),
                },
            }
        ]
    }


def test_two_identical_sub_agents_take_one_tool_call_each_in_order() -> None:
    agent = {"description": "find", "prompt": SUB_PROMPT}
    m1 = call(
        "m1",
        1.0,
        [1, 2, 3],
        [4, 5],
        [user(TASK)],
        assistant(None, [("toolu_a", "Agent", agent), ("toolu_b", "Agent", agent)]),
    )
    subs = [
        call(f"s{i}", 2.0 + i, [100 + 10 * i], [101], [user(SUB_PROMPT)], assistant("done"))
        for i in (1, 2)
    ]
    edges = lineage_of([m1, *subs])
    assert {
        k: (v[0]["from_call_id"], v[0]["evidence"]["tool_call_id"]) for k, v in edges.items()
    } == {
        "s1": ("m1", "toolu_a"),
        "s2": ("m1", "toolu_b"),
    }


def test_a_fork_is_found_by_its_replayed_history_and_marker() -> None:
    # as Claude Code 2.1.328 forks: the parent's turn replayed as the fork's own tool call
    # alone (no text, no thinking, not the turn's other tool calls)
    m1 = main_turn()
    other = {"id": "toolu_2", "type": "function", "function": {"name": "Read", "arguments": "{}"}}
    m1.response_message = {  # type: ignore[assignment]
        **m1.response_message,  # type: ignore[dict-item]
        "content": "Forking.",
        "reasoning_content": "I will fork.",
        "tool_calls": [*m1.response_message["tool_calls"], other],  # type: ignore[index]
    }
    replayed = {
        "role": "assistant",
        "content": None,
        "tool_calls": m1.response_message["tool_calls"][:1],
    }
    fork = call(
        "f1",
        2.0,
        [1, 2, 9, 9],
        [10],
        [
            FORK_SYSTEM,
            user(TASK),
            replayed,
            tool("toolu_1", "Fork started \u2014 that fork is you."),
            user("<fork-boilerplate>You are a fork.</fork-boilerplate>"),
        ],
        assistant("fork working"),
    )
    assert lineage_of([m1, fork])["f1"] == [
        {
            "kind": "forked_from",
            "chain_id": "m1",
            "from_call_id": "m1",
            "evidence": {
                "rule": "claude_code.fork_marker",
                "num_messages": 2,
                "common_prefix_tokens": 2,
                "marker": "Fork started \u2014 that fork is you.",
                "message_index": 3,  # in request_messages
            },
        }
    ]


def test_a_claude_code_compaction_comes_from_the_summary_call() -> None:
    m1 = call("m1", 1.0, [1, 2, 3], [4, 5], [user(TASK)], assistant("I fixed add()."))
    summary = call(
        "m2",
        2.0,
        [1, 2, 3, 4, 5, 6],
        [7],
        [user(TASK), assistant("I fixed add()."), user("Summarise the conversation.")],
        assistant(f"<analysis>notes</analysis>\n<summary>\n{SUMMARY_BODY}\n</summary>"),
    )
    after = call(
        "c1",
        3.0,
        [1, 50, 51],
        [52],
        [SYSTEM, user(f"This session is being continued.\nSummary:\n{SUMMARY_BODY}\n\nGo on.")],
        assistant("continuing"),
    )
    assert lineage_of([m1, summary, after]) == {
        "c1": [
            {
                "kind": "compacted_from",
                "chain_id": "m1",
                "from_call_id": "m2",
                "evidence": {
                    "rule": "claude_code.summary_tags",
                    "message_index": 1,
                    "text_sha256": text_sha256(SUMMARY_BODY),
                    "num_chars": len(SUMMARY_BODY),
                    "replaces_chain_id": "m1",
                },
            }
        ]
    }


def test_a_codex_compaction_carries_the_summary_after_its_prefix() -> None:
    summary = call(
        "m1", 1.0, [1, 2, 3], [4, 5], [user(TASK), user("compact")], assistant(SUMMARY_BODY)
    )
    after = call(
        "c1",
        2.0,
        [60, 61],
        [62],
        [user(TASK), user(f"{SUMMARY_PREFIX} Here is the summary:\n{SUMMARY_BODY}")],
        assistant("ok"),
    )
    # the prefix rule takes the text after the declared prefix; here more text follows the
    # prefix than the answer, so only the generic rules match: the whole answer is inside
    edges = lineage_of([summary, after])
    assert [(e["kind"], e["from_call_id"], e["evidence"]["rule"]) for e in edges["c1"]] == [
        ("compacted_from", "m1", "generic.answer_text_inside")
    ]
    after.request_messages = [user(TASK), user(f"{SUMMARY_PREFIX}\n{SUMMARY_BODY}")]
    edges = lineage_of([summary, after])
    assert [(e["kind"], e["from_call_id"], e["evidence"]["rule"]) for e in edges["c1"]] == [
        ("compacted_from", "m1", "codex.summary_prefix")
    ]
    assert edges["c1"][0]["evidence"]["message_index"] == 1
    # as Codex sends it: developer messages first, left out of the comparison; the index
    # still names the message in request_messages
    developer = {"role": "developer", "content": "You are Codex."}
    after.request_messages = [developer, *after.request_messages]
    edges = lineage_of([summary, after])
    assert edges["c1"][0]["evidence"]["rule"] == "codex.summary_prefix"
    assert edges["c1"][0]["evidence"]["message_index"] == 2


def test_a_resumed_session_replays_the_whole_conversation_of_a_chains_last_call() -> None:
    a1 = call("a1", 1.0, [1, 2], [3], [SYSTEM, user(TASK)], assistant("step 1"))
    a2 = call(
        "a2",
        2.0,
        [1, 2, 3, 4],
        [5],
        [SYSTEM, user(TASK), assistant("step 1"), user("next")],
        assistant("step 2"),
    )
    resumed = call(
        "r1",
        3.0,
        [1, 7, 8],
        [9],
        [
            FORK_SYSTEM,
            user(TASK),
            assistant("step 1"),
            user("next"),
            assistant("step 2"),
            user("go on"),
        ],
        assistant("step 3"),
    )
    edges = lineage_of([a1, a2, resumed])
    assert edges == {
        "r1": [
            {
                "kind": "resumed_from",
                "chain_id": "a1",
                "from_call_id": "a2",
                "evidence": {
                    "rule": "generic.history_replayed",
                    "num_messages": 4,
                    "common_prefix_tokens": 1,
                    "next_role": "user",
                },
            }
        ]
    }


def test_a_history_that_leaves_a_chain_midway_is_a_branch() -> None:
    a1 = call("a1", 1.0, [1, 2], [3], [user(TASK)], assistant("step 1"))
    a2 = call(
        "a2",
        2.0,
        [1, 2, 3, 4],
        [5],
        [user(TASK), assistant("step 1"), user("next")],
        assistant("x"),
    )
    other = call(
        "b1",
        3.0,
        [20, 21],
        [22],
        [user(TASK), assistant("step 1"), user("other way")],
        assistant("y"),
    )
    edges = lineage_of([a1, a2, other])
    assert [(e["kind"], e["from_call_id"], e["evidence"]["rule"]) for e in edges["b1"]] == [
        ("forked_from", "a1", "generic.history_branch")
    ]


def test_unrelated_sessions_with_one_task_stay_unjoined() -> None:
    records = []
    for s in range(3):  # parallel samples of one task, two turns each
        base = 1000 * (s + 1)
        first = assistant(None, [(f"call_{s}", "bash", {"command": "pytest -q"})])
        records.append(call(f"s{s}a", 1.0 + s, [base], [base + 1], [user(TASK)], first))
        history = [user(TASK), first, tool(f"call_{s}", "1 failed")]
        records.append(
            call(
                f"s{s}b",
                5.0 + s,
                [base, base + 1, base + 2],
                [base + 3],
                history,
                assistant("done"),
            )
        )
    chains = build_chains("r1", records)
    assert len(chains.chains) == 3
    assert find_lineage(chains) == {}


def continued(parent: CallRecord, call_id: str, created_at: float) -> CallRecord:
    prompt = [*parent.prompt_token_ids.tolist(), *parent.generation_token_ids.tolist(), 99]
    history = [*parent.request_messages, parent.response_message, user("next")]
    return call(call_id, created_at, prompt, [98], history, assistant("more"))  # type: ignore[list-item]


def test_a_root_retrying_a_call_of_another_chain_is_retried_from_it() -> None:
    # both attempts went on (each has a child), so both stay in chains: an episode retried
    a1 = call("a1", 1.0, [1, 2], [3], [user(TASK)], assistant("step 1"))
    again = call("a9", 2.0, [40, 41], [42], [user(TASK)], assistant("step 1'"), retry_of="a1")
    children = [continued(a1, "a2", 3.0), continued(again, "a10", 4.0)]
    assert lineage_of([a1, again, *children]) == {
        "a9": [
            {
                "kind": "retried_from",
                "chain_id": "a1",
                "from_call_id": "a1",
                "evidence": {"rule": "retry_of"},
            }
        ]
    }


def test_generic_rules_for_undeclared_harnesses() -> None:
    long_task = (
        "Write a migration that adds an index on calls(rollout_id, depth) and a test for it."
    )
    m1 = call(
        "m1",
        1.0,
        [1, 2],
        [3],
        [user(TASK)],
        assistant(None, [("c1", "spawn_worker", {"instructions": long_task, "tag": "w"})]),
    )
    worker = call("w1", 2.0, [70], [71], [user(long_task)], assistant(SUMMARY_BODY))
    # OpenCode-style compaction: the next root holds the summary call's answer as a message
    resumed = call(
        "n1", 3.0, [80], [81], [user(TASK), assistant(SUMMARY_BODY), user("go on")], assistant("k")
    )
    edges = lineage_of([m1, worker, resumed])
    assert [
        (k, e["kind"], e["from_call_id"], e["evidence"]["rule"])
        for k, v in edges.items()
        for e in v
    ] == [
        ("w1", "spawned_by", "m1", "generic.tool_input_text"),
        ("n1", "compacted_from", "w1", "generic.answer_text_carried"),
    ]
    assert count_by_kind(find_lineage(build_chains("r1", [m1, worker, resumed]))) == {
        "spawned_by": 1,
        "forked_from": 0,
        "compacted_from": 1,
        "resumed_from": 0,
        "resumed_after_interrupt": 0,
        "retried_from": 0,
    }


def test_short_inputs_of_undeclared_tools_and_later_calls_are_no_evidence() -> None:
    m1 = call(
        "m1",
        1.0,
        [1],
        [2],
        [user(TASK)],
        assistant(None, [("c1", "grep", {"pattern": "parse_config"})]),
    )
    sub = call("s1", 2.0, [30], [31], [user("parse_config")], assistant("x"))
    assert lineage_of([m1, sub]) == {}
    # a tool call received after the root cannot have spawned it
    early = call("s0", 0.5, [30], [31], [user(SUB_PROMPT)], assistant("x"))
    assert lineage_of([main_turn(), early]) == {}
    rules = LineageRules(declarations=())
    assert find_lineage(build_chains("r1", [main_turn(), early]), rules) == {}


def test_edges_do_not_depend_on_the_order_of_the_records() -> None:
    sub = call("s1", 2.0, [100], [101], [user(SUB_PROMPT)], assistant("done"))
    a1 = call("a1", 3.0, [1000], [3], [user("other")], assistant("step 1"))
    again = call("a9", 4.0, [40, 41], [42], [user("other")], assistant("z"), retry_of="a1")
    records = [main_turn(), sub, a1, again, continued(a1, "a2", 5.0), continued(again, "a10", 6.0)]
    expected = lineage_of(records)
    assert set(expected) == {"s1", "a9"}
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(records)
        assert lineage_of(records) == expected
    assert LineageKind("spawned_by") is LineageKind.SPAWNED_BY


def test_an_answer_carried_inside_other_text_is_compacted_from() -> None:
    summary_call = call("s1", 1.0, [1, 2], [3], [user(TASK)], assistant(SUMMARY_BODY))
    later = call(
        "x1",
        1.5,
        [40],
        [41],
        [user("Unrelated question about the weather.")],
        assistant("It is sunny in the forecast for the whole of the coming week."),
    )
    carried = f"Summary of the earlier conversation: {SUMMARY_BODY} Continue from there."
    root = call("n1", 2.0, [80], [81], [user(carried)], assistant("ok"))
    edges = lineage_of([summary_call, later, root])
    assert edges == {
        "n1": [
            {
                "kind": "compacted_from",
                "chain_id": "s1",
                "from_call_id": "s1",
                "evidence": {
                    "rule": "generic.answer_text_inside",
                    "message_index": 0,
                    "text_sha256": text_sha256(SUMMARY_BODY),
                    "num_chars": len(SUMMARY_BODY),
                    "replaces_chain_id": "s1",
                },
            }
        ]
    }


def test_a_short_common_answer_inside_a_message_joins_nothing() -> None:
    first = call("a1", 1.0, [1, 2], [3], [user(TASK)], assistant("Done."))
    second = call(
        "b1",
        2.0,
        [80],
        [81],
        [user("Earlier the assistant said: Done. Now add docs.")],
        assistant("ok"),
    )
    assert lineage_of([first, second]) == {}


def test_two_unrelated_sessions_are_not_joined() -> None:
    one = call("a1", 1.0, [1, 2], [3], [user(TASK)], assistant(SUMMARY_BODY))
    other_text = (
        "Summary of the earlier conversation: the user wanted a README for the CLI; I wrote "
        "one with usage examples and a section on configuration files."
    )
    two = call("b1", 2.0, [80], [81], [user(other_text)], assistant("ok"))
    assert lineage_of([one, two]) == {}


ENVIRONMENT = {"role": "system", "content": "# Environment\nPrimary working directory: /w/p"}


def test_a_session_resumed_after_a_lost_turn_is_resumed_after_the_lost_call() -> None:
    # trial 11, finding 4: Claude Code was killed while the model wrote a tool call; `claude
    # --continue "Now say hello."` sends the lost call's request, "No response requested." in
    # its answer's place (the model never wrote it), then the new prompt
    lost = call(
        "k1",
        1.0,
        [1, 2, 3, 4],
        [5, 6],
        [SYSTEM, user("Read the notes."), ENVIRONMENT],
        assistant(None, [("toolu_1", "Bash", {"command": "cat notes.txt"})]),
    )
    resumed = call(
        "k2",
        2.0,
        [1, 2, 3, 4, 7, 8],
        [9],
        [
            SYSTEM,
            user("Read the notes."),
            ENVIRONMENT,
            assistant(INTERRUPTED_TURN_TEXT),
            user("Now say hello."),
        ],
        assistant("Hello."),
    )
    assert lineage_of([lost, resumed]) == {
        "k2": [
            {
                "kind": "resumed_after_interrupt",
                "chain_id": "k1",
                "from_call_id": "k1",
                "evidence": {
                    "rule": "claude_code.interrupted_turn",
                    "num_messages": 1,
                    "common_prefix_tokens": 4,
                    "marker": INTERRUPTED_TURN_TEXT,
                    "message_index": 3,  # in request_messages
                },
            }
        ]
    }
    assert (
        count_by_kind(find_lineage(build_chains("r1", [lost, resumed])))["resumed_after_interrupt"]
        == 1
    )


def test_a_lost_turn_deeper_in_a_session_is_the_longest_replayed_request() -> None:
    # the session answered once (a1), then lost its second turn (a2); the resumed request
    # replays a2's whole request with the placeholder where a2's answer was
    a1 = call("a1", 1.0, [1, 2], [3], [user(TASK)], assistant("step 1"))
    a2 = continued(a1, "a2", 2.0)
    placeholder = assistant(INTERRUPTED_TURN_TEXT)
    resumed = call(
        "r1", 3.0, [1, 7], [8], [*a2.request_messages, placeholder, user("go on")], assistant("k")
    )
    edges = lineage_of([a1, a2, resumed])
    assert [(e["kind"], e["from_call_id"], e["evidence"]["num_messages"]) for e in edges["r1"]] == [
        ("resumed_after_interrupt", "a2", 3)
    ]
    assert edges["r1"][0]["chain_id"] == "a1"  # a2 is a1's token child: one chain


def test_a_later_resume_continues_the_call_it_replays_not_an_early_lost_turn() -> None:
    # k1 lost its turn; k2 resumed it (the placeholder in its history) and went on to k3.
    # k4 replays k3's whole conversation and asks more: it resumes k3's chain, although its
    # history holds k1's placeholder too (review: it was joined to k1)
    placeholder = assistant(INTERRUPTED_TURN_TEXT)
    k1 = call("k1", 1.0, [1, 2], [3], [user(TASK)], assistant("partial"))
    k2 = call("k2", 2.0, [1, 2, 4, 5], [6], [user(TASK), placeholder, user("go on")],
              assistant("step 2"))  # fmt: skip
    k3 = continued(k2, "k3", 3.0)
    assert k3.response_message is not None
    k4 = call("k4", 4.0, [9, 9], [8],
              [*k3.request_messages, k3.response_message, user("and then?")],
              assistant("end"))  # fmt: skip
    edges = lineage_of([k1, k2, k3, k4])
    assert [(e["kind"], e["from_call_id"]) for e in edges["k2"]] == [
        ("resumed_after_interrupt", "k1")
    ]
    assert [(e["kind"], e["from_call_id"], e["chain_id"]) for e in edges["k4"]] == [
        ("resumed_from", "k3", "k2")
    ]


def test_a_placeholder_after_no_captured_request_joins_nothing() -> None:
    other = call("a1", 1.0, [1, 2], [3], [user("Read the notes.")], assistant("done"))
    placeholder = assistant(INTERRUPTED_TURN_TEXT)
    # another request before it than any captured one
    root = call("r1", 2.0, [4], [5], [user("Read it."), placeholder, user("hi")], assistant("x"))
    assert lineage_of([other, root]) == {}
    # the placeholder as the last message (a prefill, not a resumed turn)
    root.request_messages = [user("Read the notes."), placeholder]
    assert lineage_of([other, root]) == {}
    # the same text written by the model is its answer: the history replays it (resumed_from)
    root.request_messages = [user("Read the notes."), assistant("done"), user("hi")]
    assert [e["kind"] for e in lineage_of([other, root])["r1"]] == ["resumed_from"]


def test_a_lost_turn_stored_incomplete_is_in_no_chain_so_the_history_rule_joins_its_parent() -> (
    None
):
    # the proxy saw the harness leave: the lost call a2 is incomplete (unlinked). The resumed
    # root replays a1's conversation, the tool result, then the placeholder: no chain holds
    # a2's request, so the lost-turn rule finds nothing and the history rule joins a1
    call_1 = ("toolu_1", "Bash", {"command": "ls"})
    a1 = call("a1", 1.0, [1, 2], [3], [user(TASK)], assistant(None, [call_1]))
    history = [user(TASK), assistant(None, [call_1]), tool("toolu_1", "notes.txt")]
    a2 = call("a2", 2.0, [1, 2, 3, 4], [5], history, assistant("partial"))
    a2.status = CallStatus.INCOMPLETE
    placeholder = assistant(INTERRUPTED_TURN_TEXT)
    resumed = call("r1", 3.0, [1, 9], [8], [*history, placeholder, user("go on")], assistant("k"))
    edges = lineage_of([a1, a2, resumed])
    assert [(e["kind"], e["from_call_id"], e["evidence"]["rule"]) for e in edges["r1"]] == [
        ("forked_from", "a1", "generic.history_replayed")
    ]
    a2.status = CallStatus.COMPLETE  # stored complete: the lost call itself
    edges = lineage_of([a1, a2, resumed])
    assert [(e["kind"], e["from_call_id"]) for e in edges["r1"]] == [
        ("resumed_after_interrupt", "a2")
    ]
