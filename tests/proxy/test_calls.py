"""What the executors share, on their fast paths: the engine request's headers, call ids and
the JSON text of a whole answer are those of the straightforward code they replace."""

import json
import math
import uuid

from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from capture_proxy.proxy.calls import (
    _UPSTREAM_DROP,
    call_id_of,
    dumps_text,
    new_call_id,
)
from capture_proxy.proxy.upstream import HOP_BY_HOP, forwardable_header_dict, forwardable_headers

_NAMES = st.sampled_from(
    [
        "Host", "host", "Connection", "connection", "X-Private", "x-private", "Authorization",
        "X-Session-Id", "x-session-id", "Content-Type", "Accept-Encoding", "TE", "X-Api-Key",
        "Transfer-Encoding", "Keep-Alive", "User-Agent",
    ]
)  # fmt: skip
_VALUES = st.sampled_from(["1", "keep-alive, X-Private", " x-session-id ,TE", "close", "a, b"])


@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=12))
def test_the_header_dict_is_the_dict_of_the_forwardable_multidict(items):
    headers = CIMultiDictProxy(CIMultiDict(items))
    drop = tuple(_UPSTREAM_DROP - HOP_BY_HOP)
    expected = dict(forwardable_headers(headers, drop=drop))
    got = forwardable_header_dict(headers, _UPSTREAM_DROP)
    assert list(got.items()) == list(expected.items())


def test_a_connection_header_drops_the_headers_it_names():
    headers = CIMultiDictProxy(
        CIMultiDict(
            [("Connection", "keep-alive, X-Private"), ("X-Private", "1"), ("x-private", "2"),
             ("Authorization", "Bearer k"), ("Host", "h"), ("X-Session-Id", "s"),
             ("x-session-id", "t")]
        )
    )  # fmt: skip
    got = forwardable_header_dict(headers, HOP_BY_HOP)
    # (a name once, its first spelling and value, as the multidict's dict has it)
    assert list(got.items()) == [("Authorization", "Bearer k"), ("X-Session-Id", "s")]


@given(st.binary(min_size=16, max_size=16))
def test_a_call_id_is_call_and_the_hex_of_a_version_4_uuid(random16):
    assert call_id_of(random16) == "call-" + uuid.UUID(bytes=random16, version=4).hex


def test_new_call_ids_are_uuid4s_and_differ():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    for call_id in ids:
        assert uuid.UUID(call_id.removeprefix("call-")).version == 4


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([math.nan, -math.inf, 1e-5, 1e16, 0.1, -0.0])
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(_JSON)
def test_dumps_text_writes_what_json_dumps_writes(value):
    assert dumps_text(value) == json.dumps(value, ensure_ascii=False)
