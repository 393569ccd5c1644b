"""``PrefixIndex`` finds what ``choose_prompt_parent`` finds over every candidate, while
looking only at the calls that share a prompt's blocks."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.core.codec import PromptParent
from capture_proxy.core.prefixes import (
    PREFIX_BLOCK,
    PrefixIndex,
    StoredPrefix,
    block_digests,
    block_states,
    choose_prompt_parent,
    token_digests,
)
from capture_proxy.core.stored_form import token_digest

B = PREFIX_BLOCK


def _call(call_id: str, tokens: list[int], created_at: float) -> tuple[StoredPrefix, bytes]:
    ids = np.asarray(tokens, np.uint32)
    full, block = token_digests(ids[:-1], ids[-1:])
    return StoredPrefix(call_id, created_at, len(tokens), full), block


def test_token_digests_are_the_token_digest_and_the_digest_of_the_full_blocks():
    prompt = np.arange(2 * B + 10, dtype=np.uint32)
    gen = np.asarray([7, 8], np.uint32)
    full, block = token_digests(prompt, gen)
    assert full == token_digest(prompt, gen)
    assert block == token_digest(prompt[: 2 * B], prompt[:0])
    states = block_states(prompt)
    assert token_digests(prompt, gen, states) == (full, block)
    assert block_digests(prompt, states) == [
        token_digest(prompt[: j * B], prompt[:0]) for j in (1, 2)
    ]
    short_full, short_block = token_digests(prompt[:3], gen)
    assert short_full == token_digest(prompt[:3], gen)
    assert short_block == token_digest(prompt[:0], prompt[:0])


def test_block_states_hash_each_block_of_any_layout_as_its_le_u4_bytes():
    # in place, from the prompt's u4_view: a strided view, big-endian ids and int64 ids give
    # the states of their ids as <u4 bytes, block by block
    ids = np.arange(7 * B + 5, dtype=np.uint32) * 977
    for prompt in (
        ids[: 3 * B + 5],
        ids[::2],
        ids[:B].astype(">u4"),
        ids[: 2 * B].astype(np.int64),
    ):
        states = block_states(prompt)
        assert len(states) == prompt.shape[0] // B + 1
        flat = np.asarray(prompt, dtype=np.uint32)
        assert [s.digest() for s in states] == [
            token_digest(flat[: j * B], flat[:0]) for j in range(len(states))
        ]
    assert [s.digest() for s in block_states(ids[: B - 1])] == [token_digest(ids[:0], ids[:0])]


def test_deepest_call_across_blocks_then_earliest_then_smallest_id():
    base = list(range(1000, 1000 + 3 * B))
    index = PrefixIndex()
    for call_id, n, t in [("a", 5, 1.0), ("b", B + 7, 2.0), ("c", 2 * B, 3.0), ("d", 2 * B, 0.5)]:
        index.add("m", *_call(call_id, base[:n], t))
    index.add("m", *_call("x", [*base[: 2 * B + 3], 9], 0.1))  # diverges at its last id
    index.add("other", *_call("o", base[: 3 * B - 1], 0.0))
    prompt = np.asarray(base, np.uint32)
    assert index.deepest(prompt, model="m") == PromptParent("d", 2 * B)
    assert index.deepest(prompt, model="m", exclude="d") == PromptParent("c", 2 * B)
    assert index.deepest(prompt[: 2 * B - 1], model="m") == PromptParent("b", B + 7)
    assert index.deepest(prompt[:5], model="m") == PromptParent("a", 5)
    assert index.deepest(prompt[:4], model="m") is None
    assert index.deepest(prompt, model="other") == PromptParent("o", 3 * B - 1)
    assert index.deepest(np.asarray([1, 2, 3], np.uint32), model="m") is None


def test_a_call_filed_again_or_removed_is_found_by_its_new_tokens_only():
    index = PrefixIndex()
    index.add("m", *_call("a", [1, 2, 3], 1.0))
    index.add("m", *_call("a", [4, 5], 1.0))
    assert index.deepest(np.asarray([1, 2, 3, 4], np.uint32), model="m") is None
    assert index.deepest(np.asarray([4, 5, 6], np.uint32), model="m") == PromptParent("a", 2)
    index.remove("a")
    assert len(index) == 0
    assert index.deepest(np.asarray([4, 5, 6], np.uint32), model="m") is None


def test_a_call_past_one_block_needs_its_block_digest():
    call, _ = _call("a", list(range(B + 1)), 1.0)
    try:
        PrefixIndex().add("m", call, None)
    except ValueError as exc:
        assert str(exc) == "a: block_sha256 is required past one block"
    else:
        raise AssertionError("filed without its block digest")


# Token sequences from a small alphabet around block boundaries, so that many calls share
# blocks and prefixes (the case the index must get right), with ties in created_at.
_lengths = st.sampled_from([1, 2, B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 3 * B])


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.tuples(_lengths, st.integers(0, 2), st.integers(0, 3), st.sampled_from(["m", "n"])),
        min_size=1,
        max_size=12,
    ),
    prompt_len=_lengths,
    prompt_variant=st.integers(0, 2),
    exclude=st.sampled_from([None, "c0", "c1"]),
)
def test_same_answer_as_choose_prompt_parent(calls, prompt_len, prompt_variant, exclude):
    def tokens(n: int, variant: int) -> list[int]:
        # variants share everything but the id at position B + 3 (when there is one)
        out = list(range(n))
        if n > B + 3:
            out[B + 3] = 10_000 + variant
        return out

    index = PrefixIndex()
    by_model: dict[str, list[StoredPrefix]] = {"m": [], "n": []}
    for i, (n, variant, t, model) in enumerate(calls):
        call, block = _call(f"c{i}", tokens(n, variant), float(t))
        index.add(model, call, block)
        by_model[model].append(call)
    prompt = np.asarray(tokens(prompt_len, prompt_variant), np.uint32)
    for model, cands in by_model.items():
        expected = choose_prompt_parent(prompt, cands, exclude=exclude)
        assert index.deepest(prompt, model=model, exclude=exclude) == expected
