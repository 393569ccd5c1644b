"""The exact-token splice on the cases that broke other systems (real Qwen tokenizer, our
ChatML template). No event loop: renders are computed synchronously."""

import json

import numpy as np
import pytest

from capture_proxy.core.splice import Splice, SpliceRefused, check_extension, splice_prompt
from capture_proxy.rendering import LocalRenderer
from capture_proxy.tokenizer import IM_END_ID, load_chat_template, render_assistant_generation

EOT = frozenset({IM_END_ID})
NEWLINE = 198  # "\n" in the Qwen vocabulary
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
HISTORY = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Go."}]


def _call(i, args):
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps(args, ensure_ascii=False)},
    }


@pytest.fixture(scope="module")
def renderers(qwen_tokenizer):
    return {
        t: LocalRenderer(qwen_tokenizer, load_chat_template(t))
        for t in ("keep_reasoning", "drop_reasoning")
    }


def _parent(renderer, tokenizer, message, *, split_chars=False, stop=True):
    """The parent call: its prompt as the engine rendered it, its generation as sampled."""
    prompt = renderer.render_sync(HISTORY, TOOLS, add_generation_prompt=True)
    text = render_assistant_generation(message)
    if split_chars:
        gen = [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]
    else:
        gen = tokenizer.encode(text, add_special_tokens=False)
    if stop:
        gen = gen + [IM_END_ID]
    return np.array(prompt, dtype=np.uint32), np.array(gen, dtype=np.uint32)


def _splice(renderer, prompt, gen, messages, j) -> Splice:
    full = renderer.render_sync(messages, TOOLS, add_generation_prompt=True)
    through = renderer.render_sync(messages[: j + 1], TOOLS, add_generation_prompt=False)
    return splice_prompt(prompt, gen, full, through, end_of_turn_ids=EOT)


def test_newline_after_end_of_turn_is_kept_and_child_extends_parent(renderers, qwen_tokenizer):
    r = renderers["keep_reasoning"]
    msg = {"role": "assistant", "content": "", "tool_calls": [_call(0, {"command": "ls"})]}
    prompt, gen = _parent(r, qwen_tokenizer, msg)
    messages = [*HISTORY, msg, {"role": "tool", "tool_call_id": "call_0", "content": "a.txt"}]
    s = _splice(r, prompt, gen, messages, 2)
    ids = s.prompt_token_ids.tolist()
    assert ids[: s.parent_end] == prompt.tolist() + gen.tolist()
    assert ids[s.parent_end] == NEWLINE  # the template's separator, which the model never generates
    # With canonical tokens the splice equals the plain full render: nothing invented.
    assert ids == r.render_sync(messages, TOOLS, add_generation_prompt=True)
    assert not s.added_end_of_turn


def test_non_canonical_split_is_kept_verbatim(renderers, qwen_tokenizer):
    r = renderers["keep_reasoning"]
    msg = {"role": "assistant", "content": "Skinny cats"}
    prompt, gen = _parent(r, qwen_tokenizer, msg, split_chars=True)
    messages = [*HISTORY, msg, {"role": "user", "content": "More."}]
    s = _splice(r, prompt, gen, messages, 2)
    full = r.render_sync(messages, TOOLS, add_generation_prompt=True)
    assert s.prompt_token_ids.tolist() != full  # re-rendering would have re-tokenised
    assert s.prompt_token_ids.tolist()[: s.parent_end] == prompt.tolist() + gen.tolist()
    assert qwen_tokenizer.decode(s.prompt_token_ids.tolist()) == qwen_tokenizer.decode(full)


def test_stop_on_length_gets_the_end_of_turn_closed(renderers, qwen_tokenizer):
    r = renderers["keep_reasoning"]
    msg = {"role": "assistant", "content": "A long answer that was cut"}
    prompt, gen = _parent(r, qwen_tokenizer, msg, stop=False)
    messages = [*HISTORY, msg, {"role": "user", "content": "Go on."}]
    s = _splice(r, prompt, gen, messages, 2)
    ids = s.prompt_token_ids.tolist()
    assert s.added_end_of_turn
    assert ids[s.parent_end : s.parent_end + 2] == [IM_END_ID, NEWLINE]
    assert ids == r.render_sync(messages, TOOLS, add_generation_prompt=True)


