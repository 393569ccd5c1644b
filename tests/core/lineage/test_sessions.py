"""Session evidence in lineage: the harness session a request names (Claude Code's
``metadata.user_id`` ``session_id``, Codex's ``prompt_cache_key``, OpenCode's ``x-session-id``
header) keeps edges inside one session where the harness does (a Claude Code sub-agent is its
spawner's session), joins an OpenCode sub-agent to the session its ``x-parent-session-id``
names, and prefers the root's session elsewhere; harnesses that name none keep the text rules.
Each test is a rollout of several sessions that hand out or replay the same texts, as
parallel samples of one task do (trial 11, finding 1)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from capture_proxy.core.lineage import LineageRules
from capture_proxy.core.lineage.messages import text_sha256
from capture_proxy.core.lineage.sessions import Rank, rank
from capture_proxy.core.records import CallRecord
from capture_proxy.core.sessions import (
    SESSION_HEADERS,
    Session,
    declared_headers,
    session_headers,
    session_of,
)
from harness_notes.claude_code import SESSION as CLAUDE_CODE
from harness_notes.codex import SESSION as CODEX
from harness_notes.codex import SUMMARY_PREFIX
from harness_notes.lineage import SessionField
from harness_notes.opencode import SESSION as OPENCODE
from tests.core.lineage.test_find import (
    FORK_SYSTEM,
    SUB_PROMPT,
    SUMMARY_BODY,
    SYSTEM,
    TASK,
    assistant,
    call,
    lineage_of,
    tool,
    user,
)

FIELDS = (CLAUDE_CODE, CODEX, OPENCODE)


def claude(session: str) -> dict[str, Any]:
    """A Claude Code request body as received (less ``messages``): its session in
    ``metadata.user_id``, a JSON string (as tests/fixtures/claude_code/*.jsonl)."""
    user_id = {"device_id": "a7783d94", "account_uuid": "", "session_id": session}
    return {"model": "fake-model", "metadata": {"user_id": json.dumps(user_id)}, "stream": True}


def codex(thread: str) -> dict[str, Any]:
    return {"model": "fake-model", "prompt_cache_key": thread, "store": False}


def in_session(record: CallRecord, received: dict[str, Any]) -> CallRecord:
    record.request_received = received
    return record


def edges(records: list[CallRecord]) -> dict[str, list[tuple[str, str, str | None]]]:
    """Per root: (kind, from_call_id, tool call id) of each edge."""
    return {
        k: [(e["kind"], e["from_call_id"], e["evidence"].get("tool_call_id")) for e in v]
        for k, v in lineage_of(records).items()
    }


# --- reading the session --------------------------------------------------------------------


def test_the_session_is_read_from_the_body_as_received() -> None:
    assert session_of(claude("s-1"), FIELDS) == Session(CLAUDE_CODE, "s-1")
    assert session_of(codex("019a-thread"), FIELDS) == Session(CODEX, "019a-thread")
    # an Anthropic client whose user_id is an opaque id, not JSON: no session
    assert session_of({"metadata": {"user_id": "user-42"}}, FIELDS) is None
    assert session_of({"metadata": {"user_id": '["s-1"]'}}, FIELDS) is None
    assert session_of({"metadata": {"user_id": '{"session_id": 7}'}}, FIELDS) is None
    assert session_of({"metadata": "x", "prompt_cache_key": ""}, FIELDS) is None
    assert session_of({"model": "m"}, FIELDS) is None  # OpenCode: its ids are headers
    assert session_of(None, FIELDS) is None  # a record from before request_received


def opencode(session: str, parent: str | None = None) -> dict[str, str]:
    """The session headers a record keeps of an OpenCode 1.18.33 request: ``x-session-id``,
    and on a ``task`` sub-agent's requests ``x-parent-session-id`` (the spawner's)."""
    headers = {"x-session-id": session}
    if parent is not None:
        headers["x-parent-session-id"] = parent
    return headers


def test_opencode_names_its_session_and_its_parent_session_in_headers() -> None:
    body = {"model": "m", "stream": True}  # OpenCode's body names no session
    assert session_of(body, FIELDS, headers=opencode("ses_a")) == Session(OPENCODE, "ses_a")
    sub = session_of(body, FIELDS, headers=opencode("ses_s", parent="ses_a"))
    assert sub == Session(OPENCODE, "ses_s", "ses_a")
    assert (sub.key, sub.parent_key) == (("opencode", "ses_s"), ("opencode", "ses_a"))
    assert session_of(body, FIELDS, headers={"x-parent-session-id": "ses_a"}) is None
    assert session_of(None, FIELDS, headers=opencode("ses_a")) == Session(OPENCODE, "ses_a")
    # a body that names a session is read first (Claude Code sends no x-session-id)
    assert session_of(claude("s-1"), FIELDS, headers=opencode("ses_a")).key == (
        "claude_code",
        "s-1",
    )


def test_a_record_keeps_only_the_declared_session_headers() -> None:
    assert {"x-session-id", "x-parent-session-id"} == SESSION_HEADERS
    sent = [
        ("Authorization", "Bearer sk-SECRET"),
        ("Content-Type", "application/json"),
        ("User-Agent", "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"),
        ("x-session-affinity", "ses_dd45e419dffe640t0DYpOs71VK"),
        ("X-Session-Id", "ses_dd45e419dffe640t0DYpOs71VK"),
        ("x-parent-session-id", " ses_dd45de78dffeTTfFBWKS8FIJch "),
        ("X-Claude-Code-Session-Id", "6b9c1d2e-0000-4000-8000-000000000000"),
        ("session-id", "019a-thread"),
    ]
    assert session_headers(sent) == {
        "x-parent-session-id": "ses_dd45de78dffeTTfFBWKS8FIJch",
        "x-session-id": "ses_dd45e419dffe640t0DYpOs71VK",
    }
    assert session_headers([("Authorization", "Bearer k")]) is None
    assert session_headers([]) is None


@pytest.mark.parametrize(
    "value",
    [
        "",
        "   ",
        "a" * 129,  # longer than MAX_SESSION_ID_CHARS
        "ses a",
        "ses_a\r\nx-evil: 1",
        "-leading-dash",
        "ses/../a",
        "s\u00e9ssion",
        '{"session_id": "a"}',
    ],
)
def test_a_session_header_that_is_no_plain_id_is_left_out(value: str) -> None:
    assert session_headers([("x-session-id", value), ("x-parent-session-id", "ses_p")]) == {
        "x-parent-session-id": "ses_p"
    }


def test_a_session_header_sent_twice_with_two_values_is_left_out() -> None:
    twice = [("x-session-id", "ses_a"), ("X-Session-Id", "ses_b"), ("x-session-id", "ses_a")]
    assert session_headers(twice) is None
    assert session_headers([("x-session-id", "ses_a"), ("X-SESSION-ID", "ses_a")]) == {
        "x-session-id": "ses_a"
    }
    assert session_headers([("x-session-id", "a" * 128)]) == {"x-session-id": "a" * 128}


def test_a_session_header_that_names_a_credential_is_refused() -> None:
    with pytest.raises(ValueError, match="'x-session-token' names a credential"):
        declared_headers((SessionField("h", header="x-session-token"),))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of a body path and a header"),
        ({"path": ("sid",), "header": "x-sid"}, "exactly one of a body path and a header"),
        ({"header": "X-Sid"}, "header 'X-Sid' is not lowercase"),
        ({"path": ("sid",), "parent_header": "x-parent"}, "a parent header needs a session"),
    ],
)
def test_a_session_field_reads_a_body_path_or_a_header(kwargs: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SessionField("h", **kwargs)


def test_rank_keeps_declared_kinds_inside_one_session() -> None:
    a, b = Session(CLAUDE_CODE, "a"), Session(CLAUDE_CODE, "b")
    assert rank("spawned_by", a, a) is Rank.SAME
    assert rank("spawned_by", a, b) is None  # Claude Code: a sub-agent is its spawner's
    assert rank("forked_from", a, b) is Rank.OTHER  # --continue --fork-session: may cross
    assert rank("spawned_by", a, None) is Rank.UNKNOWN
    assert rank("spawned_by", None, b) is Rank.UNKNOWN
    # another harness's session is another session
    assert rank("compacted_from", a, Session(CODEX, "a")) is None
    assert rank("compacted_from", Session(CODEX, "t1"), Session(CODEX, "t2")) is Rank.OTHER


def test_rank_takes_a_parent_sessions_kinds_from_the_parent_session_only() -> None:
    parent, twin = Session(OPENCODE, "ses_a"), Session(OPENCODE, "ses_b")
    sub = Session(OPENCODE, "ses_s", "ses_a")
    assert rank("spawned_by", sub, parent) is Rank.SAME
    assert rank("spawned_by", sub, twin) is None  # another session's task call: never
    assert rank("spawned_by", sub, sub) is None  # its own session did not spawn it
    assert rank("spawned_by", sub, None) is Rank.UNKNOWN  # a call stored before headers
    # other kinds compare the root's own session, and may cross (none declared to stay)
    assert rank("compacted_from", sub, Session(OPENCODE, "ses_s")) is Rank.SAME
    assert rank("compacted_from", sub, parent) is Rank.OTHER
    # a root that names no parent session: OpenCode's sub-agents run in sessions of their
    # own, so spawned_by may come from another session
    assert rank("spawned_by", Session(OPENCODE, "ses_s"), parent) is Rank.OTHER


def test_a_declared_kind_that_is_no_edge_kind_is_refused() -> None:
    field = SessionField("h", ("sid",), edge_kinds=frozenset({"spawned_from"}))
    with pytest.raises(ValueError, match="h session: no lineage edge kind 'spawned_from'"):
        LineageRules(declarations=(field,))
    field = SessionField("h", header="x-sid", parent_edge_kinds=frozenset({"spawned"}))
    with pytest.raises(ValueError, match="h session: no lineage edge kind 'spawned'"):
        LineageRules(declarations=(field,))


# --- sub-agents -----------------------------------------------------------------------------


def _main(call_id: str, created_at: float, session: str, ids: tuple[str, str]) -> CallRecord:
    agent = {"description": "find", "prompt": SUB_PROMPT}
    answer = assistant(None, [(ids[0], "Agent", agent), (ids[1], "Agent", agent)])
    record = call(call_id, created_at, [1, 2, 3], [4, 5], [SYSTEM, user(TASK)], answer)
    return in_session(record, claude(session))


def _sub(call_id: str, created_at: float, session: str) -> CallRecord:
    messages = [FORK_SYSTEM, user(["<system-reminder>x</system-reminder>", SUB_PROMPT])]
    record = call(call_id, created_at, [100], [101], messages, assistant("3 callers"))
    return in_session(record, claude(session))


def test_sub_agents_of_two_sessions_with_one_prompt_are_spawned_by_their_own_session() -> None:
    # trial 11: every session's main agent hands out the same two Agent prompts; session B's
    # sub-agents start before session A's. By text and arrival order alone, B's took A's tool
    # calls and A's took B's.
    records = [
        _main("mA", 1.0, "sess-a", ("toolu_a1", "toolu_a2")),
        _main("mB", 2.0, "sess-b", ("toolu_b1", "toolu_b2")),
        _sub("sB1", 3.0, "sess-b"),
        _sub("sB2", 4.0, "sess-b"),
        _sub("sA1", 5.0, "sess-a"),
        _sub("sA2", 6.0, "sess-a"),
    ]
    assert edges(records) == {
        "sB1": [("spawned_by", "mB", "toolu_b1")],
        "sB2": [("spawned_by", "mB", "toolu_b2")],
        "sA1": [("spawned_by", "mA", "toolu_a1")],
        "sA2": [("spawned_by", "mA", "toolu_a2")],
    }
    assert lineage_of(records)["sB1"] == [
        {
            "kind": "spawned_by",
            "chain_id": "mB",
            "from_call_id": "mB",
            "evidence": {
                "rule": "claude_code.spawn_tool",
                "tool_name": "Agent",
                "tool_call_id": "toolu_b1",
                "field": "prompt",
                "message_index": 1,
                "text_sha256": text_sha256(SUB_PROMPT),
                "num_chars": len(SUB_PROMPT),
                "session": "sess-b",
            },
        }
    ]


def test_a_sub_agent_whose_session_has_no_spawning_call_is_joined_to_no_other_session() -> None:
    # session B's main call is not in a chain (failed, say): its sub-agent is no one's
    records = [_main("mA", 1.0, "sess-a", ("toolu_a1", "toolu_a2")), _sub("sB1", 3.0, "sess-b")]
    assert edges(records) == {}
    # a sub-agent whose request names no session keeps the text rule
    records[1].request_received = {"model": "fake-model"}
    assert edges(records) == {"sB1": [("spawned_by", "mA", "toolu_a1")]}


OC_SYSTEM = {"role": "system", "content": "You are opencode, an interactive CLI tool."}
OC_SUB_SYSTEM = {"role": "system", "content": "You are a general-purpose sub-agent of opencode."}


def _oc_main(call_id: str, created_at: float, session: str, ids: tuple[str, str]) -> CallRecord:
    task = {"description": "find", "prompt": SUB_PROMPT, "subagent_type": "general"}
    answer = assistant("", [(ids[0], "task", task), (ids[1], "task", task)])
    record = call(call_id, created_at, [1, 2, 3], [4, 5], [OC_SYSTEM, user(TASK)], answer)
    record.session_headers = opencode(session)
    return record


def _oc_sub(call_id: str, created_at: float, session: str, parent: str | None) -> CallRecord:
    messages = [OC_SUB_SYSTEM, user(SUB_PROMPT)]
    record = call(call_id, created_at, [100], [101], messages, assistant("3 callers"))
    record.session_headers = opencode(session, parent)
    return record


def test_opencode_sub_agents_are_spawned_by_a_call_of_their_parent_session() -> None:
    # two OpenCode sessions of one task hand out the same two task prompts; each sub-agent
    # runs in a session of its own that names its spawner's in x-parent-session-id. Session
    # B's sub-agents start first: by text and arrival order alone they took A's tool calls.
    records = [
        _oc_main("mA", 1.0, "ses_a", ("call_a1", "call_a2")),
        _oc_main("mB", 2.0, "ses_b", ("call_b1", "call_b2")),
        _oc_sub("sB1", 3.0, "ses_b1", "ses_b"),
        _oc_sub("sB2", 4.0, "ses_b2", "ses_b"),
        _oc_sub("sA1", 5.0, "ses_a1", "ses_a"),
        _oc_sub("sA2", 6.0, "ses_a2", "ses_a"),
    ]
    assert edges(records) == {
        "sB1": [("spawned_by", "mB", "call_b1")],
        "sB2": [("spawned_by", "mB", "call_b2")],
        "sA1": [("spawned_by", "mA", "call_a1")],
        "sA2": [("spawned_by", "mA", "call_a2")],
    }
    assert lineage_of(records)["sB1"] == [
        {
            "kind": "spawned_by",
            "chain_id": "mB",
            "from_call_id": "mB",
            "evidence": {
                "rule": "opencode.spawn_tool",
                "tool_name": "task",
                "tool_call_id": "call_b1",
                "field": "prompt",
                "message_index": 1,
                "text_sha256": text_sha256(SUB_PROMPT),
                "num_chars": len(SUB_PROMPT),
                "parent_session": "ses_b",
            },
        }
    ]


def test_an_opencode_sub_agent_whose_parent_session_has_no_spawning_call_joins_no_other() -> None:
    # session B's main call is in no chain (failed, say): its sub-agent is no one's
    records = [
        _oc_main("mA", 1.0, "ses_a", ("call_a1", "call_a2")),
        _oc_sub("sB1", 3.0, "ses_b1", "ses_b"),
    ]
    assert edges(records) == {}
    # a sub-agent that names no parent session (a record kept before the headers were)
    # keeps the text rule, as does one whose spawner's call names no session
    records[1].session_headers = opencode("ses_b1")
    assert edges(records) == {"sB1": [("spawned_by", "mA", "call_a1")]}
    records[1].session_headers = opencode("ses_b1", "ses_a")
    records[0].session_headers = None
    assert edges(records) == {"sB1": [("spawned_by", "mA", "call_a1")]}
    assert "parent_session" not in lineage_of(records)["sB1"][0]["evidence"]


# --- forks, resumes, compactions ------------------------------------------------------------


def test_a_fork_replaying_twin_sessions_history_comes_from_its_own_session() -> None:
    # two token-identical sessions (one project dir, a deterministic engine): the same
    # history up to the Agent turn; session B's fork arrives first
    fork_call = (
        "toolu_f",
        "Agent",
        {"description": "f", "prompt": "check", "subagent_type": "fork"},
    )
    main_answer = assistant(None, [fork_call])
    history = [SYSTEM, user(TASK)]
    records = [
        in_session(call("mA", 1.0, [1, 2], [3], history, main_answer), claude("sess-a")),
        in_session(call("mB", 2.0, [1, 2], [3], history, main_answer), claude("sess-b")),
    ]
    replay = [
        FORK_SYSTEM,
        user(TASK),
        main_answer,
        tool("toolu_f", "Fork started \u2014 that fork is you."),
        user("<fork-boilerplate>You are a fork.</fork-boilerplate>"),
    ]
    for session, call_id, at in (("sess-b", "fB", 3.0), ("sess-a", "fA", 4.0)):
        record = call(call_id, at, [1, 9], [10], replay, assistant("fork working"))
        records.append(in_session(record, claude(session)))
    found = lineage_of(records)
    assert {k: (v[0]["kind"], v[0]["from_call_id"]) for k, v in found.items()} == {
        "fB": ("forked_from", "mB"),
        "fA": ("forked_from", "mA"),
    }
    assert found["fB"][0]["evidence"] == {
        "rule": "claude_code.fork_marker",
        "num_messages": 2,
        "common_prefix_tokens": 1,
        "marker": "Fork started \u2014 that fork is you.",
        "message_index": 3,
        "session": "sess-b",
    }
    # a session forked into a new one (claude --continue --fork-session): no call of its own
    # session replays that history, so the other session's is taken
    records[-1].request_received = claude("sess-c")
    assert lineage_of(records)["fA"][0]["from_call_id"] == "mA"
    assert "session" not in lineage_of(records)["fA"][0]["evidence"]


def test_a_codex_resume_prefers_its_own_thread_and_may_cross_to_another() -> None:
    # twin Codex threads answered alike; a later root of thread B replays the conversation
    history = [user(TASK)]
    records = [
        in_session(call("a1", 1.0, [1, 2], [3], history, assistant("step 1")), codex("t-a")),
        in_session(call("b1", 2.0, [1, 2], [3], history, assistant("step 1")), codex("t-b")),
    ]
    replayed = [user(TASK), assistant("step 1"), user("go on")]
    root = in_session(call("r1", 3.0, [5, 6], [7], replayed, assistant("ok")), codex("t-b"))
    assert edges([*records, root]) == {"r1": [("resumed_from", "b1", None)]}
    # a thread of its own (a forked thread): Codex declares no kind that stays in one
    root.request_received = codex("t-c")
    assert edges([*records, root]) == {"r1": [("resumed_from", "a1", None)]}


def _summary_call(call_id: str, at: float, session: str) -> CallRecord:
    messages = [user(TASK), assistant("I fixed add()."), user("Summarise the conversation.")]
    answer = assistant(f"<summary>\n{SUMMARY_BODY}\n</summary>")
    record = call(call_id, at, [1, 2, int(at)], [7], messages, answer)
    return in_session(record, claude(session))


def test_a_compaction_comes_from_its_own_sessions_summary_call() -> None:
    # two sessions compact alike; session A's next conversation starts after B's summary call
    carried = user(f"This session is being continued.\nSummary:\n{SUMMARY_BODY}\n\nGo on.")
    after = call("cA", 3.0, [1, 50], [52], [SYSTEM, carried], assistant("continuing"))
    records = [
        _summary_call("sA", 1.0, "sess-a"),
        _summary_call("sB", 2.0, "sess-b"),
        in_session(after, claude("sess-a")),
    ]
    assert lineage_of(records)["cA"] == [
        {
            "kind": "compacted_from",
            "chain_id": "sA",
            "from_call_id": "sA",
            "evidence": {
                "rule": "claude_code.summary_tags",
                "message_index": 1,
                "text_sha256": text_sha256(SUMMARY_BODY),
                "num_chars": len(SUMMARY_BODY),
                "replaces_chain_id": "sA",
                "session": "sess-a",
            },
        }
    ]
    # Claude Code keeps a compaction in its session: another session's summary is no origin
    records = [records[1], records[2]]
    assert lineage_of(records) == {}


def test_the_generic_compaction_rules_prefer_the_roots_thread() -> None:
    # Codex threads answered alike; thread A's compaction carries the summary after the prefix
    summary_a = in_session(
        call("a1", 1.0, [1], [2], [user(TASK)], assistant(SUMMARY_BODY)), codex("t-a")
    )
    summary_b = in_session(
        call("b1", 2.0, [1], [2], [user(TASK)], assistant(SUMMARY_BODY)), codex("t-b")
    )
    rebuilt = [user(TASK), user(f"{SUMMARY_PREFIX}\n{SUMMARY_BODY}")]
    after = in_session(call("c1", 3.0, [60], [61], rebuilt, assistant("ok")), codex("t-a"))
    found = lineage_of([summary_a, summary_b, after])["c1"][0]
    assert (found["from_call_id"], found["evidence"]["rule"]) == ("a1", "codex.summary_prefix")
    assert found["evidence"]["session"] == "t-a"
    # the whole answer inside other text (generic.answer_text_inside), and as a whole message
    after.request_messages = [user(f"Earlier: {SUMMARY_BODY} Now go on.")]
    found = lineage_of([summary_a, summary_b, after])["c1"][0]
    assert (found["from_call_id"], found["evidence"]["rule"]) == (
        "a1",
        "generic.answer_text_inside",
    )
    after.request_messages = [user("Pick up from here."), assistant(SUMMARY_BODY), user("go on")]
    found = lineage_of([summary_a, summary_b, after])["c1"][0]
    assert (found["from_call_id"], found["evidence"]["rule"]) == (
        "a1",
        "generic.answer_text_carried",
    )
