"""Request bodies parsed from the bytes their history does not repeat (``core.known_bodies``).

The oracle is ``json_bodies.parse_json_object``, the whole parse the proxy did before and
still does for any body the incremental read leaves to it: for every pair of requests (an
earlier one kept, a later one read), the later one's value must be exactly the whole parse's
(the same values, the same types: ``1``, ``1.0`` and ``true`` told apart, the same key order)
or the same InvalidRequest. And on an agent's session the read must take the repeated history
from the earlier body (else the work is for nothing)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_proxy.core import chunk_scan, known_bodies
from capture_proxy.core.fronts.chat import ChatCodec
from capture_proxy.core.json_bodies import InvalidRequest, parse_json_object
from capture_proxy.core.known_bodies import KnownBodies
from capture_proxy.core.known_messages import KnownMessages

needs_scan = pytest.mark.skipif(
    chunk_scan.SCAN_HISTORY is None, reason="the compiled scan is not built"
)


def _whole(raw: bytes) -> tuple[str, Any]:
    """What the whole parse gives: ("ok", value) or ("error", message, param)."""
    try:
        return "ok", parse_json_object(raw)
    except InvalidRequest as exc:
        return "error", (str(exc), exc.param)


def _read(bodies: KnownBodies, raw: bytes, name: str = "messages") -> tuple[str, Any]:
    try:
        return "ok", bodies.parse(raw, "rollout-1", name).body
    except InvalidRequest as exc:
        return "error", (str(exc), exc.param)


def _typed(value: Any) -> Any:
    """``value`` with every type and key order spelled out (``1``, ``1.0``, ``True`` and
    ``-0.0``, ``0.0`` told apart, which ``==`` does not)."""
    if isinstance(value, dict):
        return ("dict", [(k, _typed(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [_typed(v) for v in value])
    return (type(value).__name__, repr(value))


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    """The same outcome: equal errors, or values equal with their types and key order."""
    if a[0] != b[0]:
        return False
    if a[0] == "error":
        return bool(a[1] == b[1])
    return bool(_typed(a[1]) == _typed(b[1]))


def _session(turns: int) -> list[bytes]:
    """The bodies of one coding session as an OpenAI SDK writes them (compact JSON, the
    history first, tools after it): system, user, then a tool call and its result per turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coder.\n" * 40},
        {"role": "user", "content": "Read every module and sum up. ü ✓"},
    ]
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    out = []
    for i in range(turns):
        out.append(
            orjson.dumps({"model": "m", "messages": messages, "tools": tools, "temperature": 0.5})
        )
        call = {"id": f"call_{i}", "type": "function"}
        call["function"] = {"name": "read", "arguments": json.dumps({"path": f"m{i}.py"})}
        messages = [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"def f{i}():\n  return {i}"},
        ]
    return out


@needs_scan
def test_a_session_reads_only_its_new_messages() -> None:
    bodies = KnownBodies()
    raws = _session(6)
    reads = [bodies.parse(raw, "rollout-1", "messages") for raw in raws]
    # call 1: no earlier body; call 2 has a key of its own (two messages: the first had
    # them too, but call 2 repeats them and adds); from then on, all but the new two
    assert [r.repeated for r in reads] == [0, 2, 4, 6, 8, 10]
    for raw, read in zip(raws, reads, strict=True):
        assert _same(("ok", read.body), _whole(raw))
    # the repeated messages are the earlier body's own objects, so are the tools after them
    assert reads[5].body["messages"][9] is reads[4].body["messages"][9]
    assert reads[5].body["tools"] is reads[4].body["tools"]
    # each call replaced the body it extended: one kept for the session
    assert len(bodies) == 1
    first_two = orjson.loads(raws[0])["messages"]
    key = orjson.dumps({"model": "m", "messages": first_two})[: -len(b"]}")]
    assert raws[5].startswith(key)
    assert bodies.kept_bytes == 2 * len(raws[5]) + len(key)