def test_missing_end_of_turn_with_other_stop_token_and_extra_end_of_turn(renderers, qwen_tokenizer):
    r = renderers["keep_reasoning"]
    msg = {"role": "assistant", "content": "Done."}
    prompt, gen = _parent(r, qwen_tokenizer, msg, stop=False)
    messages = [*HISTORY, msg, {"role": "user", "content": "Next."}]
    other_stop = np.append(gen, np.uint32(151643))  # <|endoftext|>: not the template's end of turn
    s = _splice(r, prompt, other_stop, messages, 2)
    assert s.added_end_of_turn
    assert s.prompt_token_ids.tolist()[s.parent_end] == IM_END_ID
    extra = np.append(gen, np.array([IM_END_ID, IM_END_ID], dtype=np.uint32))
    s = _splice(r, prompt, extra, messages, 2)
    # What the model sampled stays, and no third end-of-turn is added.
    assert not s.added_end_of_turn
    assert s.prompt_token_ids.tolist()[s.parent_end - 2 : s.parent_end + 1] == [
        IM_END_ID,
        IM_END_ID,
        NEWLINE,
    ]


def test_reasoning_dropped_by_the_template_is_kept_from_the_parent(renderers, qwen_tokenizer):
    r = renderers["drop_reasoning"]
    msg = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Think first.",
        "tool_calls": [_call(0, {"command": "ls"})],
    }
    prompt, gen = _parent(r, qwen_tokenizer, msg)
    messages = [*HISTORY, msg, {"role": "tool", "tool_call_id": "call_0", "content": "x"}]
    s = _splice(r, prompt, gen, messages, 2)
    assert s.prompt_token_ids.tolist()[: s.parent_end] == prompt.tolist() + gen.tolist()
    assert "Think first." in qwen_tokenizer.decode(s.prompt_token_ids.tolist())
    assert "Think first." not in qwen_tokenizer.decode(
        r.render_sync(messages, TOOLS, add_generation_prompt=True)
    )


def test_several_tool_results_and_a_harness_note_after_them(renderers, qwen_tokenizer):
    r = renderers["keep_reasoning"]
    msg = {
        "role": "assistant",
        "content": "",
        "tool_calls": [_call(0, {"command": "a"}), _call(1, {"command": "b"})],
    }
    prompt, gen = _parent(r, qwen_tokenizer, msg)
    messages = [
        *HISTORY,
        msg,
        {"role": "tool", "tool_call_id": "call_0", "content": "out a"},
        {"role": "tool", "tool_call_id": "call_1", "content": "out b"},
        {"role": "user", "content": "CRITICAL - MAXIMUM STEPS REACHED"},
    ]
    s = _splice(r, prompt, gen, messages, 2)
    tail = qwen_tokenizer.decode(s.prompt_token_ids.tolist()[s.parent_end :])
    assert tail == (
        "\n<|im_start|>user\n<tool_response>\nout a\n</tool_response>\n<tool_response>\nout b\n"
        "</tool_response><|im_end|>\n<|im_start|>user\nCRITICAL - MAXIMUM STEPS REACHED<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_history_that_is_not_an_extension_is_refused():
    turn = {"role": "assistant", "content": "", "tool_calls": [_call(0, {"command": "ls"})]}
    parent_messages = [*HISTORY]
    assert check_extension(parent_messages, [*HISTORY, turn, {"role": "tool", "content": "x"}]) == 2
    # OpenCode echoes compact JSON and "" content: still the same turn.
    echoed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {**_call(0, {}), "function": {"name": "bash", "arguments": '{"command":"ls"}'}}
        ],
    }
    assert check_extension(parent_messages, [*HISTORY, echoed]) == 2
    edited = [
        {"role": "system", "content": "You are an agent. Today is another day."},
        HISTORY[1],
        turn,
    ]
    with pytest.raises(SpliceRefused) as info:
        check_extension(parent_messages, edited)
    assert info.value.message_index == 0
    compacted = [
        HISTORY[0],
        {"role": "user", "content": "Summary of earlier work."},
        HISTORY[1],
        turn,
    ]
    with pytest.raises(SpliceRefused) as info:
        check_extension(parent_messages, compacted)
    assert info.value.message_index == 1
    with pytest.raises(SpliceRefused):
        check_extension(parent_messages, [*HISTORY, {"role": "user", "content": "no assistant"}])
