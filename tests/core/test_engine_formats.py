"""vLLM ``/v1/completions`` tokens-in: generated ids from the log probs
(``return_tokens_as_token_ids``), the prompt echo only when asked for (vLLM 0.32 field names)."""

from __future__ import annotations

import numpy as np
import pytest

from capture_proxy.core.engine_formats import (
    WINDOW,
    EngineFormatError,
    IncrementalText,
    get_dialect,
)
from capture_proxy.core.engine_formats.vllm import _ids_of_token_strings
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


_NINE = [f"token_id:{i}" for i in range(9)]


def test_many_log_prob_tokens_are_read_in_one_pass():
    tokens = [f"token_id:{i * 7919}" for i in range(40)]
    assert _ids_of_token_strings(tokens) == [i * 7919 for i in range(40)]


@pytest.mark.parametrize(
    "tokens",
    [
        [*_NINE, "token_id:1,token_id:2"],  # a comma inside one string
        [*_NINE[:-1], "token_id:1,token_id:2", ""],
        [*_NINE, 7],
        [*_NINE, "token_id:\u0663"],
        [*_NINE, "token_id:٣"],  # a digit, not an ASCII one
        [*_NINE, "token_id:"],
    ],
)
def test_many_log_prob_tokens_without_ids_are_refused(tokens):
    with pytest.raises(EngineFormatError):
        get_dialect("vllm_completions").reader().whole(_answer(tokens))


# --- IncrementalText: the text of a stream of ids, at a constant cost per token -------------

INCREMENTAL_TEXTS = [
    "héllo wörld — 你好，世界！ 🎉🎉 emoji and code: def f(x):\n    return x*2\n",
    "a" * 50 + " 日本語のテキスト " * 5,
]


@pytest.mark.parametrize("text", INCREMENTAL_TEXTS)
@pytest.mark.parametrize("seed", range(8))
def test_incremental_text_is_the_whole_decode_in_any_chunking(qwen_tokenizer, text, seed):
    import random

    def decode(ids: list[int]) -> str:
        return str(qwen_tokenizer.decode(ids, skip_special_tokens=True))

    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    inc, out, i = IncrementalText(decode), "", 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out += inc.add(ids[i : i + k], final=i + k >= len(ids))
        i += k
        assert "\ufffd" not in out  # a split character is held back until it completes
    assert out == decode(ids)


def test_incremental_text_decodes_a_bounded_window_per_step(qwen_tokenizer):
    """Per-token work does not grow with the generation: each step decodes at most the window
    and the new ids (was: every id so far, O(n^2) over a long answer)."""
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return str(qwen_tokenizer.decode(ids))

    ids = qwen_tokenizer.encode("one two three four five six " * 200, add_special_tokens=False)
    inc, out = IncrementalText(decode), ""
    for k, tid in enumerate(ids):
        out += inc.add([tid], final=k == len(ids) - 1)
    assert out == qwen_tokenizer.decode(ids)
    assert len(ids) > 1000 and max(seen) <= WINDOW + 2


def test_incremental_text_goes_on_after_a_continuation(qwen_tokenizer):
    def decode(ids: list[int]) -> str:
        return str(qwen_tokenizer.decode(ids))

    ids = qwen_tokenizer.encode("before the cut, 你好 and after it", add_special_tokens=False)
    cut = len(ids) // 2
    inc = IncrementalText(decode)
    inc.resume_after(ids[:cut], decode(ids[:cut]))
    assert decode(ids[:cut]) + inc.add(ids[cut:], final=True) == decode(ids)


# --- an abort that splits a character (weight updates: the generation is continued) ---------

SPLIT_TEXT = "日本語 🎉🎉 naïve 𝔘𝔫𝔦 done"


def _generate_piece(ids: list[int], finish: str | None) -> dict:
    content = [{"logprob": -0.5} for _ in ids]
    choice = {"index": 0, "token_ids": ids, "logprobs": {"content": content}}
    return {"choices": [{**choice, "finish_reason": finish}]}


def _split_cuts(qwen_tokenizer) -> tuple[list[int], list[int]]:
    """The text's ids, and the cuts (ids before an abort) that end inside a character."""
    ids = qwen_tokenizer.encode(SPLIT_TEXT, add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if qwen_tokenizer.decode(ids[:k]).endswith("\ufffd")]
    return ids, cuts


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_generate_text_is_exact_across_an_abort_that_splits_a_character(
    qwen_tokenizer, stream
):
    # The reader goes on after the abort (needs_decode): the split character's first bytes
    # are held back, not flushed as U+FFFD, and the continuation completes them.
    ids, cuts = _split_cuts(qwen_tokenizer)
    assert cuts == [3, 4, 9, 10, 12]  # inside the emoji and the math letters (byte-level ids)
    for cut in range(1, len(ids)):
        reader = get_dialect("vllm_generate").reader(lambda t: str(qwen_tokenizer.decode(t)))
        if stream:
            text = "".join(reader.chunk(_generate_piece([i], None)).text for i in ids[: cut - 1])
            text += reader.chunk(_generate_piece([ids[cut - 1]], "abort")).text
            text += "".join(reader.chunk(_generate_piece([i], None)).text for i in ids[cut:-1])
            text += reader.chunk(_generate_piece([ids[-1]], "stop")).text
        else:
            text = reader.whole(_generate_piece(ids[:cut], "abort")).text
            text += reader.whole(_generate_piece(ids[cut:], "stop")).text
        assert text == SPLIT_TEXT, cut


def test_a_continuation_decoded_locally_completes_the_character_the_abort_split(qwen_tokenizer):
    # The text of the ids before the cut was given without the split character's first bytes
    # (held back, as vLLM's detokenizer holds them); the continuation's text starts with it.
    def decode(t: list[int]) -> str:
        return str(qwen_tokenizer.decode(t))

    ids, cuts = _split_cuts(qwen_tokenizer)
    assert cuts
    for cut in range(1, len(ids)):
        before = IncrementalText(decode)
        given = "".join(before.add([i]) for i in ids[:cut])
        after = IncrementalText(decode)
        after.resume_after(ids[:cut], given)
        assert given + after.add(ids[cut:], final=True) == SPLIT_TEXT, cut


def test_an_engines_text_of_an_aborted_piece_holds_back_a_split_character():
    # SGLang flushes a finished request's text whole (a split character as U+FFFD); at an
    # abort the proxy holds it back for the continuation to complete. Other ends keep it.
    meta = {"finish_reason": {"type": "abort"}, "output_token_logprobs": [[-0.5, 7, None]]}
    reader = get_dialect("sglang_generate").reader()
    piece = reader.chunk({"text": "日本 \ufffd", "output_ids": [7], "meta_info": meta})
    assert (piece.text, piece.finish_reason) == ("日本 ", "abort")
    stop = {**meta, "finish_reason": {"type": "stop"}}
    piece = (
        get_dialect("sglang_generate")
        .reader()
        .chunk({"text": "日本 \ufffd", "output_ids": [7], "meta_info": stop})
    )
    assert piece.text == "日本 \ufffd"
    choice = {"index": 0, "text": "a\ufffd", "token_ids": [7], "finish_reason": "abort"}
    assert get_dialect("vllm_completions").reader().chunk({"choices": [choice]}).text == "a"
