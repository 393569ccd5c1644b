"""The SQLite writer takes the proxy's token digests of a record (``RecordDigests``, made for
verification and indexing) instead of hashing the prompt again: the same bytes are hashed, so
the rows are those of a writer that hashes itself, and digests of other arrays than the
record's (equal values or not) are never taken."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from capture_proxy.core.linking import record_digests
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.prefixes import PREFIX_BLOCK
from capture_proxy.store.sqlite import SQLiteStore
from tests.core.test_codec_v2 import chain
from tests.store.conftest import rows

_ROWS = (
    "SELECT * FROM calls ORDER BY call_id",
    "SELECT * FROM rollouts ORDER BY rollout_id",
    "SELECT * FROM counters ORDER BY name",
)


def _sha(tokens: np.ndarray) -> bytes:
    return hashlib.sha256(tokens.astype("<u4").tobytes()).digest()


def _filled(record: Any) -> RecordDigests:
    """The digests verification hands over: its block states made (a candidate checked)."""
    digests = RecordDigests(record)
    digests.extends(record.num_prompt_tokens, b"")
    return digests


async def test_the_proxys_digests_give_the_rows_the_writer_hashes(tmp_path, monkeypatch):
    # prompts of 150 to 1,300 ids: calls filed under 0 to 5 whole blocks
    calls = chain(6, new_prompt=150, gen=70)
    hashed: list[int] = []
    block_states = record_digests.block_states

    def counted(prompt: np.ndarray, known: Any = ()) -> list[Any]:
        hashed.append(prompt.shape[0])
        return block_states(prompt, known)

    monkeypatch.setattr(record_digests, "block_states", counted)
    got = {}
    others = {
        "handed": lambda c: c,
        # the digests of other arrays: equal values, or other values
        "copy": lambda c: c.replace(prompt_token_ids=c.prompt_token_ids.copy()),
        "other": lambda c: c.replace(prompt_token_ids=c.prompt_token_ids + 1),
    }
    for name in ("itself", *others):
        store = SQLiteStore(tmp_path / name)
        await store.open()
        try:
            for c in calls:
                if name == "itself":
                    await store.put_call(c)
                    continue
                digests = _filled(others[name](c))
                hashed.clear()
                await store.put_call(c, None, digests)
                # handed: the writer hashed no prompt; else it hashed the record's own
                assert hashed == ([] if name == "handed" else [c.num_prompt_tokens])
            got[name] = [rows(store, sql) for sql in _ROWS]
            keys = rows(
                store, "SELECT call_id, tokens_sha256, tokens_block_sha256 FROM calls ORDER BY 1"
            )
        finally:
            await store.close()
        # the digests of the bytes a writer hashing itself hashes: prompt + generation as <u4
        for c, (call_id, tokens_sha256, block_sha256) in zip(calls, keys, strict=True):
            full = c.full_token_ids()
            cut = full.shape[0] // PREFIX_BLOCK * PREFIX_BLOCK
            assert call_id == c.call_id
            assert tokens_sha256 == _sha(full) and block_sha256 == _sha(full[:cut])
        assert [k[2] == _sha(np.zeros(0, np.uint32)) for k in keys] == [True] + [False] * 5
    assert got["handed"] == got["itself"]
    assert got["copy"] == got["itself"] and got["other"] == got["itself"]
    parents = rows(store, "SELECT prompt_parent_call_id FROM calls ORDER BY call_id")
    assert parents == [(None,), *[(c.call_id,) for c in calls[:-1]]]
