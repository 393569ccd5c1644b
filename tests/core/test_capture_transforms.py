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
