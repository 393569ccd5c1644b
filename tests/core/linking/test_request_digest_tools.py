"""``request_digest`` with the tools' sorted text known (``known_tools``): the same digest as the
formula before it, for every body (a property test against that formula, kept here), and the
exact values of a few bodies, the stdlib's fallback included."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.core.known_tools import KnownTools
from capture_proxy.core.linking.digests import (
    RequestDigestState,
    request_digest,
    request_digest_after,
)


def old_request_digest(body: dict[str, Any]) -> str:
    """The formula before ``tools_text``: SHA-256 of the canonical JSON (orjson with sorted
    keys, else the stdlib's sorted, compact, UTF-8 text) of the body less stream fields."""
    semantic = {
        k: v for k, v in body.items() if k not in {"stream", "stream_options", "user", "metadata"}
    }
    try:
        text = orjson.dumps(semantic, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        text = json.dumps(semantic, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _outcome(fn: Any, *args: Any) -> tuple[str, str]:
    try:
        return "digest", fn(*args)
    except Exception as exc:  # a lone surrogate in the stdlib's text: the same error either way
        return "error", type(exc).__name__


#: JSON-like values: 64-bit and larger integers, floats whose spelling differs between orjson
#: and the stdlib (``1e-05``), NaN and infinities, lone surrogates, 1 / 1.0 / true.
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([1, 1.0, True, 1e-05, 1e16, 2**64, float("nan"), float("inf")]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.text(alphabet=st.characters(codec=None, categories=["Cs", "Ll", "So"]), max_size=3),
)
JSON = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)
BODIES = st.fixed_dictionaries(
    {"tools": st.lists(JSON, max_size=3) | st.none() | JSON},
    optional={
        "model": st.text(max_size=5),
        "messages": st.lists(JSON, max_size=3),
        "stream": st.booleans(),
        "temperature": SCALARS,
        "seed": SCALARS,
        "zz": JSON,
        "aa": JSON,
        "metadata": JSON,
    },
)


@settings(max_examples=400, deadline=None)
@given(BODIES)
def test_the_digest_with_memoised_tools_text_is_the_old_formula(body: dict[str, Any]) -> None:
    known = KnownTools()
    tools_text = known.facts(body["tools"]).sorted_text
    old = _outcome(old_request_digest, body)
    assert _outcome(request_digest, body) == old
    assert _outcome(request_digest, body, tools_text) == old
    # and from the memo, for a fresh copy of the same value
    assert known.facts(_copy(body["tools"])).sorted_text == tools_text


@settings(max_examples=400, deadline=None)
@given(BODIES, st.lists(JSON, max_size=3), BODIES, st.integers(0, 3))
def test_the_digest_after_an_earlier_request_is_the_old_formula(
    body: dict[str, Any], added: list[Any], other: dict[str, Any], change: int
) -> None:
    """``request_digest_after``: the same digest whole and from an earlier request's state,
    for a later request that repeats its messages (the same objects) and adds some (0), also
    with other members around them (1), with a message rewritten (2), or fewer (3)."""
    known = KnownTools()
    tools_text = known.facts(body["tools"]).sorted_text
    first = _outcome(lambda: request_digest_after(body, tools_text)[0])
    assert first == _outcome(old_request_digest, body)
    try:
        _, state = request_digest_after(body, tools_text)
    except Exception:  # (the stdlib's error on a lone surrogate: no state)
        state = None
    messages = list(body.get("messages") or [])
    later = {**body, "messages": [*messages, *added]}
    if change == 1:
        later = {**other, "messages": later["messages"]}
    elif change == 2 and messages:
        later["messages"][0] = _copy(messages[0]) if added else {"rewritten": True}
    elif change == 3:
        later["messages"] = messages[:-1]
    later_tools = known.facts(later["tools"]).sorted_text
    assert _outcome(lambda: request_digest_after(later, later_tools, state)[0]) == _outcome(
        old_request_digest, later
    )


def test_the_digest_after_goes_on_from_the_state() -> None:
    """An agent's next call: the earlier state is taken (its messages are the same objects),
    and the digest is the formula's."""
    body = {**BODY, "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "x": 1}]}
    digest, state = request_digest_after(body, KnownTools().facts(TOOLS).sorted_text)
    assert digest == old_request_digest(body)
    assert state is not None and state.messages is body["messages"]
    later = {**body, "messages": [*body["messages"], {"role": "user", "content": "and?"}]}
    assert request_digest_after(later, None, state)[0] == old_request_digest(later)
    # it went on from the state: the same state hashed from other bytes gives another digest
    forged = RequestDigestState(state.head, state.messages, hashlib.sha256(b"other"))
    assert request_digest_after(later, None, forged)[0] != old_request_digest(later)
    # a state whose messages are equal but other objects is not taken: still the formula's
    other = {**later, "messages": _copy(later["messages"])}
    assert request_digest_after(other, None, state)[0] == old_request_digest(other)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


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
                "minimum": 1e-05,
                "x": 1.5,
            },
        },
    }
]
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "tools": TOOLS,
    "stream": True,
    "temperature": 0.5,
}


@pytest.mark.parametrize(
    ("body", "digest"),
    [
        (BODY, "474a891818067bb9b2bdfa7253db5ab962cf1c215f974806164ab0f849421add"),
        # an integer past 64 bits elsewhere: the stdlib writes the whole body (its ``1e-05``,
        # not orjson's ``0.00001``), so the tools' orjson text must not be spliced in
        (
            {**BODY, "seed": 2**70},
            "bfd389e8b12b6c82ac48ef082b022802cf397f84e53bb4314e006556b75b00e5",
        ),
        # the same value with true for 1.5: another digest
        (
            {**BODY, "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "x": True}}]},
            "40a47cf842576e3bc7ad00d135265b01f18435297439b85b4b018b120721a299",
        ),
    ],
)
def test_exact_digests(body: dict[str, Any], digest: str) -> None:
    """(The values are the digests of the code before ``tools_text``.)"""
    known = KnownTools()
    assert old_request_digest(body) == digest
    assert request_digest(body) == digest
    assert request_digest(body, known.facts(body["tools"]).sorted_text) == digest
    assert request_digest(body, known.facts(_copy(body["tools"])).sorted_text) == digest
