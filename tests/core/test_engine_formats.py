"""vLLM ``/v1/completions`` tokens-in: generated ids from the log probs
(``return_tokens_as_token_ids``), the prompt echo only when asked for (vLLM 0.32 field names)."""

from __future__ import annotations

import numpy as np
import pytest

from capture_proxy.core.engine_formats import EngineFormatError, get_dialect
from capture_proxy.core.sampling import sampling_from_chat

PROMPT = np.array([11, 12, 13], dtype=np.uint32)


def _sampling():
    return sampling_from_chat({"max_tokens": 4}, num_prompt_tokens=3, max_model_len=100)


def _answer(tokens, **choice):
    return {
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "logprobs": {"tokens": tokens, "token_logprobs": [-0.25, -0.5]},
                "finish_reason": "stop",
                **choice,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }


def test_the_request_asks_for_ids_in_the_log_probs_and_no_echo_by_default():
    body = get_dialect("vllm_completions").request(PROMPT, _sampling(), stream=False, model="m")
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert "return_token_ids" not in body
    echo = get_dialect("vllm_completions", echo_prompt=True).request(
        PROMPT, _sampling(), stream=True, model="m"
    )
    assert echo["return_token_ids"] is True and echo["return_tokens_as_token_ids"] is True


def test_generated_ids_come_from_the_log_prob_tokens():
    reader = get_dialect("vllm_completions").reader()
    piece = reader.whole(_answer(["token_id:151645", "token_id:7"]))
    assert piece.token_ids == [151645, 7] and piece.saw_token_ids
    assert piece.log_probs == [-0.25, -0.5]
    assert piece.prompt_token_ids is None


def test_token_ids_of_the_choice_win_and_the_echo_is_read():
    reader = get_dialect("vllm_completions", echo_prompt=True).reader()
    piece = reader.whole(
        _answer(["token_id:5", "token_id:6"], token_ids=[5, 6], prompt_token_ids=[11, 12, 13])
    )
    assert piece.token_ids == [5, 6] and piece.prompt_token_ids == [11, 12, 13]


@pytest.mark.parametrize("tokens", [["hi", "token_id:6"], ["token_id:x"], ["token_id:-1"], "x"])
def test_log_prob_tokens_without_ids_are_refused(tokens):
    with pytest.raises(EngineFormatError):
        get_dialect("vllm_completions").reader().whole(_answer(tokens))