@needs_scan
def test_the_chat_front_takes_the_repeated_messages_facts() -> None:
    bodies, known, codec = KnownBodies(), KnownMessages(), ChatCodec()
    facts = []
    for raw in _session(4):
        read = bodies.parse(raw, "rollout-1", "messages")
        parsed = codec.parse(read.body, known=known, history=read)
        read.keep_facts(parsed.chat.get("messages"), parsed.message_facts)
        assert parsed.message_facts is not None
        facts.append(parsed.message_facts)
    assert facts[3][:6] == facts[2][:6]  # (the very objects: MessageFacts compare by identity)
    # the same facts as derived afresh from the whole parse
    fresh = KnownMessages().facts(parse_json_object(_session(4)[3])["messages"])
    assert [(f.text, f.sha256, f.turn) for f in facts[3]] == [
        (f.text, f.sha256, f.turn) for f in fresh
    ]
    assert all(f.valid for f in facts[3])


@needs_scan
@pytest.mark.parametrize(
    ("earlier", "later"),
    [
        # a number the later body continues: the element is not the earlier one's
        (b'{"messages":[{"a":1},{"b":2},3]}', b'{"messages":[{"a":1},{"b":2},34]}'),
        (b'{"messages":[{"a":1},{"b":2},3]}', b'{"messages":[{"a":1},{"b":2},3.5]}'),
        (b'{"messages":[{"a":1},{"b":2},3]}', b'{"messages":[{"a":1},{"b":2},3e5]}'),
        # a 19-digit integer after the repeated history: the stdlib keeps it exact
        (
            b'{"messages":[{"a":1},{"b":2}]}',
            b'{"messages":[{"a":1},{"b":2},{"n":18446744073709551616}]}',
        ),
        # a member named twice (the last wins), after and before the history
        (b'{"messages":[{"a":1},{"b":2}],"x":1}', b'{"messages":[{"a":1},{"b":2}],"x":1,"x":2}'),
        (b'{"x":1,"messages":[{"a":1},{"b":2}]}', b'{"x":1,"messages":[{"a":1},{"b":2}],"x":2}'),
        # the history named twice: the last array is the history
        (b'{"messages":[{"a":1},{"b":2}]}', b'{"messages":[{"a":1},{"b":2}],"messages":[7]}'),
        # an escaped surrogate pair (an emoji as Python's json.dumps writes it), a lone one
        (b'{"messages":[{"a":1},{"b":2}]}', b'{"messages":[{"a":1},{"b":2},"\\ud83d\\ude00"]}'),
        (b'{"messages":[{"a":1},{"b":2}]}', b'{"messages":[{"a":1},{"b":2},"\\ud83d"]}'),
        # broken after the repeated history; the tail broken
        (b'{"messages":[{"a":1},{"b":2}]}', b'{"messages":[{"a":1},{"b":2},{"c":]}'),
        (b'{"messages":[{"a":1},{"b":2}],"t":[1]}', b'{"messages":[{"a":1},{"b":2}],"t":[1}'),
        (b'{"messages":[{"a":1},{"b":2}]}', b'{"messages":[{"a":1},{"b":2}]} x'),
        (b'{"messages":[{"a":1},{"b":2}]}', b'{"messages":[{"a":1},{"b":2}'),
        # whitespace between the elements, after the array; the history shortened
        (b'{"messages":[{"a":1},{"b":2}]}', b'{"messages":[{"a":1},{"b":2} ,\n {"c":3} ] }'),
        (b'{"messages":[{"a":1},{"b":2},{"c":3}]}', b'{"messages":[{"a":1},{"b":2}]}'),
        # deep nesting after the repeated history (refused by the whole parse's rule)
        (b'{"messages":[{"a":1},{"b":2}]}', b'{"messages":[{"a":1},{"b":2},' + b"[" * 300),
    ],
)
def test_edge_bodies_read_as_the_whole_parse(earlier: bytes, later: bytes) -> None:
    bodies = KnownBodies()
    assert _same(_read(bodies, earlier), _whole(earlier))
    assert _same(_read(bodies, later), _whole(later))


@needs_scan
def test_a_history_that_is_not_an_array_is_parsed_whole() -> None:
    bodies = KnownBodies()
    for raw in (b'{"input":"hello"}', b'{"input":[]}', b'{"model":"m"}', b"[1,2]"):
        outcome = _read(bodies, raw, "input")
        assert _same(outcome, _whole(raw))
    assert len(bodies) == 0


