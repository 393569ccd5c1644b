"""Prompt parents chosen by digest agree with the chain rule of ``chains.find_parents``."""

import random

import numpy as np

from capture_proxy.core.chains import find_parents
from capture_proxy.core.codec import PromptParent
from capture_proxy.core.prefixes import (
    StoredPrefix,
    choose_prompt_parent,
    choose_with_digest,
    prefix_digests,
)
from capture_proxy.core.records import CallRecord
from capture_proxy.core.stored_form import token_digest
from tests.factories import record


def stored(rec: CallRecord) -> StoredPrefix:
    return StoredPrefix(
        rec.call_id,
        rec.created_at,
        rec.num_prompt_tokens + rec.num_generation_tokens,
        token_digest(rec.prompt_token_ids, rec.generation_token_ids),
    )


def test_prefix_digests_in_one_pass():
    prompt = np.arange(10, dtype=np.uint32)
    got = prefix_digests(prompt, [3, 0, 10, 11, 3])
    assert set(got) == {0, 3, 10}
    assert got[3] == token_digest(prompt[:3], prompt[:0])
    assert got[10] == token_digest(prompt, prompt[:0])


def test_deepest_match_wins_then_earliest():
    root = record("a", [1, 2], [3], created_at=1)
    mid = record("b", [1, 2, 3, 4], [5], created_at=2)
    twin = record("c", [1, 2, 3, 4], [5], created_at=0.5)  # same tokens, earlier
    other = record("d", [9], [9], created_at=0)
    prompt = np.array([1, 2, 3, 4, 5, 6], np.uint32)
    cands = [stored(r) for r in (root, mid, twin, other)]
    assert choose_prompt_parent(prompt, cands) == PromptParent("c", 5)
    assert choose_prompt_parent(prompt, cands[:1]) == PromptParent("a", 3)
    assert choose_prompt_parent(prompt, cands[3:]) is None
    assert choose_prompt_parent(prompt, cands, exclude="c") == PromptParent("b", 5)


def test_choosing_with_the_digest_gives_the_parent_and_the_records_token_digest():
    """One pass over the prompt: the same parent as ``choose_prompt_parent`` and the record's
    ``token_digest`` (also for a strided prompt, an empty one, wider ints and no candidate)."""
    root = record("a", [1, 2], [3], created_at=1)
    mid = record("b", [1, 2, 3, 4], [5], created_at=2)
    cands = [stored(root), stored(mid), StoredPrefix("x", 0, 4, b"\0" * 32)]
    prompt = np.array([1, 2, 3, 4, 5, 6], np.uint32)
    generation = np.array([7, 8], np.uint32)
    strided = np.array([1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0], np.uint32)[::2]
    for p, g, want in [
        (prompt, generation, PromptParent("b", 5)),
        (strided, generation.astype(np.int64), PromptParent("b", 5)),
        (prompt[:4], generation, PromptParent("a", 3)),
        (prompt[:0], generation, None),
    ]:
        assert choose_with_digest(p, g, cands) == (want, token_digest(p, g))
        assert choose_prompt_parent(p, cands) == want
    assert choose_with_digest(prompt, generation, []) == (None, token_digest(prompt, generation))
    assert choose_with_digest(prompt, generation, cands, exclude="b")[0] == PromptParent("a", 3)


def test_agrees_with_chain_rule_on_random_trees():
    rng = random.Random(5)
    for trial in range(200):
        records: list[CallRecord] = []
        for i in range(rng.randint(1, 9)):
            if records and rng.random() < 0.8:
                base = rng.choice(records)
                prompt = [
                    *base.full_token_ids().tolist(),
                    *rng.choices(range(4), k=rng.randint(0, 2)),
                ]
            else:
                prompt = rng.choices(range(4), k=rng.randint(0, 3))
            gen = rng.choices(range(4), k=rng.randint(0, 2))
            records.append(record(f"c{i}", prompt, gen, created_at=float(rng.randint(0, 3))))
        parents = find_parents(records)
        cands = [stored(r) for r in records if r.num_generation_tokens > 0]
        for rec in records:
            got = choose_prompt_parent(rec.prompt_token_ids, cands, exclude=rec.call_id)
            assert (got.call_id if got else None) == parents[rec.call_id], trial
