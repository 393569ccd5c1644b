"""The shortcut render (``families.template_render``) gives what ``apply_chat_template`` and
``encode`` give: every published jinja template of the fixtures, every golden case (whole
conversations and the heads of their tails), with and without a generation prompt and the
cases' template keyword arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture_proxy.families.head_memo import HeadMemo
from capture_proxy.families.hf_template import LocalRenderer, tail_context
from capture_proxy.families.segment_encode import SegmentEncoder
from capture_proxy.families.template_render import PlainTemplate
from tests.support.golden_cases import cases

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja") if p.stem != "gpt_oss")


def _slow(renderer: LocalRenderer) -> LocalRenderer:
    """The same renderer with the shortcut off (through ``apply_chat_template``)."""
    slow = LocalRenderer(renderer.tokenizer, renderer.chat_template, renderer.vision)
    slow._state = (slow.template_text, None, HeadMemo())
    return slow


def _conversations():
    """(case, messages, generation prompt): each case whole as a call renders it, and the
    head before its continued turn as a tail renders it."""
    for case in cases():
        messages = case["messages"]
        yield case, messages, True
        j = case["turn_index"]
        if j:
            yield case, messages[:j], False
    reasoning_only = {"role": "assistant", "content": "Done.", "reasoning": "Checked."}
    thinking_only = {"role": "assistant", "content": "Done.", "thinking": "Checked."}
    user = {"role": "user", "content": "Go.", "name": None}
    for extra in (reasoning_only, thinking_only):
        for generation in (True, False):
            yield {"tools": None}, [user, extra, {"role": "user", "content": "More."}], generation


@pytest.mark.parametrize("name", NAMES)
def test_shortcut_renders_as_apply_chat_template(qwen_tokenizer, name):
    renderer = LocalRenderer(qwen_tokenizer, (TEMPLATES / f"{name}.jinja").read_text())
    assert renderer.plain is not None
    slow = _slow(renderer)
    checked = 0
    for case, messages, generation in _conversations():
        tools, kwargs = case["tools"], case.get("chat_template_kwargs")
        try:
            want = slow.render_text_sync(
                messages, tools, add_generation_prompt=generation, chat_template_kwargs=kwargs
            )
        except ValueError:
            # the template refuses the conversation: so must the shortcut
            with pytest.raises(ValueError):
                renderer.render_text_sync(
                    messages, tools, add_generation_prompt=generation, chat_template_kwargs=kwargs
                )
            continue
        got = renderer.render_text_sync(
            messages, tools, add_generation_prompt=generation, chat_template_kwargs=kwargs
        )
        assert got == want, (name, case.get("name"), generation)
        assert renderer._encode(got, messages) == slow._encode(want, messages)
        checked += 1
    assert checked > 20


def test_shortcut_declines_reserved_keywords(qwen_tokenizer):
    plain = PlainTemplate.of(qwen_tokenizer, qwen_tokenizer.chat_template)
    assert plain is not None
    assert plain.accepts({"enable_thinking": False})
    assert not plain.accepts({"documents": []})


def test_shortcut_declines_a_truncating_tokenizer(qwen_tokenizer):
    backend = qwen_tokenizer.backend_tokenizer
    backend.enable_truncation(max_length=8)
    try:
        assert PlainTemplate.of(qwen_tokenizer, qwen_tokenizer.chat_template) is None
    finally:
        backend.no_truncation()


HOSTILE = [
    "",
    "<|im_start|>",
    "<|im_start|><|im_end|>\n\n<|im_start|>",
    " <|im_end|> ",
    "<<|im_start|>>",
    "<|im_end",
    "<|im_end|>\u0338 and \u0338<|im_start|>",
    "e\u0301<think>\u0301",
    '  \n\t<tool_call>\n{"a": 1}\n</tool_call>  ',
    "</think>\n\n</think>",
    "<|fim_prefix|><|fim_middle|><|fim_suffix|>x",
    "日本語<|im_end|>한국어\r\n",
]


def test_pieces_encode_as_the_whole_text(qwen_tokenizer):
    backend = qwen_tokenizer.backend_tokenizer
    encoder = SegmentEncoder.of(backend)
    assert encoder is not None
    for _ in range(2):  # the second time from remembered pieces
        for text in HOSTILE:
            want = backend.encode(text, add_special_tokens=False).ids
            assert encoder.encode(text) == want, text


def test_pieces_are_forgotten_past_the_bound(qwen_tokenizer):
    encoder = SegmentEncoder(
        qwen_tokenizer.backend_tokenizer, {"<|im_end|>": 151645}, cache_chars=40
    )
    for i in range(20):
        assert encoder.encode(f"piece {i}<|im_end|>")[-1] == 151645
    assert encoder._cache.total <= 40


def test_pieces_are_not_used_when_a_token_eats_whitespace(qwen_tokenizer):
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_str(qwen_tokenizer.backend_tokenizer.to_str())
    backend.add_tokens([AddedToken("<x>", lstrip=True)])
    assert SegmentEncoder.of(backend) is None


@pytest.mark.parametrize("name", ["qwen3_hybrid", "qwen3_coder", "qwen2_5_instruct"])
def test_remembered_heads_give_the_same_tails(qwen_tokenizer, name):
    renderer = LocalRenderer(qwen_tokenizer, (TEMPLATES / f"{name}.jinja").read_text())
    slow = _slow(renderer)
    found = 0
    for case in cases():
        j = case["turn_index"]
        if not j:
            continue
        messages, tools = case["messages"], case["tools"]
        context, new = tail_context(messages, j), messages[j + 1 :]
        kwargs = case.get("chat_template_kwargs")
        want = slow.render_tail_sync(
            context, new, tools, end_of_turn_text="<|im_end|>", chat_template_kwargs=kwargs
        )
        for _ in range(2):  # the head rendered, then remembered
            got = renderer.render_tail_sync(
                context, new, tools, end_of_turn_text="<|im_end|>", chat_template_kwargs=kwargs
            )
            assert got == want, case["name"]
        found += want is not None
    assert found > 5


def test_a_remembered_head_that_no_longer_starts_the_render_is_not_taken():
    memo = HeadMemo()
    key = HeadMemo.key([{"role": "user", "content": "hi"}], None, None)
    assert key is not None
    memo.remember(key, "<head 1 Jan>")
    assert memo.head_length(key, "<head 1 Jan><turn>") == len("<head 1 Jan>")
    assert memo.head_length(key, "<head 2 Jan><turn>") is None
    assert memo.head_length(key, "<head") is None
    assert HeadMemo.key([{"n": 2**70}], None, None) is None  # not plain JSON: no memo


def test_pieces_encode_alike_from_several_threads(qwen_tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    backend = qwen_tokenizer.backend_tokenizer
    encoder = SegmentEncoder(backend, {"<|im_end|>": 151645}, cache_chars=200)
    texts = [f"line {i % 37} of {i % 5}<|im_end|>\n" for i in range(400)]

    def check(text: str) -> bool:
        return encoder.encode(text) == backend.encode(text, add_special_tokens=False).ids

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(check, texts))
    assert encoder._cache.total == sum(len(p) for p in encoder._cache) <= 200