def test_without_the_compiled_scan_every_body_is_parsed_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(known_bodies, "SCAN_HISTORY", None)
    bodies = KnownBodies()
    raws = _session(3)
    for raw in raws:
        read = bodies.parse(raw, "rollout-1", "messages")
        assert read.repeated == 0 and read.kept is None
        assert _same(("ok", read.body), _whole(raw))
    assert len(bodies) == 0


@needs_scan
def test_kept_bodies_stay_within_their_bound() -> None:
    raws = _session(3)
    # each session's second and third calls: one key (the first two messages), one body
    # (the third replaced the second), counted twice its bytes, and the key's bytes
    first_two = orjson.loads(raws[0])["messages"]
    key = orjson.dumps({"model": "m", "messages": first_two})[: -len(b"]}")]
    per_session = 2 * len(raws[2]) + len(key)
    bound = 3 * per_session + len(raws[2])  # three sessions and most of a fourth's body
    bodies = KnownBodies(max_bytes=bound, per_key=2)
    for rollout in range(10):  # ten sessions: the oldest keys go
        for raw in raws[1:]:
            bodies.parse(raw, f"rollout-{rollout}", "messages")
            assert bodies.kept_bytes <= bound
    assert len(bodies) == 3 and bodies.kept_bytes == 3 * per_session
    # branches of one session: at most per_key kept under its key
    branches = KnownBodies(per_key=2)
    base = orjson.loads(raws[2])
    for i in range(5):
        body = {**base, "messages": [*base["messages"][:3], {"role": "user", "content": str(i)}]}
        branches.parse(orjson.dumps(body), "rollout-1", "messages")
    assert len(branches) == 2
    # a body larger than the bound is read, not kept
    tiny = KnownBodies(max_bytes=100)
    assert tiny.parse(raws[2], "rollout-1", "messages").kept is None
    assert len(tiny) == 0 and tiny.kept_bytes == 0


# --- generated bodies and edits -------------------------------------------------------------

_plain_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(min_value=-1e9, max_value=1e9).map(lambda f: round(f, 6))
    | st.text(max_size=8)
)
#: what the compiled scan leaves to the whole parse: 19-digit integers (the stdlib keeps them
#: exact), exponents of three digits
_odd_scalars = _plain_scalars | st.sampled_from(
    [2**64, -(2**63) - 1, 10**18, 1e-300, 5e-324, 1e300, -0.0]
)
#: member names: mostly plain (the compiled scan takes no escaped name: such a body is parsed
#: whole), some with anything in them
_keys = st.text(alphabet="abcdefgh_", max_size=4) | st.text(max_size=3)


def _json_values(scalars: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
        max_leaves=8,
    )


_plain_values = _json_values(_plain_scalars)
_odd_values = _json_values(_odd_scalars)
_names = st.sampled_from(["model", "tools", "n", "x", "stream"])
_members = st.dictionaries(_names, _plain_values, max_size=3)


def _dump(style: int, body: dict[str, Any]) -> bytes:
    """One of the ways harnesses write JSON: compact with UTF-8 (``JSON.stringify``, serde),
    the stdlib's default (ASCII escapes, surrogate pairs for emoji), and indented."""
    if style == 0:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    if style == 1:
        return json.dumps(body).encode()
    return json.dumps(body, indent=1, ensure_ascii=False).encode()


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """An earlier request and a later one of the same session: the later repeats some of the
    earlier history and may change what is around it."""
    _values = draw(st.sampled_from([_plain_values, _plain_values, _odd_values]))
    history = draw(st.lists(_values, min_size=0 if draw(st.booleans()) else 2, max_size=6))
    head, tail = draw(_members), draw(_members)
    head.pop("messages", None)
    tail = {k: v for k, v in tail.items() if k not in head}
    first = draw(st.integers(min(2, len(history)) if draw(st.booleans()) else 0, len(history)))
    later = list(history)
    if later and not draw(st.integers(0, 3)):
        later[draw(st.integers(0, len(later) - 1))] = draw(_values)  # history rewritten
    later += draw(st.lists(_values, max_size=3))
    later_tail = draw(_members) if draw(st.booleans()) else tail
    later_tail = {k: v for k, v in later_tail.items() if k not in head}
    style = draw(st.integers(0, 2))
    earlier_body = {**head, "messages": history[:first], **tail}
    later_body = {**head, "messages": later, **later_tail}
    return _dump(style, earlier_body), _dump(style, later_body)


