import copy

from capture_proxy.core.capture import (
    HarnessAsked,
    augment_chat_request,
    strip_chat_chunk,
    strip_chat_response,
)


def test_augment_adds_token_data_requests_without_touching_the_original():
    body = {"model": "m", "messages": [], "stream": True, "top_logprobs": None}
    original = copy.deepcopy(body)
    out, asked = augment_chat_request(body)
    assert body == original
    assert out == {
        "model": "m",
        "messages": [],
        "stream": True,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    assert asked == HarnessAsked(False, False, False, False)


def test_augment_keeps_what_the_harness_asked():
    body = {
        "logprobs": True,
        "top_logprobs": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    }
    out, asked = augment_chat_request(body)
    assert out["top_logprobs"] == 3
    assert out["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert asked.logprobs and asked.include_usage and not asked.return_token_ids


def _response():
    return {
        "id": "x",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "token_ids": [5, 6],
                "logprobs": {"content": []},
                "routed_experts": "AAA",
                "finish_reason": "stop",
            }
        ],
        "usage": {"total_tokens": 4},
    }


def test_strip_removes_only_what_the_proxy_added():
    out = strip_chat_response(_response(), HarnessAsked(False, False, False, False))
    assert out == {
        "id": "x",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "logprobs": None,  # as vLLM sends it when log probs were not asked for
                "finish_reason": "stop",
            }
        ],
        "usage": {"total_tokens": 4},
    }


def test_strip_keeps_requested_fields():
    out = strip_chat_response(_response(), HarnessAsked(True, True, False, True))
    assert out == _response()


def test_usage_only_chunk_is_dropped_unless_asked():
    chunk = {"id": "x", "choices": [], "usage": {"total_tokens": 3}}
    assert strip_chat_chunk(dict(chunk), HarnessAsked(False, False, False, False)) is None
    assert strip_chat_chunk(dict(chunk), HarnessAsked(False, False, True, False)) == chunk


def test_augment_forwards_the_harness_prompt_logprobs_and_never_adds_one():
    out, asked = augment_chat_request({"model": "m", "messages": [], "prompt_logprobs": 1})
    assert out == {
        "model": "m",
        "messages": [],
        "prompt_logprobs": 1,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
    }
    assert asked == HarnessAsked(False, False, False, False)
    assert "prompt_logprobs" not in augment_chat_request({"model": "m", "messages": []})[0]


def _engine_answer_with_prompt_logprobs():
    # vLLM's ChatCompletionResponse: prompt_logprobs comes whenever the request set it,
    # whatever return_token_ids says; prompt_token_ids only with return_token_ids.
    body = _response()
    body["prompt_logprobs"] = [None, {"2": {"logprob": -1.5, "rank": 1, "decoded_token": "b"}}]
    return body


def test_strip_keeps_prompt_logprobs_the_harness_asked_for():
    # Before: prompt_logprobs was dropped unless the harness also asked for return_token_ids,
    # so the engine computed them and the harness never saw them.
    out = strip_chat_response(
        _engine_answer_with_prompt_logprobs(), HarnessAsked(False, False, False, False)
    )
    assert out == {
        "id": "x",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"total_tokens": 4},
        "prompt_logprobs": [None, {"2": {"logprob": -1.5, "rank": 1, "decoded_token": "b"}}],
    }


def test_strip_keeps_prompt_logprobs_with_every_harness_ask():
    for asked in (HarnessAsked(True, True, True, True), HarnessAsked(True, False, False, False)):
        out = strip_chat_response(_engine_answer_with_prompt_logprobs(), asked)
        assert out["prompt_logprobs"] == [
            None,
            {"2": {"logprob": -1.5, "rank": 1, "decoded_token": "b"}},
        ]


def test_strip_chunk_removes_the_added_token_data_and_keeps_the_rest():
    # A stream's first chunk: vLLM puts prompt_token_ids on it (return_token_ids), each
    # delta carries token_ids; prompt_logprobs (which vLLM refuses with stream=True) would
    # be the engine's to send and is kept.
    chunk = {
        "id": "x",
        "prompt_token_ids": [1, 2],
        "prompt_logprobs": None,
        "choices": [
            {
                "index": 0,
                "delta": {"content": "hi"},
                "token_ids": [5],
                "logprobs": {"content": [{"token": "hi", "logprob": -0.25}]},
                "finish_reason": None,
            }
        ],
        "usage": {"total_tokens": 3},
    }
    out = strip_chat_chunk(copy.deepcopy(chunk), HarnessAsked(False, False, False, False))
    assert out == {
        "id": "x",
        "prompt_logprobs": None,
        "choices": [
            {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
        ],
    }
    assert strip_chat_chunk(copy.deepcopy(chunk), HarnessAsked(True, True, True, False)) == chunk
