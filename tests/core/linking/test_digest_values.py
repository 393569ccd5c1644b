"""The digests' exact values for fixed inputs: they are stored on records and served over REST,
so a change in how they are computed must not change one byte of them."""

import hashlib

import numpy as np
import pytest

from capture_proxy.core.linking.digests import (
    child_digest,
    child_digest_after,
    history_digest,
    request_digest,
    turn_digest,
    turn_digests,
)
from capture_proxy.core.prefixes import token_digests

TOOL_TURN = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_7",
            "type": "function",
            "function": {"name": "read", "arguments": '{"path": "caf\\u00e9.py", "n": 2}'},
        }
    ],
}
HISTORY = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    TOOL_TURN,
    {"role": "tool", "tool_call_id": "call_7", "content": "x"},
]
ANSWER = {"content": "done", "tool_calls": []}
BODY = {
    "model": "m",
    "messages": HISTORY,
    "tools": [{"type": "function", "function": {"name": "read"}}],
    "stream": True,
}
HISTORY_DIGEST = "6dcd5b82c8c10bfe7a1a4e697dda83258d22ac24b02ab72619a28352c2875202"
CHILD_DIGEST = "6d0fec0f22ea4706a7c37044765fd697272482336b9aeb70a2c9e96d353cdc15"


def test_history_and_child_digests():
    assert history_digest(HISTORY) == HISTORY_DIGEST
    assert child_digest(HISTORY, ANSWER) == CHILD_DIGEST
    assert child_digest_after(HISTORY_DIGEST, ANSWER) == CHILD_DIGEST
    # a root's answer: the first step of the chain
    assert child_digest_after(None, TOOL_TURN) == HISTORY_DIGEST


def test_request_digest():
    assert request_digest(BODY) == (
        "6344edb720b5b51566a7476192ffc5422fb460894d83ef2c54d9158afaebb0f8"
    )


def test_turn_digests():
    assert turn_digests(TOOL_TURN) == (
        "2b15b8e567771f58c9e3e91dbc3df29c6b26e04c0d36c39e1da0c877ab53af60",
        "c0ac4ad7353b5de35e91746bf07b9395d2b399738bf31f2f00f0d41fc209ec96",
    )
    assert turn_digest(TOOL_TURN) == turn_digests(TOOL_TURN)[0]
    assert turn_digest(TOOL_TURN, with_ids=False) == turn_digests(TOOL_TURN)[1]
    assert turn_digest(ANSWER) == (
        "01b6438df57828b390a1c5daed30f3f5c48baaf302ee410cc0eec2f7d35473ad"
    )


def prompt_of(n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint32) * 2654435761) % 151000).astype(np.uint32)


GENERATION = np.arange(5, dtype=np.uint32) + 7
EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
BLOCK_1 = "99000c110b560c6c5d41ff33f009511b6bedbec3571b4a16524a0450530f7bae"
BLOCK_2 = "f4b58ac0230ccb9d3b4bb45065c5ddc7b6c02270f57abf203605fef04e25fe21"
TOKEN_KEYS = {
    3: ("2a714efc558f0c715094a26eb7034a1ad76f553c0ff6e8bdbf0eb295710f6a91", EMPTY),
    255: (
        "e0cad2075d68b7f03c0894ab6a5e7a50e9f34f53c7add907ab1ff59a1119d9f1",
        "0d5c43bac139b669f8736bfc3155b46b0fb09dea8521d5f97401da8bb37c4158",
    ),
    256: ("1cbba10e125a1de13be8d6050208885dd0744e390d01c62b7662ab4a6c6e6bd5", BLOCK_1),
    300: ("08965b4431457c5f8bc43a633038041ea4a616fd95cb95659bd7c3c1ad31e954", BLOCK_1),
    512: ("594a39951a4385d173bb77613b2dbe46f68b5cab712f28e813608a2b8b982637", BLOCK_2),
    700: ("4af2b554b2fb5331fcc4806cb04b1fe483294dc4caacd19873b25fee58ed80f9", BLOCK_2),
}


@pytest.mark.parametrize("n", sorted(TOKEN_KEYS))
def test_token_digests(n):
    tokens, block = token_digests(prompt_of(n), GENERATION)
    assert (tokens.hex(), block.hex()) == TOKEN_KEYS[n]


@pytest.mark.parametrize("num_prompt", [0, 1, 200, 255, 256, 257, 511, 700])
@pytest.mark.parametrize("num_generation", [0, 1, 56, 300])
def test_token_digests_are_those_of_the_joined_ids(num_prompt, num_generation):
    """Whatever block the prompt / generation boundary and the block cut fall in."""
    prompt, generation = prompt_of(num_prompt), prompt_of(num_generation) + 3
    full = np.concatenate([prompt, generation]).astype("<u4").tobytes()
    cut = (num_prompt + num_generation) // 256 * 256
    assert token_digests(prompt, generation) == (
        hashlib.sha256(full).digest(),
        hashlib.sha256(full[: 4 * cut]).digest(),
    )
