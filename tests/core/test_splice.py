"""The exact-token splice on the cases that broke other systems (real Qwen tokenizer, our
ChatML template). No event loop: renders are computed synchronously."""

import json

import numpy as np
import pytest

from capture_proxy.core.splice import (
    Splice,
    SpliceRefused,
    adds_defaults_only,
    check_extension,
    check_prefix,
    extend_prompt,
    only_system_messages_differ,
    splice_prompt,
)
from capture_proxy.families.hf_template import LocalRenderer, tail_context
from capture_proxy.families.qwen3 import render_assistant_generation
from capture_proxy.families.qwen_vocab import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    load_chat_template,
)

EOT = frozenset({IM_END_ID})
CLOSE = frozenset({IM_END_ID, ENDOFTEXT_ID})
NEWLINE = 198  # "\n" in the Qwen vocabulary
USER = 872  # "user"
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


def test_a_sampled_stop_token_closes_the_turn_and_gets_no_second_end(renderers, qwen_tokenizer):
    """Issue 17 item 8: a turn the model ended on <|endoftext|> is closed by it; appending the
    template's <|im_end|> would give two end tokens the model never produced together."""
    r = renderers["keep_reasoning"]
    msg = {"role": "assistant", "content": "Done."}
    prompt, gen = _parent(r, qwen_tokenizer, msg, stop=False)
    messages = [*HISTORY, msg, {"role": "user", "content": "Next."}]
    other_stop = np.append(gen, np.uint32(ENDOFTEXT_ID))
    full = r.render_sync(messages, TOOLS, add_generation_prompt=True)
    through = r.render_sync(messages[:3], TOOLS, add_generation_prompt=False)
    s = splice_prompt(prompt, other_stop, full, through, end_of_turn_ids=EOT, close_ids=CLOSE)
    assert not s.added_end_of_turn
    ids = s.prompt_token_ids.tolist()
    assert ids[s.parent_end - 1 : s.parent_end + 3] == [ENDOFTEXT_ID, NEWLINE, IM_START_ID, USER]
    assert IM_END_ID not in ids[len(prompt) : s.parent_end + 1]
    # The same from the tail alone (per-call extension).
    tail = r.render_tail_sync([*HISTORY, msg], messages[3:], TOOLS, end_of_turn_text="<|im_end|>")
    e = extend_prompt(prompt, other_stop, tail, end_of_turn_id=IM_END_ID, close_ids=CLOSE)
    assert e.prompt_token_ids.tolist() == ids
    # Only a length stop gets the template's end of turn.
    cut = extend_prompt(prompt, gen, tail, end_of_turn_id=IM_END_ID, close_ids=CLOSE)
    assert cut.added_end_of_turn
    assert cut.prompt_token_ids.tolist()[cut.parent_end : cut.parent_end + 2] == [
        IM_END_ID,
        NEWLINE,
    ]
    assert cut.prompt_token_ids.tolist() == full


def test_missing_end_of_turn_and_extra_end_of_turn(renderers, qwen_tokenizer):
    r = renderers["keep_reasoning"]
    msg = {"role": "assistant", "content": "Done."}
    prompt, gen = _parent(r, qwen_tokenizer, msg, stop=False)
    messages = [*HISTORY, msg, {"role": "user", "content": "Next."}]
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


def test_only_system_messages_differ_tells_a_changed_system_prompt_from_an_edit():
    turn = {"role": "assistant", "content": "Hi."}
    parent = [{"role": "system", "content": "INSTR-ONE"}, {"role": "user", "content": "hi"}]
    user = {"role": "user", "content": "again"}
    # No instructions any more (a Responses previous_response_id without them).
    assert only_system_messages_differ(parent, [parent[1], turn, user])
    # Other instructions first, the history's developer item after them.
    dev = [{"role": "system", "content": "DEV-MSG"}, parent[1]]
    instr = {"role": "system", "content": "INSTR-TWO"}
    assert only_system_messages_differ(dev, [instr, *dev, turn, user])
    # The same system messages: not a changed system prompt (the history is the parent's).
    assert not only_system_messages_differ(parent, [*parent, turn, user])
    # A system message added after the continued turn does not change the parent's prompt.
    assert not only_system_messages_differ(parent, [*parent, turn, instr, user])
    # The system messages changed AND the conversation was edited: not only the system.
    edited = [instr, {"role": "user", "content": "hi, edited"}, turn, user]
    assert not only_system_messages_differ(parent, edited)
    # No assistant turn to continue.
    assert not only_system_messages_differ(parent, [instr, parent[1]])


