import math

import numpy as np
import pytest

from capture_proxy.core.assembly import CallContext, ChatCaptureAssembler
from capture_proxy.core.records import CallStatus

CTX = CallContext(
    "call-1",
    "r1",
    100.0,
    True,
    "/v1/chat/completions",
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": None},
)


def _lp(*values):
    return {
        "content": [{"token": "t", "logprob": v, "bytes": [], "top_logprobs": []} for v in values]
    }


def _stream_chunks():
    return [
        {
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        },
        {
            "choices": [
                {"index": 0, "delta": {"content": "Hel"}, "token_ids": [10], "logprobs": _lp(-0.5)}
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"reasoning_content": "r"},
                    "token_ids": [11],
                    "logprobs": _lp(-0.25),
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "token_ids": [12], "logprobs": _lp(-1.0)}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_a",
                                "type": "function",
                                "function": {"name": "read", "arguments": '{"p":'},
                            }
                        ]
                    },
                    "token_ids": [13],
                    "logprobs": _lp(-2.0),
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                    "token_ids": [14, 15],
                    "logprobs": _lp(-3.0, -0.125),
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}},
    ]


def test_stream_assembles_exact_tokens_and_message():
    asm = ChatCaptureAssembler(CTX)
    for chunk in _stream_chunks():
        asm.add_chunk(chunk)
    rec = asm.finish(latency_ms=12.5, http_status=200)
    assert rec.status is CallStatus.COMPLETE
    assert rec.prompt_token_ids.tolist() == [1, 2, 3]
    assert rec.generation_token_ids.tolist() == [10, 11, 12, 13, 14, 15]
    assert rec.generation_log_probs.tolist() == [-0.5, -0.25, -1.0, -2.0, -3.0, -0.125]
    assert rec.response_message == {
        "role": "assistant",
        "content": "Hel",
        "reasoning_content": "r",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "read", "arguments": '{"p":1}'},
            }
        ],
    }
    assert rec.finish_reason == "tool_calls"
    assert rec.usage == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert rec.request_messages == [{"role": "user", "content": "hi"}]
    assert rec.diagnostics == []


def test_missing_token_ids_make_the_record_incomplete_with_reason():
    asm = ChatCaptureAssembler(CTX)
    asm.add_chunk({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]})
    rec = asm.finish(latency_ms=1.0, http_status=200)
    assert rec.status is CallStatus.INCOMPLETE
    assert rec.diagnostics[0].kind == "capture_incomplete"
    assert rec.diagnostics[0].details["reasons"] == [
        "engine sent no prompt_token_ids",
        "engine sent no token_ids",
        "engine sent no logprobs",
    ]
    assert rec.response_message["content"] == "x"
    # the arrays not received are the empty defaults, with their dtypes, one per record
    for name, dtype in (
        ("prompt_token_ids", np.uint32),
        ("generation_token_ids", np.uint32),
        ("generation_log_probs", np.float32),
    ):
        assert getattr(rec, name).shape == (0,) and getattr(rec, name).dtype == dtype
    assert rec.prompt_token_ids is not rec.generation_token_ids


def test_length_mismatch_is_refused():
    asm = ChatCaptureAssembler(CTX)
    asm.add_chunk(
        {
            "prompt_token_ids": [1],
            "choices": [{"index": 0, "delta": {}, "token_ids": [5, 6], "logprobs": _lp(-1.0)}],
        }
    )
    rec = asm.finish(latency_ms=1.0, http_status=200)
    assert rec.status is CallStatus.INCOMPLETE
    assert rec.diagnostics[-1].details["reasons"] == [
        "generation_token_ids has 2 ids but generation_log_probs has 1 values"
    ]
    # What arrived is kept, not dropped.
    assert rec.generation_token_ids.tolist() == [5, 6]


def _whole_answer(*log_probs):
    asm = ChatCaptureAssembler(CTX)
    asm.add_response(
        {
            "prompt_token_ids": [1],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "a"},
                    "token_ids": list(range(5, 5 + len(log_probs))),
                    "logprobs": _lp(*log_probs),
                    "finish_reason": "stop",
                }
            ],
        }
    )
    return asm.finish(latency_ms=1.0, http_status=200)


