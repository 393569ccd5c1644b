"""The compiled reader of a body's prompt ids (``chunk_scan.take_prompt``) against the Python
path: orjson's parse (``json_bodies.loads_like_stdlib``) and ``records.as_token_array``.

What it takes must be exactly what the Python path reads: the ids, as uint32, and the rest of
the body parsing to the same value with that member null. What it is not sure of it leaves
(the body unchanged, no ids), and it never fails on the engine's bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from capture_proxy.core import chunk_scan
from capture_proxy.core.json_bodies import loads_like_stdlib
from capture_proxy.core.records import as_token_array
from capture_proxy.core.sse import SSEStreamDecoder
from tests.core.test_chunk_scan import _damaged, _json

needs_module = pytest.mark.skipif(
    chunk_scan._TAKE_PROMPT_IDS is None, reason="the compiled module is not built"
)

RECORDED = (
    Path(__file__).resolve().parents[1] / "fixtures" / "vllm_streams" / "vllm_0_32_streams.json"
)


def _agree(raw: bytes) -> bool:
    """Whether ``take_prompt`` took the ids of ``raw``; asserts that what it took is what the
    Python path reads, and that it took nothing from a body the Python path refuses or whose
    prompt ids are not token ids."""
    rest, ids = chunk_scan.take_prompt(raw)
    try:
        whole = loads_like_stdlib(raw)
    except ValueError:
        assert ids is None and rest is raw
        return False
    listed = whole.get("prompt_token_ids") if isinstance(whole, dict) else None
    try:
        expected = as_token_array(listed, field_name="prompt_token_ids")
    except ValueError:
        expected = None
    if ids is None:
        assert rest is raw
        return False
    assert expected is not None, listed
    assert ids.dtype == expected.dtype and ids.tolist() == expected.tolist()
    assert ids.flags.writeable
    assert loads_like_stdlib(rest) == {**whole, "prompt_token_ids": None}
    assert list(orjson.loads(rest)) == list(whole)  # the members keep their order
    return True


@needs_module
@pytest.mark.parametrize(
    "name", ["chat", "chat_tools_offered", "chat_harness_asked_top_logprobs", "chat_coalesced"]
)
def test_vllms_own_first_chunks_prompt_ids_are_taken_exactly(name):
    """The oracle is the real thing: the first chunk of each stream vLLM 0.32 sent for the
    bodies the proxy sends carries the prompt's ids at its top level; they are taken."""
    raw = json.loads(RECORDED.read_text())["streams"][name].encode()
    decoder = SSEStreamDecoder()
    events = decoder.feed_data(raw) + decoder.close_data()
    assert _agree(events[0])
    assert len(orjson.loads(events[0])["prompt_token_ids"]) > 10
    assert not any(_agree(data) for data in events[1:] if data != b"[DONE]")


@needs_module
def test_what_is_left_to_the_python_path() -> None:
    for raw in [
        b'{"prompt_token_ids":[1,-1]}',
        b'{"prompt_token_ids":[1,4294967296]}',
        b'{"prompt_token_ids":[1,2.0]}',
        b'{"prompt_token_ids":[1,2e0]}',
        b'{"prompt_token_ids":[01]}',
        b'{"prompt_token_ids":[true]}',
        b'{"prompt_token_ids":[null]}',
        b'{"prompt_token_ids":[12345678901]}',
        b'{"prompt_token_ids":null}',
        b'{"prompt_token_ids":"1"}',
        b'{"prompt_token_ids":[1],"prompt_token_ids":[2]}',
        b'{"a":{"prompt_token_ids":[1]}}',
        b'[{"prompt_token_ids":[1]}]',
        b'{"prompt_token_ids":[1]} {}',
        b'{"prompt_token_ids":[1],"x":NaN}',
        b'{"prompt_token_ids":[1],"x":"\\ud800"}',
        b'{"prompt_token_ids":[1],"x":12345678901234567890}',
        b'\xef\xbb\xbf{"prompt_token_ids":[1]}',
        b'{"prompt_token_ids":[1],"x":"\xff"}',
        b'{"prompt_token_ids":[1]',
        b"",
    ]:
        assert chunk_scan.take_prompt(raw) == (raw, None), raw
        _agree(raw)
    rest, ids = chunk_scan.take_prompt(b' {"a": 1, "prompt_token_ids": [ 0 ,4294967295 ] }\n')
    assert rest == b' {"a": 1, "prompt_token_ids": null }\n'
    assert ids is not None and ids.tolist() == [0, 2**32 - 1]
    rest, ids = chunk_scan.take_prompt(b'{"prompt_token_ids":[]}')
    assert (rest, ids.tolist() if ids is not None else None) == (b'{"prompt_token_ids":null}', [])
    with pytest.raises(TypeError):
        chunk_scan.take_prompt("{}")  # type: ignore[arg-type]