def test_check_prefix_names_the_first_differing_token():
    p, g = np.array([1, 2, 3], dtype=np.uint32), np.array([4, 5], dtype=np.uint32)
    assert check_prefix(np.array([1, 2, 3, 4, 5, 6], dtype=np.uint32), p, g) is None
    assert check_prefix(np.array([1, 2, 3, 4, 9, 6], dtype=np.uint32), p, g) == 4
    assert check_prefix(np.array([1, 7, 3, 4, 5, 6], dtype=np.uint32), p, g) == 1
    assert check_prefix(np.array([1, 2, 3], dtype=np.uint32), p, g) == 3


def _fixture_chains(fixtures_dir):
    """(file, parent request messages, parent output, child request messages, tools): every
    consecutive pair of recorded calls where the child continues the parent's output."""
    from capture_proxy.harnesses.recorded import load_recording

    for path in sorted((fixtures_dir / "opencode" / "logs").glob("*.jsonl")):
        calls = [r for r in load_recording(path) if "messages" in r.body]
        for parent, child in zip(calls, calls[1:], strict=False):
            n = len(parent.body["messages"])
            msgs = child.body["messages"]
            if len(msgs) > n and msgs[n].get("role") == "assistant":
                yield path.name, parent, child


@pytest.mark.parametrize("template", ["keep_reasoning", "drop_reasoning"])
def test_tail_extension_equals_the_full_render_splice_on_every_fixture(
    renderers, qwen_tokenizer, fixtures_dir, template
):
    """Issue 16: the per-call extension (render only what follows the parent's turn) gives the
    same prompt, token for token, as splicing the full render, on every recorded session."""
    r = renderers[template]
    checked = 0
    for _, parent, child in _fixture_chains(fixtures_dir):
        tools = child.body.get("tools")
        msgs = child.body["messages"]
        j = len(parent.body["messages"])
        if len(msgs) > j + 1 and msgs[-1]["role"] == "assistant":
            # OpenCode's step-limit note: the proxy forwards it as a user message
            msgs = [*msgs[:-1], {**msgs[-1], "role": "user"}]
        prompt = np.array(
            r.render_sync(parent.body["messages"], tools, add_generation_prompt=True),
            dtype=np.uint32,
        )
        text = render_assistant_generation(parent.response_message)
        gen = np.array(
            qwen_tokenizer.encode(text, add_special_tokens=False) + [IM_END_ID], dtype=np.uint32
        )
        full = r.render_sync(msgs, tools, add_generation_prompt=True)
        through = r.render_sync(msgs[: j + 1], tools, add_generation_prompt=False)
        spliced = splice_prompt(prompt, gen, full, through, end_of_turn_ids=EOT, close_ids=CLOSE)
        tail = r.render_tail_sync(
            tail_context(msgs, j), msgs[j + 1 :], tools, end_of_turn_text="<|im_end|>"
        )
        assert tail is not None
        extended = extend_prompt(prompt, gen, tail, end_of_turn_id=IM_END_ID, close_ids=CLOSE)
        assert extended.prompt_token_ids.tolist() == spliced.prompt_token_ids.tolist()
        assert check_prefix(extended.prompt_token_ids, prompt, gen) is None
        checked += 1
    assert checked >= 16