def test_non_finite_log_probs_are_kept_and_flagged():
    rec = _whole_answer(-1.0, None, float("-inf"))
    assert rec.status is CallStatus.COMPLETE
    assert math.isnan(rec.generation_log_probs[1]) and rec.generation_log_probs[2] == -np.inf
    assert [d.to_json() for d in rec.diagnostics] == [
        {"kind": "non_finite_logprob", "details": {"positions": [1, 2], "count": 2}}
    ]


def test_impossible_log_probs_are_kept_and_named_truthfully():
    # The trial's engine (#12): 1e308 is finite but beyond float32 (stored as inf), and it and
    # 0.5 are positive; before, 1e308 was called non_finite_logprob and 0.5 went unflagged.
    rec = _whole_answer(-0.5, 1e308, -2.0, 0.5)
    assert rec.status is CallStatus.COMPLETE
    assert rec.generation_log_probs.tolist() == [-0.5, math.inf, -2.0, 0.5]
    assert [d.to_json() for d in rec.diagnostics] == [
        {
            "kind": "logprob_out_of_float32_range",
            "details": {"positions": [1], "values": [1e308], "count": 1},
        },
        {
            "kind": "positive_logprob",
            "details": {"positions": [1, 3], "values": [1e308, 0.5], "count": 2},
        },
    ]


def test_log_probs_within_float_rounding_of_zero_are_not_flagged():
    rec = _whole_answer(0.0, 1e-5, 3e-6, -0.0, -3.4e38)
    assert rec.diagnostics == []
    rec = _whole_answer(0.0, 1.2e-5)
    assert [d.to_json() for d in rec.diagnostics] == [
        {"kind": "positive_logprob", "details": {"positions": [1], "values": [1.2e-5], "count": 1}}
    ]


def test_engine_non_finite_and_overflowing_log_probs_are_told_apart():
    # -1e39 overflows to -inf: out of float32 range, not the engine's -inf; an int beyond
    # float64 (JSON allows it) too, reported by its digit count (JSON writers refuse it)
    rec = _whole_answer(float("nan"), -1e39, float("-inf"), None, -(10**400), 10**39)
    assert [d.to_json() for d in rec.diagnostics] == [
        {"kind": "non_finite_logprob", "details": {"positions": [0, 2, 3], "count": 3}},
        {
            "kind": "logprob_out_of_float32_range",
            "details": {
                "positions": [1, 4, 5],
                "values": [-1e39, "-401-digit integer", 1e39],
                "count": 3,
            },
        },
        {"kind": "positive_logprob", "details": {"positions": [5], "values": [1e39], "count": 1}},
    ]
    stored = rec.generation_log_probs
    assert np.isnan(stored[[0, 3]]).all()
    assert stored[[1, 2, 4, 5]].tolist() == [-math.inf, -math.inf, -math.inf, math.inf]


def test_each_log_prob_diagnostic_counts_its_positions_past_the_16_it_lists():
    rec = _whole_answer(*([-1.0] * 4 + [None] * 20 + [1e39] * 17 + [0.5] * 2))
    assert rec.status is CallStatus.COMPLETE
    assert [d.to_json() for d in rec.diagnostics] == [
        {"kind": "non_finite_logprob", "details": {"positions": list(range(4, 20)), "count": 20}},
        {
            "kind": "logprob_out_of_float32_range",
            "details": {"positions": list(range(24, 40)), "values": [1e39] * 16, "count": 17},
        },
        {
            "kind": "positive_logprob",
            "details": {"positions": list(range(24, 40)), "values": [1e39] * 16, "count": 19},
        },
    ]


