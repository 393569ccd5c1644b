"""``RecordDigests``: a record's digests made once for verification and indexing, equal to
those computed from scratch, and never used for another record's arrays or answer."""

import hashlib

import numpy as np
import pytest

from capture_proxy.core.linking.digests import (
    extends_by_digest,
    history_digest,
    request_digest,
    turn_digests,
    turn_payload,
)
from capture_proxy.core.linking.index import LinkIndex, add_record
from capture_proxy.core.linking.record_digests import RecordDigests, token_states
from capture_proxy.core.linking.resolution import Candidate, Resolution
from capture_proxy.core.linking.stored import of_record
from capture_proxy.core.linking.verdicts import Verdict
from capture_proxy.core.linking.verification import verify_step
from capture_proxy.core.prefixes import PREFIX_BLOCK, block_states, token_digests
from capture_proxy.core.records import CallRecord
from tests.core.linking.test_digest_values import TOKEN_KEYS, prompt_of

TOOL_ANSWER = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}}
    ],
}
HISTORY = [{"role": "user", "content": "u"}]


def _record(prompt: np.ndarray, response=TOOL_ANSWER, **fields) -> CallRecord:
    generation = np.array([5, 6, 7], np.uint32)
    return CallRecord(
        call_id="c",
        rollout_id="r",
        created_at=1.0,
        model="m",
        request_messages=HISTORY,
        response_message=response,
        prompt_token_ids=prompt,
        generation_token_ids=generation,
        generation_log_probs=np.zeros(3, np.float32),
        **fields,
    )


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 600, 1024])
def test_extends_is_extends_by_digest_at_every_length(n):
    prompt = prompt_of(n)
    digests = RecordDigests(_record(prompt))
    other = prompt_of(n + PREFIX_BLOCK + 3)
    for k in sorted({0, 1, n // 2, max(n - 1, 0), n, n + 1, 255, 256, 257, 512, 513}):
        for source in (prompt, other, other + 1):
            key = hashlib_of(source[:k]) if k <= source.shape[0] else b"x" * 32
            assert digests.extends(k, key) == extends_by_digest(prompt, k, key), (n, k)
    assert digests.extends(-1, hashlib_of(prompt[:-1])) == extends_by_digest(
        prompt, -1, hashlib_of(prompt[:-1])
    )


def hashlib_of(tokens: np.ndarray) -> bytes:
    return hashlib.sha256(tokens.astype("<u4").tobytes()).digest()


@pytest.mark.parametrize("n", sorted(TOKEN_KEYS))
def test_token_key_is_token_digests(n):
    record = _record(prompt_of(n)).replace(generation_token_ids=np.arange(5, dtype=np.uint32) + 7)
    digests = RecordDigests(record)
    digests.extends(min(n, 300), b"")  # the block states made first, as verification does
    key = digests.token_key()
    assert key == token_digests(record.prompt_token_ids, record.generation_token_ids)
    assert (key[0].hex(), key[1].hex()) == TOKEN_KEYS[n]


@pytest.mark.parametrize("response", [TOOL_ANSWER, {"content": "done"}, {"content": None}])
def test_answer_forms_are_the_turns(response):
    digests = RecordDigests(_record(prompt_of(3), response))
    assert digests.answer_payload() == turn_payload(response)
    assert digests.answer_digests() == turn_digests(response)


def test_describes_the_records_of_one_call_only():
    record = _record(prompt_of(300))
    digests = RecordDigests(record)
    assert digests.describes(record.replace(parent_call_id="p", linking={"verdict": "root"}))
    # equal values are not enough: only the very arrays and answer
    assert not digests.describes(record.replace(prompt_token_ids=record.prompt_token_ids.copy()))
    assert not digests.describes(
        record.replace(generation_token_ids=record.generation_token_ids.copy())
    )
    assert not digests.describes(record.replace(response_message=dict(TOOL_ANSWER)))


def test_digests_of_another_record_are_not_used():
    first = _record(prompt_of(300))
    stale = RecordDigests(first)
    assert stale.token_key() and stale.answer_digests()  # filled for ``first``
    second = _record(prompt_of(301), {"content": "other"})
    assert of_record(second, stale) == of_record(second)
    assert of_record(second, stale).tokens_sha256 != of_record(first).tokens_sha256
    a, b = LinkIndex(), LinkIndex()
    add_record(a, second, stale)
    add_record(b, second)
    assert a.entries["c"] == b.entries["c"]
    assert a.entries["c"].turn_digest == turn_digests({"content": "other"})[0]


def test_verification_fills_what_indexing_takes():
    parent = _record(prompt_of(290))
    child_prompt = np.concatenate([parent.full_token_ids(), prompt_of(40)])
    child = _record(child_prompt, {"content": "done"}).replace(call_id="d")
    tokens, _ = token_digests(parent.prompt_token_ids, parent.generation_token_ids)
    resolution = Resolution(
        Verdict.RESOLVED,
        history_digest([*HISTORY, TOOL_ANSWER]),
        request_digest({"messages": HISTORY}),
        "c",
        candidates=(Candidate("c", None, parent.num_prompt_tokens + 3, tokens),),
    )
    results = []
    for digests in (RecordDigests(child), None):
        step = verify_step(
            child,
            resolution,
            [*HISTORY, TOOL_ANSWER],
            harness_note=None,
            retry_count=None,
            can_decode=False,
            digests=digests,
        )
        with pytest.raises(StopIteration) as done:
            next(step)
        verified = done.value.value
        results.append((verified.parent_call_id, verified.linking, of_record(verified, digests)))
    assert results[0] == results[1]
    assert results[0][0] == "c"


@pytest.mark.parametrize("n", [0, 255, 256, 700])
def test_token_states_take_the_digests_of_the_very_arrays_only(n):
    record = _record(prompt_of(n))
    fresh = token_states(record)
    assert fresh[1:] == token_digests(record.prompt_token_ids, record.generation_token_ids)
    assert [s.digest() for s in fresh[0]] == [s.digest() for s in block_states(prompt_of(n))]
    assert len(fresh[0]) == n // PREFIX_BLOCK + 1
    digests = RecordDigests(record)
    states, *key = token_states(record.replace(parent_call_id="p"), digests)
    assert states is digests.block_states() and tuple(key) == digests.token_key() == fresh[1:]
    assert digests.token_key() is digests.token_key()  # made once
    # equal values in other arrays: computed again, the same values
    copied = record.replace(prompt_token_ids=record.prompt_token_ids.copy())
    states, *key = token_states(copied, digests)
    assert states is not digests.block_states() and tuple(key) == fresh[1:]
    # other values: the record's own, never the digests'
    other = record.replace(generation_token_ids=record.generation_token_ids + 1)
    assert (
        token_states(other, digests)[1:]
        == token_digests(other.prompt_token_ids, other.generation_token_ids)
        != fresh[1:]
    )


def _digests_of(states: list) -> list[bytes]:
    return [s.digest() for s in states]


@pytest.mark.parametrize(
    ("parent_len", "child_len", "differ_at", "taken"),
    [
        (5 * PREFIX_BLOCK + 17, 9 * PREFIX_BLOCK + 3, None, 5),  # an agent's next prompt
        (5 * PREFIX_BLOCK, 5 * PREFIX_BLOCK + 1, None, 5),  # on a block's end
        (5 * PREFIX_BLOCK + 17, 9 * PREFIX_BLOCK, 3 * PREFIX_BLOCK + 9, 3),  # history edited
        (5 * PREFIX_BLOCK + 17, 9 * PREFIX_BLOCK, 0, 0),  # from the first id
        (9 * PREFIX_BLOCK, 4 * PREFIX_BLOCK + 2, None, 4),  # a shorter prompt (a branch)
        (PREFIX_BLOCK - 1, 3 * PREFIX_BLOCK, None, 0),  # no whole block in common
    ],
)
def test_a_child_goes_on_from_its_parents_block_states(parent_len, child_len, differ_at, taken):
    """``seed``: the blocks a prompt shares with its parent's, id for id, are the parent's
    states (the same objects, not hashed again); every state is the one hashed afresh."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 2**31, max(parent_len, child_len), dtype=np.uint32)
    parent = RecordDigests(_record(ids[:parent_len].copy()))
    parent.block_states()
    child_prompt = ids[:child_len].copy()
    if differ_at is not None:
        child_prompt[differ_at] += 1
    child = RecordDigests(_record(child_prompt))
    assert child.seed(parent) == taken
    states = child.block_states()
    assert _digests_of(states) == _digests_of(block_states(child_prompt))
    theirs = parent.block_states()
    assert all(a is b for a, b in zip(states[1 : taken + 1], theirs[1 : taken + 1], strict=True))
    assert not any(s is p for s in states[taken + 1 :] for p in parent.block_states())
    # and the token key and prefix checks from them are the formula's
    generation = child.generation
    assert child.token_key() == token_digests(child_prompt, generation)
    n = min(parent_len, child_len)
    sha = hashlib.sha256(child_prompt[:n].astype("<u4").tobytes()).digest()
    assert child.extends(n, sha)


def test_a_parent_without_states_seeds_nothing():
    ids = np.arange(3 * PREFIX_BLOCK, dtype=np.uint32)
    parent, child = RecordDigests(_record(ids[: PREFIX_BLOCK * 2])), RecordDigests(_record(ids))
    assert child.seed(parent) == 0
    made = child.block_states()
    assert child.seed(RecordDigests(_record(ids))) == 0  # (made already: nothing taken)
    assert child.block_states() is made
