"""The compiled scan of a streamed chat chunk (``core/_chunkscan.c``) against the Python path.

The oracle is what the proxy did before the scan and still does for any chunk the scan leaves
to it: orjson's parse, ``ChatCaptureAssembler.add_chunk`` and ``strip_chat_chunk``. For every
chunk the scan accepts, the assembler must end in the same state and the harness must get the
same JSON; and the scan must accept the chunks vLLM sends for each token (else the work is
for nothing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from capture_proxy.core import chunk_scan
from capture_proxy.core.assembly import CallContext, ChatCaptureAssembler
from capture_proxy.core.capture import HarnessAsked, strip_chat_chunk
from capture_proxy.core.sse import SSEStreamDecoder, parse_json_event

SCAN = chunk_scan.SCAN
needs_scan = pytest.mark.skipif(SCAN is None, reason="the compiled scan is not built")

#: a middle chunk of vLLM 0.32's chat stream, as its server writes it (compact, UTF-8 kept)
VLLM_CHUNK = (
    '{"id":"chatcmpl-8d1f","object":"chat.completion.chunk","created":1796028430,'
    '"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"content":" wörld"},'
    '"logprobs":{"content":[{"token":" wörld","logprob":-0.03125,"bytes":[32,119,195,182,'
    '114,108,100],"top_logprobs":[]}]},"finish_reason":null,"token_ids":[1879]}]}'
).encode()

ALL_ASKED = [
    HarnessAsked(logprobs=lp, return_token_ids=ids, include_usage=usage, routed_experts=False)
    for lp in (False, True)
    for ids in (False, True)
    for usage in (False, True)
]


def _assembler() -> ChatCaptureAssembler:
    ctx = CallContext("call-1", "rollout-1", 0.0, True, "/v1/chat/completions", {})
    return ChatCaptureAssembler(ctx)


def _state(a: ChatCaptureAssembler) -> dict[str, Any]:
    return {
        "ids": [(type(v), v) for v in a.generation_token_ids],
        "log_probs": [(type(v), v) for v in a.generation_log_probs],
        "saw": (a.saw_token_ids, a.saw_log_probs),
        "content": a.content,
        "reasoning": a.reasoning,
        "tools": {k: vars(v) for k, v in a.tool_calls.items()},
        "finish": (a.finish_reason, a.usage, a.prompt_token_ids, a.problems),
    }


def _python_path(data: bytes, asked: HarnessAsked) -> tuple[Any, dict[str, Any]]:
    a = _assembler()
    chunk = parse_json_event(data)
    a.add_chunk(chunk)
    return strip_chat_chunk(chunk, asked), _state(a)


def _scan_path(data: bytes, asked: HarnessAsked) -> tuple[Any, dict[str, Any]] | None:
    assert SCAN is not None
    scanned = SCAN(data, chunk_scan.scan_flags(asked, event=True))
    if scanned is None:
        return None
    event, delta, content, token_ids, log_probs = scanned
    assert event is not None and event[:6] == b"data: " and event[-2:] == b"\n\n"
    assert delta is None or content is None
    a = _assembler()
    a.add_scanned(token_ids, log_probs)
    if delta is not None:
        a.add_delta(orjson.loads(delta))
    if content is not None:
        a.add_delta({"content": content})
    no_event = SCAN(data, chunk_scan.scan_flags(asked, event=False))
    assert no_event == (None, delta, content, token_ids, log_probs)
    return orjson.loads(event[6:-2]), _state(a)


def _agree(data: bytes) -> int:
    """The scan and the Python path agree on ``data`` for every ``HarnessAsked``; how many
    of them the scan accepted."""
    accepted = 0
    for asked in ALL_ASKED:
        scanned = _scan_path(data, asked)
        if scanned is None:
            continue
        accepted += 1
        assert scanned == _python_path(data, asked), (data, asked)
    return accepted


def test_the_compiled_scan_is_built() -> None:
    """setup.py builds it wherever a C compiler and Python's headers are (every machine
    scripts/setup supports); the proxy runs without it, slower, so a build that failed
    silently would otherwise go unseen."""
    if chunk_scan.python_path_only():
        pytest.skip("CAPTURE_PROXY_NO_COMPILED is set")
    assert SCAN is not None and chunk_scan.SCAN_COMPLETIONS is not None, (
        "capture_proxy.core._chunkscan is not built: install a C compiler and Python's headers "
        "(Debian: gcc python3-dev) and run scripts/setup, or set CAPTURE_PROXY_NO_COMPILED=1 "
        "to test the Python path alone"
    )


@needs_scan
def test_a_vllm_middle_chunk_is_read_exactly() -> None:
    assert SCAN is not None
    asked = HarnessAsked(
        logprobs=False, return_token_ids=False, include_usage=False, routed_experts=False
    )
    scanned = SCAN(VLLM_CHUNK, chunk_scan.scan_flags(asked, event=True))
    event, delta, content, token_ids, log_probs = scanned
    assert token_ids == [1879]
    assert log_probs == [-0.03125]
    assert (delta, content) == (None, " wörld")
    assert (
        event
        == (
            'data: {"id":"chatcmpl-8d1f","object":"chat.completion.chunk","created":1796028430,'
            '"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"content":" wörld"},'
            '"logprobs":null,"finish_reason":null}]}\n\n'
        ).encode()
    )
    assert _agree(VLLM_CHUNK) == len(ALL_ASKED)


@needs_scan
def test_what_the_scan_leaves_to_the_python_path() -> None:
    assert SCAN is not None
    base = json.loads(VLLM_CHUNK)

    def variant(**changes: Any) -> bytes:
        chunk = json.loads(json.dumps(base))
        for path, value in changes.items():
            target = chunk if path.startswith("top_") else chunk["choices"][0]
            target[path.removeprefix("top_").removeprefix("c_")] = value
        return json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()

    left = [
        variant(c_finish_reason="stop"),  # the last chunk (stop_reason, abort)
        variant(c_index=1),
        variant(c_index=0.0),
        variant(top_usage={"prompt_tokens": 3}),
        variant(top_prompt_token_ids=[1, 2]),  # the first chunk
        variant(c_routed_experts="AAAA"),
        variant(c_token_ids=[-1]),
        variant(c_token_ids=[2**31]),
        variant(c_token_ids=[1.0]),
        variant(c_logprobs={"content": [{"logprob": "x"}]}),
        variant(c_logprobs={"content": "abc"}),
        variant(c_delta="text"),
        VLLM_CHUNK.replace(b"-0.03125", b"NaN"),
        VLLM_CHUNK.replace(b"-0.03125", b"-1e400"),
        VLLM_CHUNK.replace(b"1796028430", b"17960284301796028430"),
        VLLM_CHUNK.replace(b'"id"', b'"\\u0069d"'),
        VLLM_CHUNK.replace(b'"model"', b'"id"'),  # a repeated name
        VLLM_CHUNK.replace(b" w\xc3\xb6rld", b" w\xf6rld", 1),  # not UTF-8
        VLLM_CHUNK.replace("wörld".encode(), b"\\ud800", 1),
        VLLM_CHUNK[:-1],
        VLLM_CHUNK + b"x",
        b"[" + VLLM_CHUNK + b"]",
        VLLM_CHUNK.replace(b'"choices":[{', b'"choices":[{"index":0},{', 1),
        b'{"choices":[]}',
        b"[DONE]",
        b"",
    ]
    for data in left:
        assert SCAN(data, 0) is None, data


@needs_scan
def test_a_chunk_of_each_kind_the_engine_sends_per_token() -> None:
    """Content, reasoning, a tool call's pieces, a role-only delta, whitespace between tokens
    (JSON the stdlib writes), escapes: each accepted, and read as the Python path reads it."""
    base = json.loads(VLLM_CHUNK)
    deltas = [
        {"content": 'line\n\t"quoted" \\ \u2028 \U0001f600'},
        {"content": "\x00\x08\x0c\r/é\u2028\x7f"},
        {"reasoning_content": "think"},
        {"reasoning": "think"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"cmd": "ls"}'}}]},
        {"role": "assistant", "content": ""},
        {},
    ]
    for delta in deltas:
        for separators, ascii_only in [((",", ":"), False), ((", ", ": "), True)]:
            chunk = dict(base, choices=[dict(base["choices"][0], delta=delta)])
            data = json.dumps(chunk, ensure_ascii=ascii_only, separators=separators).encode()
            if ascii_only and "\U0001f600" in str(delta):
                continue  # written as a surrogate pair: the Python path's
            assert _agree(data) == len(ALL_ASKED), data
    escaped = VLLM_CHUNK.replace(" wörld".encode(), rb"\u0000\/\\\\\"\b\f\n\r\t\u00e9\u20AC")
    assert SCAN(escaped, 0)[2] == '\x00/\\\\"\b\f\n\r\té€'  # type: ignore[index]


_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
_number = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-50.0, 0.0),
)
_json_leaf = st.one_of(st.none(), st.booleans(), _text, _number)
_json = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=6,
)
_entry = st.one_of(
    st.fixed_dictionaries(
        {
            "token": _text,
            "logprob": st.one_of(_number, st.none()),
            "bytes": st.lists(st.integers(0, 255), max_size=4),
            "top_logprobs": st.just([]),
        },
    ),
    st.fixed_dictionaries({"token": _text}),
    _json,
)
_delta = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.just("assistant"),
            "content": _text,
            "reasoning_content": _text,
            "reasoning": _text,
        },
    ),
    st.dictionaries(_text, _json, max_size=2),
)
_choice = st.fixed_dictionaries(
    {},
    optional={
        "index": st.sampled_from([0, 0, 0, 1]),
        "delta": _delta,
        "logprobs": st.one_of(
            st.none(),
            st.fixed_dictionaries({"content": st.one_of(st.none(), st.lists(_entry, max_size=3))}),
        ),
        "finish_reason": st.sampled_from([None, None, None, "stop"]),
        "token_ids": st.one_of(st.none(), st.lists(st.integers(-2, 2**31 + 2), max_size=3)),
        "extra": _json,
    },
)
_chunk = st.fixed_dictionaries(
    {"choices": st.lists(_choice, min_size=1, max_size=2)},
    optional={
        "id": _text,
        "object": st.just("chat.completion.chunk"),
        "created": _number,
        "usage": st.sampled_from([None, None, {"prompt_tokens": 1}]),
        "other": _json,
    },
)


@needs_scan
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_chunk, st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_generated_chunks_read_as_the_python_path_reads_them(
    chunk: dict[str, Any], separators: tuple[str, str], ascii_only: bool
) -> None:
    data = json.dumps(chunk, ensure_ascii=ascii_only, separators=separators).encode()
    event(f"accepted for {_agree(data)} of {len(ALL_ASKED)}")


def _damaged(data: Any, chunk: bytes) -> bytes:
    """``chunk`` with one to three bytes changed, added or taken out anywhere."""
    raw = bytearray(chunk)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw)))
        kind = data.draw(st.sampled_from(["set", "insert", "delete"]))
        byte = data.draw(st.sampled_from([*b'{}[]",:\\ 0123456789-.eEnul\x00\x1f\x80\xc3\xff']))
        if kind == "insert":
            raw.insert(at, byte)
        elif at < len(raw):
            if kind == "set":
                raw[at] = byte
            else:
                del raw[at]
    return bytes(raw)


@needs_scan
@settings(max_examples=1500, deadline=None)
@given(st.data())
def test_damaged_chunks_are_refused_or_read_as_the_python_path_reads_them(data: Any) -> None:
    """Bytes changed, cut or added anywhere in a real chunk: the scan never crashes, and what
    it accepts the Python path parses the same way."""
    damaged = _damaged(data, VLLM_CHUNK)
    try:
        parse_json_event(damaged)
    except ValueError:
        assert all(SCAN(damaged, f) is None for f in range(16))  # type: ignore[misc]
        return
    event(f"accepted for {_agree(damaged)} of {len(ALL_ASKED)}")


# --- vLLM's completions stream (exact-token mode) --------------------------------------------

#: a middle chunk of vLLM 0.32's /v1/completions stream (exact-token mode asks for the tokens
#: as ``token_id:<id>`` and one log prob)
VLLM_COMPLETIONS_CHUNK = (
    '{"id":"cmpl-8d1f","object":"text_completion","created":1796028430,'
    '"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"text":" wörld","logprobs":'
    '{"text_offset":[12],"token_logprobs":[-0.03125],"tokens":["token_id:1879"],'
    '"top_logprobs":[{"token_id:1879":-0.03125}]},"finish_reason":null,"stop_reason":null,'
    '"token_ids":[1879]}],"usage":null}'
).encode()


def _piece_fields(piece: Any) -> dict[str, Any]:
    fields = dict(vars(piece))
    fields["token_ids"] = [(type(v), v) for v in piece.token_ids]
    fields["log_probs"] = [(type(v), v) for v in piece.log_probs]
    return fields


def _completions_agree(data: bytes) -> bool:
    """The reader's piece of ``data`` with the scan equals its parsed piece (or both raise
    alike); whether the scan accepted it."""
    from capture_proxy.core.engine_formats import VllmCompletionsReader

    assert chunk_scan.SCAN_COMPLETIONS is not None
    accepted = chunk_scan.SCAN_COMPLETIONS(data) is not None
    reader = VllmCompletionsReader()
    try:
        expected: Any = _piece_fields(reader.chunk(parse_json_event(data)))
    except ValueError as exc:
        expected = type(exc)
    try:
        got: Any = _piece_fields(reader.chunk_data(data))
    except ValueError as exc:
        got = type(exc)
    assert got == expected, data
    return accepted


@needs_scan
def test_a_vllm_completions_middle_chunk_is_read_exactly() -> None:
    assert chunk_scan.SCAN_COMPLETIONS is not None
    assert chunk_scan.SCAN_COMPLETIONS(VLLM_COMPLETIONS_CHUNK) == (" wörld", [1879], [-0.03125])
    assert _completions_agree(VLLM_COMPLETIONS_CHUNK)
    no_log_probs = VLLM_COMPLETIONS_CHUNK.replace(
        VLLM_COMPLETIONS_CHUNK[
            VLLM_COMPLETIONS_CHUNK.index(b'"logprobs"') : VLLM_COMPLETIONS_CHUNK.index(
                b',"finish_reason"'
            )
        ],
        b'"logprobs":null',
    )
    assert chunk_scan.SCAN_COMPLETIONS(no_log_probs) == (" wörld", [1879], None)
    assert _completions_agree(no_log_probs)
    # without return_token_ids (exact-token mode's default): the ids of the tokens
    from_tokens = VLLM_COMPLETIONS_CHUNK.replace(b',"token_ids":[1879]', b"")
    assert chunk_scan.SCAN_COMPLETIONS(from_tokens) == (" wörld", [1879], [-0.03125])
    assert _completions_agree(from_tokens)
    # vLLM writes the first chunk's and the last's members null in every other one
    nulls = VLLM_COMPLETIONS_CHUNK.replace(
        b'"index":0', b'"index":0,"prompt_token_ids":null,"routed_experts":null'
    ).replace(b'"id":', b'"prompt_token_ids":null,"id":')
    assert chunk_scan.SCAN_COMPLETIONS(nulls) == (" wörld", [1879], [-0.03125])
    assert _completions_agree(nulls)
    left = [
        VLLM_COMPLETIONS_CHUNK.replace(b'"finish_reason":null', b'"finish_reason":"stop"'),
        VLLM_COMPLETIONS_CHUNK.replace(b',"token_ids":[1879]', b"").replace(
            b'"tokens":["token_id:1879"]', b'"tokens":["x"]'
        ),
        VLLM_COMPLETIONS_CHUNK.replace(b',"token_ids":[1879]', b"").replace(
            b'"tokens":["token_id:1879"]', b'"tokens":null'
        ),
        VLLM_COMPLETIONS_CHUNK.replace(b'"token_id:1879"]', b'"token_id:2147483648"]'),
        VLLM_COMPLETIONS_CHUNK.replace(b'"usage":null', b'"usage":{"prompt_tokens":3}'),
        VLLM_COMPLETIONS_CHUNK.replace(b'"index":0', b'"index":1'),
        VLLM_COMPLETIONS_CHUNK.replace(b'"text":" w', b'"text":5,"x":" w'),
        VLLM_COMPLETIONS_CHUNK.replace(b'"token_logprobs":[', b'"token_logprobs":["x",'),
        VLLM_COMPLETIONS_CHUNK.replace(b'"id":', b'"prompt_token_ids":[1],"id":'),
        VLLM_COMPLETIONS_CHUNK.replace(b'"index":0', b'"index":0,"prompt_token_ids":[1]'),
        VLLM_COMPLETIONS_CHUNK.replace(b'"index":0', b'"index":0,"routed_experts":"AAAA"'),
        VLLM_COMPLETIONS_CHUNK.replace(b'"index":0', b'"text":"a","index":0'),
        VLLM_COMPLETIONS_CHUNK.replace(b"-0.03125]", b"NaN]"),
    ]
    for data in left:
        assert chunk_scan.SCAN_COMPLETIONS(data) is None, data
        _completions_agree(data)


_completion_choice = st.fixed_dictionaries(
    {},
    optional={
        "index": st.sampled_from([0, 0, 0, 1]),
        "text": st.one_of(st.none(), _text, st.just(5)),
        "logprobs": st.one_of(
            st.none(),
            st.fixed_dictionaries(
                {},
                optional={
                    "token_logprobs": st.one_of(
                        st.none(), st.lists(st.one_of(_number, st.none()), max_size=3), _json
                    ),
                    "tokens": st.one_of(
                        st.lists(st.sampled_from(["token_id:5", "token_id:0012"]), max_size=2),
                        st.lists(st.sampled_from(["token_id:5", "x", "token_id:"]), max_size=2),
                    ),
                    "top_logprobs": _json,
                },
            ),
        ),
        "finish_reason": st.sampled_from([None, None, None, "stop", "abort"]),
        "stop_reason": st.sampled_from([None, 7, "x"]),
        "token_ids": st.one_of(st.none(), st.lists(st.integers(-2, 2**31 + 2), max_size=3)),
        "extra": _json,
    },
)


@needs_scan
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {"choices": st.lists(_completion_choice, min_size=1, max_size=2)},
        optional={
            "id": _text,
            "usage": st.sampled_from([None, None, {"prompt_tokens": 1}]),
            "other": _json,
        },
    ),
    st.sampled_from([(",", ":"), (", ", ": ")]),
    st.booleans(),
)
def test_generated_completions_chunks_read_as_the_python_path_reads_them(
    chunk: dict[str, Any], separators: tuple[str, str], ascii_only: bool
) -> None:
    data = json.dumps(chunk, ensure_ascii=ascii_only, separators=separators).encode()
    event("accepted" if _completions_agree(data) else "left")


@needs_scan
@settings(max_examples=1500, deadline=None)
@given(st.data())
def test_damaged_completions_chunks_are_refused_or_read_as_the_python_path_reads_them(
    data: Any,
) -> None:
    event("accepted" if _completions_agree(_damaged(data, VLLM_COMPLETIONS_CHUNK)) else "left")


# --- real vLLM 0.32 streams --------------------------------------------------------------------

RECORDED = (
    Path(__file__).resolve().parents[1] / "fixtures" / "vllm_streams" / "vllm_0_32_streams.json"
)


def _recorded_events(name: str) -> list[bytes]:
    raw = json.loads(RECORDED.read_text())["streams"][name].encode()
    decoder = SSEStreamDecoder()
    return [e for e in decoder.feed_data(raw) + decoder.close_data() if e != b"[DONE]"]


@needs_scan
@pytest.mark.parametrize(
    "name", ["chat", "chat_tools_offered", "chat_harness_asked_top_logprobs", "chat_coalesced"]
)
def test_vllms_own_chat_streams_are_scanned_and_read_as_the_python_path_reads_them(name):
    """The oracle is the real thing: chat streams vLLM 0.32 (CPU) sent for the bodies the
    proxy sends. Every middle chunk is scanned (the first has the prompt ids, the last its
    finish_reason, then the usage chunk), for every combination of what the harness asked."""
    events = _recorded_events(name)
    accepted = [_agree(data) for data in events]
    assert accepted[0] == 0 and accepted[-2:] == [0, 0]
    assert accepted[1:-2] == [len(ALL_ASKED)] * (len(events) - 3)
    assert len(events) >= 4


@needs_scan
@pytest.mark.parametrize("name", ["completions", "completions_echo_prompt"])
def test_vllms_own_completions_streams_are_scanned_and_read_as_the_python_path_reads_them(name):
    events = _recorded_events(name)
    accepted = [_completions_agree(data) for data in events]
    echo = name.endswith("echo_prompt")  # the first chunk then carries the prompt ids
    assert accepted == [not echo] + [True] * (len(events) - 3) + [False, False]
    assert len(events) == 25


def _reloaded_with(monkeypatch: pytest.MonkeyPatch, module: Any) -> Any:
    """``chunk_scan`` imported again with ``module`` as the compiled one."""
    import importlib
    import sys

    import capture_proxy.core

    monkeypatch.setitem(sys.modules, "capture_proxy.core._chunkscan", module)
    monkeypatch.setattr(capture_proxy.core, "_chunkscan", module, raising=False)
    monkeypatch.delenv("CAPTURE_PROXY_NO_COMPILED", raising=False)
    return importlib.reload(chunk_scan)


@pytest.mark.parametrize("built_from", ["0" * 64, None])
def test_a_module_built_from_another_source_leaves_the_python_path(monkeypatch, built_from):
    """A module built before the source changed (a pull without scripts/setup, a rebuild
    that failed and left the old one: the build is optional) is not run, whatever functions
    it has (one from before the completions scan made the import fail, a review found): both
    scans are None, as when it is not built (serve says so)."""
    import hashlib
    import importlib
    import types

    stale = types.ModuleType("capture_proxy.core._chunkscan")
    stale.scan_chat_chunk = lambda data, flags: None  # type: ignore[attr-defined]
    if built_from is not None:
        stale.SOURCE_SHA256 = built_from  # type: ignore[attr-defined]
    try:
        reloaded = _reloaded_with(monkeypatch, stale)
        assert (reloaded.SCAN, reloaded.SCAN_COMPLETIONS) == (None, None)
        source = Path(chunk_scan.__file__).with_name("_chunkscan.c").read_bytes()
        stale.SOURCE_SHA256 = hashlib.sha256(source).hexdigest()  # type: ignore[attr-defined]
        reloaded = _reloaded_with(monkeypatch, stale)  # built from this source: run
        assert reloaded.SCAN is stale.scan_chat_chunk  # type: ignore[attr-defined]
        assert reloaded.SCAN_COMPLETIONS is None  # (this one has no completions scan)
    finally:
        monkeypatch.undo()
        importlib.reload(chunk_scan)
    assert chunk_scan.SCAN is SCAN or SCAN is None