def test_log_probs_the_engine_sent_none_of_make_the_call_incomplete():
    # every value null: the engine sent no log probs, though it sent the list
    rec = _whole_answer(*([None] * 20))
    assert rec.status is CallStatus.INCOMPLETE
    assert np.isnan(rec.generation_log_probs).all() and rec.generation_log_probs.shape == (20,)
    assert [d.to_json() for d in rec.diagnostics] == [
        {"kind": "non_finite_logprob", "details": {"positions": list(range(16)), "count": 20}},
        {
            "kind": "capture_incomplete",
            "details": {"reasons": ["engine sent no log prob values: all 20 are null or missing"]},
        },
    ]
    # a stream whose every logprobs entry lacks its logprob key: the same
    asm = ChatCaptureAssembler(CTX)
    asm.add_chunk({"prompt_token_ids": [1], "choices": [{"index": 0, "delta": {}}]})
    for token_id in (5, 6):
        entry = {"token": "t", "bytes": [], "top_logprobs": []}
        chunk = {
            "delta": {"content": "a"},
            "token_ids": [token_id],
            "logprobs": {"content": [entry]},
        }
        asm.add_chunk({"choices": [{"index": 0, **chunk}]})
    asm.add_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    streamed = asm.finish(latency_ms=1.0, http_status=200)
    assert streamed.status is CallStatus.INCOMPLETE
    assert streamed.generation_token_ids.tolist() == [5, 6]
    assert [d.to_json() for d in streamed.diagnostics] == [
        {"kind": "non_finite_logprob", "details": {"positions": [0, 1], "count": 2}},
        {
            "kind": "capture_incomplete",
            "details": {"reasons": ["engine sent no log prob values: all 2 are null or missing"]},
        },
    ]
    # one number among them: values the engine sent, kept and flagged (the call complete)
    assert _whole_answer(None, -1.0, None).status is CallStatus.COMPLETE


def test_bad_token_values_are_refused():
    asm = ChatCaptureAssembler(CTX)
    asm.add_response(
        {
            "prompt_token_ids": [1, -3],
            "choices": [{"index": 0, "message": {}, "token_ids": [5], "logprobs": _lp(-1.0)}],
        }
    )
    rec = asm.finish(latency_ms=1.0, http_status=200)
    assert rec.status is CallStatus.INCOMPLETE
    assert rec.diagnostics[0].details["reasons"] == [
        "prompt_token_ids[1]: expected a token id (uint32), got -3"
    ]


def test_stream_end_reasons_and_incomplete_marking():
    from capture_proxy.core.assembly import mark_incomplete, stream_end_reasons
    from capture_proxy.core.records import Diagnostic

    assert stream_end_reasons(client_gone=False, problem=None, done_seen=True) == []
    assert stream_end_reasons(client_gone=False, problem=None, done_seen=False) == [
        "engine stream ended without [DONE]"
    ]
    assert stream_end_reasons(client_gone=True, problem="cut", done_seen=False) == [
        "client disconnected before the stream ended",
        "cut",
    ]
    asm = ChatCaptureAssembler(CTX)
    asm.add_chunk({"choices": [{"index": 0, "delta": {"content": "x"}}]})
    rec = asm.finish(latency_ms=1.0, http_status=200)  # already incomplete: no token data
    rec = rec.replace(
        diagnostics=[Diagnostic("non_finite_logprob", {"positions": [0]}), *rec.diagnostics]
    )
    marked = mark_incomplete(rec, ["engine stream ended without [DONE]"])
    assert marked.status is CallStatus.INCOMPLETE
    assert [d.to_json() for d in marked.diagnostics] == [
        {"kind": "non_finite_logprob", "details": {"positions": [0]}},
        {
            "kind": "capture_incomplete",
            "details": {
                "reasons": [
                    "engine sent no prompt_token_ids",
                    "engine sent no token_ids",
                    "engine sent no logprobs",
                    "engine stream ended without [DONE]",
                ]
            },
        },
    ]


def test_a_context_replaced_is_the_dataclasses_replace_and_the_original_stays():
    import dataclasses

    changes = {"sampling": {"sent": {"temperature": 0.5}}, "routed_experts_start": 7}
    copy = CTX.replace(**changes)
    assert copy == dataclasses.replace(CTX, **changes)
    assert copy.__dict__ == dataclasses.replace(CTX, **changes).__dict__
    assert CTX.sampling is None and CTX.routed_experts_start == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.sampling = None  # type: ignore[misc]
    with pytest.raises(TypeError, match="no field 'sampled'"):
        CTX.replace(sampled={})