@needs_module
def test_a_body_cut_or_broken_anywhere_in_the_ids_is_left_to_the_python_path() -> None:
    # The ids are read up to the NUL every bytes object ends with, never past it: a body cut
    # at any byte, a NUL or another byte in place of any byte of the array, a run of digits
    # past any id's length, are each left (or, where still strict JSON, read as the Python
    # path reads them).
    whole = b'{"prompt_token_ids": [7,\t42 ,\r\n4294967295,0, 151643]}'
    for cut in range(len(whole)):
        assert chunk_scan.take_prompt(whole[:cut]) == (whole[:cut], None), whole[:cut]
    start = whole.index(b"[")
    for at in range(start, len(whole) - 1):
        for byte in (b"\x00", b"x", b"-", b"]", b",", b" ", b"9", b"0", b"."):
            raw = whole[:at] + byte + whole[at + 1 :]
            _agree(raw)  # (asserts: taken as the Python path reads it, else left whole)
    for digits in (b"1" * 10, b"1" * 11, b"9" * 30, b"4294967296", b"0" * 3):
        raw = b'{"prompt_token_ids":[' + digits + b"]}"
        taken = chunk_scan.take_prompt(raw)[1]
        assert (taken.tolist() if taken is not None else None) == (
            [1111111111] if digits == b"1" * 10 else None
        ), digits
    rest, ids = chunk_scan.take_prompt(whole)
    assert rest == b'{"prompt_token_ids": null}'
    assert ids is not None and ids.tolist() == [7, 42, 2**32 - 1, 0, 151643]


_id = st.one_of(
    st.integers(0, 2**32 - 1),
    st.sampled_from([0, 2**32 - 1, 2**31]),
    st.integers(-3, 2**32 + 3),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.none(),
)
_answer = st.fixed_dictionaries(
    {"prompt_token_ids": st.one_of(st.lists(_id, max_size=40), st.lists(st.integers(0, 99)))},
    optional={
        "id": st.text(max_size=8),
        "choices": st.lists(_json, max_size=2),
        "usage": _json,
        "prompt_logprobs": _json,
    },
)


@needs_module
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_answer, st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans(), st.randoms())
def test_generated_answers_prompt_ids_are_taken_as_the_python_path_reads_them(
    answer: dict[str, Any], separators: tuple[str, str], ascii_only: bool, random: Any
) -> None:
    items = list(answer.items())
    random.shuffle(items)  # the member anywhere among the others
    raw = json.dumps(dict(items), ensure_ascii=ascii_only, separators=separators).encode()
    event(f"taken: {_agree(raw)}")


@needs_module
@settings(max_examples=1500, deadline=None)
@given(st.data())
def test_damaged_answers_are_left_or_taken_as_the_python_path_reads_them(data: Any) -> None:
    """Bytes changed, cut or added anywhere in an answer: the reader never crashes, and what
    it takes the Python path reads the same way."""
    answer = {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "message": {"content": "hi"}, "token_ids": [7]}],
        "prompt_token_ids": [151644, 872, 198, 0, 4294967295],
        "usage": {"prompt_tokens": 5},
    }
    event(f"taken: {_agree(_damaged(data, orjson.dumps(answer)))}")


def test_without_the_module_nothing_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunk_scan, "_TAKE_PROMPT_IDS", None)
    raw = b'{"prompt_token_ids":[1,2]}'
    assert chunk_scan.take_prompt(raw) == (raw, None)