@needs_scan
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_pairs())
def test_generated_sessions_read_as_the_whole_parse(pair: tuple[bytes, bytes]) -> None:
    earlier, later = pair
    bodies = KnownBodies()
    assert _same(_read(bodies, earlier), _whole(earlier))
    assert _same(_read(bodies, later), _whole(later))
    assert _same(_read(bodies, later), _whole(later))  # (read again: a retry)


@needs_scan
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_pairs(), st.data())
def test_damaged_later_bodies_read_as_the_whole_parse(
    pair: tuple[bytes, bytes], data: st.DataObject
) -> None:
    """Bytes changed, cut or put in anywhere in the later body: the same value or error."""
    earlier, later = pair
    damaged = bytearray(later)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(damaged)))
        byte = data.draw(st.sampled_from(b'{}[],:"\\0123456789.eE-+ \ntfnul\xc3\xff'))
        kind = data.draw(st.sampled_from(["put", "set", "cut"]))
        if kind == "put":
            damaged[at:at] = bytes([byte])
        elif at < len(damaged):
            if kind == "set":
                damaged[at] = byte
            else:
                del damaged[at]
    bodies = KnownBodies()
    _read(bodies, earlier)
    assert _same(_read(bodies, bytes(damaged)), _whole(bytes(damaged)))


@needs_scan
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(_plain_values, min_size=2, max_size=6),
    st.lists(_plain_values, max_size=3),
    _members,
    _members,
    st.integers(0, 2),
)
def test_appended_histories_are_read_from_the_earlier_body(
    history: list[Any], added: list[Any], head: dict[str, Any], tail: dict[str, Any], style: int
) -> None:
    """The common case, an agent's next call: the earlier history repeated, messages added.
    Every repeated element is taken from the earlier body wherever the scan reads both."""
    tail = {k: v for k, v in tail.items() if k not in head}
    earlier = _dump(style, {**head, "messages": history, **tail})
    later = _dump(style, {**head, "messages": [*history, *added], **tail})
    bodies = KnownBodies()
    first = bodies.parse(earlier, "rollout-1", "messages")
    read = bodies.parse(later, "rollout-1", "messages")
    assert _same(("ok", read.body), _whole(later))
    scan = chunk_scan.SCAN_HISTORY
    assert scan is not None
    if scan(earlier, b"messages", 0, 0, 0) is not None and scan(later, b"messages", 0, 0, 0):
        assert read.repeated == len(history)
        repeated = read.body["messages"][: len(history)]
        assert all(a is b for a, b in zip(repeated, first.body["messages"], strict=True))


@needs_scan
def test_a_sessions_branches_over_the_bound_keep_the_latest() -> None:
    """(kbreview) Where one key's branches together pass ``max_bytes``, its oldest branches
    go, not the key with the body just kept: that body stays kept and the next call of the
    session is read from it."""
    system = {"role": "system", "content": "s" * 100}
    user = {"role": "user", "content": "u"}

    def raw(*extra: dict[str, Any]) -> bytes:
        return orjson.dumps({"model": "m", "messages": [system, user, *extra]})

    one = raw({"role": "assistant", "content": "a" * 300})
    two = raw({"role": "assistant", "content": "b" * 300})
    bodies = KnownBodies(max_bytes=2 * len(one) + 2 * len(two) - 1 + 150, per_key=8)
    bodies.parse(one, "rollout-1", "messages")
    kept = bodies.parse(two, "rollout-1", "messages").kept
    assert kept is not None
    assert len(bodies) == 1 and 0 < bodies.kept_bytes <= bodies.max_bytes
    later = raw({"role": "assistant", "content": "b" * 300}, user)
    read = bodies.parse(later, "rollout-1", "messages")
    assert read.previous is kept and read.repeated == 3
    assert _same(("ok", read.body), _whole(later))