@pytest.mark.parametrize("message", [None, "text", []])
def test_a_whole_answer_without_its_message_is_incomplete_with_its_tokens_kept(message):
    # The harness read no answer from it (a Messages harness: no content blocks at all).
    asm = ChatCaptureAssembler(CTX)
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
    choice |= {"token_ids": [10, 11], "logprobs": _lp(-0.5, -0.25)}
    asm.add_response({"prompt_token_ids": [1, 2, 3], "choices": [choice]})
    rec = asm.finish(latency_ms=1.0, http_status=200)
    assert rec.status is CallStatus.INCOMPLETE
    assert rec.diagnostics[0].details["reasons"] == ["engine sent no message in choice 0"]
    assert rec.generation_token_ids.tolist() == [10, 11]
    assert rec.generation_log_probs.tolist() == [-0.5, -0.25]
    assert rec.response_message == {"role": "assistant", "content": None}


@pytest.mark.parametrize(("stop_reason", "kept"), [("END", "END"), (151645, 151645), (True, None)])
def test_the_engines_stop_reason_is_kept_for_the_answer(stop_reason, kept):
    """vLLM's ``stop_reason`` (the matched stop string or stop token id) of a stream's last
    chunk and of a whole answer."""
    streamed = ChatCaptureAssembler(CTX)
    streamed.add_chunk({"choices": [{"index": 0, "delta": {"content": "a"}, "stop_reason": None}]})
    assert streamed.stop_reason is None
    last = {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": stop_reason}
    streamed.add_chunk({"choices": [last]})
    whole = ChatCaptureAssembler(CTX)
    message = {"role": "assistant", "content": "a"}
    whole.add_response({"choices": [{"index": 0, "message": message, "stop_reason": stop_reason}]})
    assert streamed.stop_reason == whole.stop_reason == kept


def test_sglangs_matched_stop_is_the_stop_reason():
    """SGLang's OpenAI-style chat choice names the matched stop ``matched_stop`` (vLLM:
    ``stop_reason``), streamed and whole (review)."""
    streamed = ChatCaptureAssembler(CTX)
    last = {"index": 0, "delta": {"content": "a"}, "finish_reason": "stop", "matched_stop": "END"}
    streamed.add_chunk({"choices": [last]})
    whole = ChatCaptureAssembler(CTX)
    message = {"role": "assistant", "content": "a"}
    whole.add_response(
        {"choices": [{"index": 0, "message": message, "finish_reason": "stop", "matched_stop": 7}]}
    )
    assert (streamed.stop_reason, whole.stop_reason) == ("END", 7)


@pytest.mark.parametrize(
    "bad",
    [1, "x", None, {"index": "x"}, {"index": 0, "function": "f"}, {"function": {"name": 5}},
     {"id": ["a"]}, {"function": {"arguments": {"a": 1}}}],
)  # fmt: skip
def test_a_tool_call_delta_not_of_openais_shape_is_named_never_raised(bad):
    """Engine bytes never raise (a review found ``{"tool_calls":[1]}`` raising in the
    assembler on both stream paths): the piece is left out and the record is incomplete with
    the reason; the tokens and the well-formed pieces are kept."""
    asm = ChatCaptureAssembler(CTX)
    for chunk in _stream_chunks():
        asm.add_chunk(chunk)
    asm.add_delta({"tool_calls": [bad]})
    rec = asm.finish(latency_ms=1.0, http_status=200)
    assert rec.status is CallStatus.INCOMPLETE
    assert "tool-call delta not of OpenAI's shape" in str(rec.diagnostics)
    assert rec.generation_token_ids.tolist() == [10, 11, 12, 13, 14, 15]
    assert rec.response_message["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "read", "arguments": '{"p":1}'}}
    ]