def test_tail_of_a_template_that_rerenders_the_continued_turn_is_still_taken(qwen_tokenizer):
    """A template that renders the continued turn differently once a new user query follows
    (Qwen3 drops reasoning before the last query) still gives its tail in a small context:
    the turn itself is the model's own tokens in exact-token mode and is cut away; what
    follows it is the template's text after the turn in the whole conversation."""
    template = load_chat_template("keep_reasoning").replace(
        "{%- if keep_reasoning and reasoning -%}",
        "{%- set later_user = messages[loop.index0:] | selectattr('role', 'equalto', 'user')"
        " | list -%}{%- if keep_reasoning and reasoning and not later_user -%}",
    )
    r = LocalRenderer(qwen_tokenizer, template)
    msg = {"role": "assistant", "content": "Hi.", "reasoning_content": "Greet."}
    new = [{"role": "user", "content": "Next."}]
    tail = r.render_tail_sync([*HISTORY, msg], new, TOOLS, end_of_turn_text="<|im_end|>")
    full = qwen_tokenizer.decode(
        r.render_sync([*HISTORY, msg, *new], TOOLS, add_generation_prompt=True)
    )
    assert tail is not None
    text = qwen_tokenizer.decode(tail)
    assert text == "\n<|im_start|>user\nNext.<|im_end|>\n<|im_start|>assistant\n"
    assert full.endswith("Hi.<|im_end|>" + text)
    # Not offered: an assistant message among the new ones (its rendering may depend on the
    # whole conversation), or no user message before the turn.
    assert (
        r.render_tail_sync([*HISTORY, msg], [msg, *new], TOOLS, end_of_turn_text="<|im_end|>")
        is None
    )
    assert r.render_tail_sync([msg], new, TOOLS, end_of_turn_text="<|im_end|>") is None


def test_find_tail_ids_cuts_after_the_first_end_of_turn_after_the_head():
    from capture_proxy.families.hf_template import find_tail_ids

    eot = frozenset({9})
    head = [1, 2, 9, 3, 9]
    # the turn (5, 6) renders however it likes; the tail is what follows its end of turn
    assert find_tail_ids(head, [1, 2, 9, 3, 9, 5, 6, 9, 7, 8], eot) == [7, 8]
    assert find_tail_ids(head, [1, 2, 9, 3, 9, 5, 6, 9], eot) == []
    assert find_tail_ids(head, [1, 2, 9, 4, 9, 5, 9, 7], eot) is None  # head not a prefix
    assert find_tail_ids(head, [1, 2, 9, 3, 9, 5, 6], eot) is None  # the turn never ends


def _turn(arguments: str, content: str | None = "Editing.", call_id: str = "toolu_1") -> dict:
    function = {"name": "Edit", "arguments": arguments}
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}]}  # fmt: skip


def test_a_harness_that_only_added_arguments_kept_the_models_turn():
    model = _turn('{"file_path": "a.py", "old_string": "x"}')
    added = _turn('{"replace_all":false,"old_string":"x","file_path":"a.py"}')
    assert adds_defaults_only(model, added)
    assert adds_defaults_only(model, model)
    assert adds_defaults_only({**model, "content": None}, {**model, "content": ""})


def test_any_other_rewrite_is_the_harnesss_own_turn():
    model = _turn('{"file_path": "a.py", "old_string": "x"}')
    for harness in (
        _turn('{"file_path": "b.py", "old_string": "x"}'),  # a value changed
        _turn('{"file_path": "a.py"}'),  # an argument dropped
        _turn('{"file_path": "a.py", "old_string": "x"}', content="Other."),  # text
        _turn('{"file_path": "a.py", "old_string": "x"}', call_id="toolu_2"),  # another id
        _turn("not json"),
        {"role": "assistant", "content": "Editing."},  # the tool call dropped
    ):
        assert not adds_defaults_only(model, harness), harness
    assert not adds_defaults_only(_turn("[1]"), _turn("[1, 2]"))  # not objects
