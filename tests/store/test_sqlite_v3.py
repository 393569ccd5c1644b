"""The store's schema v3: message deltas, content-addressed JSON, linear growth per turn,
idempotency, deletion of unreferenced JSON and the migration of a v2 store."""

import dataclasses
import sqlite3

import pytest

from capture_proxy.core.codec import PromptParent
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.store.base import ConflictingRecord
from capture_proxy.store.sqlite import DB_FILE_NAME, SQLiteStore
from capture_proxy.store.sqlite_layout import LAYOUT_VERSION
from tests.core.test_codec_v2 import v2_form
from tests.core.test_codec_v3 import TOOLS, assert_same_json, session
from tests.store.conftest import rows as columns
from tests.store.conftest import stored_bytes as db_bytes


async def test_bytes_per_turn_do_not_grow_with_the_chain(store):
    """An OpenCode-like session: 20 KB of tools, an 8 KB system prompt, a history that grows
    each turn. The store's growth per turn (JSON included) is the same at turn 50 as at 10."""
    records = session(55)
    sizes = []
    for rec in records:
        await store.put_call(rec)
        sizes.append(db_bytes(store))
    # (Sizes are whole pages: a window of 20 turns is seen to within 205 B per turn.)
    early = (sizes[25] - sizes[5]) / 20
    late = (sizes[54] - sizes[34]) / 20
    assert late <= early * 1.2, (early, late)
    assert late < 8192  # what a turn adds: ~2 KB of messages and ~100 B of tokens, in pages
    assert columns(store, "SELECT count(*) FROM json_blobs") == [(2,)]  # tools, system prompt
    back = await store.get_rollout_calls("r1")
    for got, want in zip(back, records, strict=True):
        assert_same_json(got, want)
    assert_same_json(await store.get_call(records[-1].call_id), records[-1])


async def test_branches_and_changed_history_round_trip(store):
    records = session(4)
    branch = records[2].replace(call_id="c002b", created_at=2.5)
    branch.request_messages = [*branch.request_messages[:-1], {"role": "tool", "content": "x"}]
    edited = records[3].replace(call_id="c003e", created_at=3.5)
    edited.request_messages = [dict(m) for m in edited.request_messages]
    edited.request_messages[3]["cache_control"] = {"type": "ephemeral"}
    for rec in [*records, branch, edited]:
        await store.put_call(rec)
    got = {r.call_id: r for r in await store.get_rollout_calls("r1")}
    for rec in [*records, branch, edited]:
        assert_same_json(got[rec.call_id], rec)
        assert_same_json(await store.get_call(rec.call_id), rec)
    k = dict(columns(store, "SELECT call_id, messages_prefix_len FROM calls"))
    assert k == {"c000": 0, "c001": 2, "c002": 4, "c002b": 4, "c003": 6, "c003e": 3}


async def test_re_put_is_idempotent_however_messages_were_split(store):
    records = session(3)
    await store.put_call(records[0])
    await store.put_call(records[2])  # stored whole: c001 is not there yet
    await store.put_call(records[1])
    for rec in records:
        await store.put_call(rec)
    assert (await store.get_rollout("r1")).num_calls == 3
    for got, want in zip(await store.get_rollout_calls("r1"), records, strict=True):
        assert_same_json(got, want)
    with pytest.raises(ConflictingRecord):
        await store.put_call(records[2].replace(request_tools=TOOLS[:2]))
    with pytest.raises(ConflictingRecord):
        await store.put_call(records[2].replace(request_messages=records[2].request_messages[:-1]))
    assert_same_json(await store.get_call("c002"), records[2])


async def test_delete_keeps_json_that_other_rollouts_use(store):
    a = session(3)
    b = [r.replace(rollout_id="r2", call_id="b" + r.call_id) for r in session(2)]
    b[1].request_tools = TOOLS[:5]
    for rec in [*a, *b]:
        await store.put_call(rec)
    assert columns(store, "SELECT count(*) FROM json_blobs") == [(3,)]
    await store.delete_rollout("r2")
    assert columns(store, "SELECT count(*) FROM json_blobs") == [(2,)]  # TOOLS[:5] is gone
    for got, want in zip(await store.get_rollout_calls("r1"), a, strict=True):
        assert_same_json(got, want)
    await store.delete_rollout("r1")
    assert columns(store, "SELECT count(*) FROM json_blobs") == [(0,)]
    assert columns(store, "SELECT count(*) FROM call_json") == [(0,)]


_V2_SCHEMA = """
CREATE TABLE calls (
    call_id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL, created_at REAL NOT NULL,
    status TEXT NOT NULL, schema_version INTEGER NOT NULL, meta TEXT NOT NULL,
    prompt_token_ids BLOB NOT NULL, generation_token_ids BLOB NOT NULL,
    generation_log_probs BLOB NOT NULL, routed_experts BLOB,
    prompt_parent_call_id TEXT, prompt_prefix_len INTEGER NOT NULL DEFAULT 0,
    num_prompt_tokens INTEGER NOT NULL DEFAULT 0, num_generation_tokens INTEGER NOT NULL DEFAULT 0,
    tokens_sha256 BLOB NOT NULL DEFAULT x''
);
CREATE INDEX calls_by_rollout ON calls (rollout_id, created_at);
CREATE TABLE tombstones (rollout_id TEXT PRIMARY KEY, deleted_at REAL NOT NULL);
CREATE TABLE rollouts (
    rollout_id TEXT PRIMARY KEY, created_at REAL NOT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0, diagnostics TEXT NOT NULL DEFAULT '[]'
);
PRAGMA user_version=2;
"""


async def test_v2_store_is_migrated_on_open(tmp_path):
    *records, nxt = session(5)
    path = tmp_path / "v2"
    path.mkdir()
    with sqlite3.connect(path / DB_FILE_NAME) as db:
        db.executescript(_V2_SCHEMA)
        for i, rec in enumerate(records):
            pp = None
            if i:
                prev = records[i - 1]
                pp = PromptParent(prev.call_id, prev.num_prompt_tokens + prev.num_generation_tokens)
            enc = v2_form(rec, pp)
            db.execute(
                f"INSERT INTO calls VALUES ({','.join('?' * 15)})", dataclasses.astuple(enc)[:15]
            )
            db.execute("INSERT OR IGNORE INTO rollouts VALUES (?, 0, 0, '[]')", (rec.rollout_id,))
    s = SQLiteStore(path)
    await s.open()
    try:
        for got, want in zip(await s.get_rollout_calls("r1"), records, strict=True):
            assert_same_json(got, want)
            assert got.schema_version == 4
        assert_same_json(await s.get_call("c003"), records[3])
        for rec in records:
            await s.put_call(rec)  # idempotent against migrated rows
        await s.put_call(nxt)  # a new child gets a delta against a migrated parent
        assert_same_json(await s.get_call(nxt.call_id), nxt)
    finally:
        await s.close()
    with sqlite3.connect(path / DB_FILE_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == LAYOUT_VERSION == 10
        assert db.execute("SELECT DISTINCT schema_version FROM calls").fetchall() == [(4,)]
        # Whole v2 messages were re-split against their prompt parents'.
        ks = db.execute("SELECT messages_prefix_len FROM calls ORDER BY call_id").fetchall()
        assert [k for (k,) in ks] == [0, 2, 4, 6, 8]
        assert db.execute("SELECT count(*) FROM json_blobs").fetchone() == (2,)
        assert db.execute(
            "SELECT count(*) FROM calls WHERE meta LIKE '%request_messages%'"
        ).fetchone() == (0,)


async def test_request_encodings_computed_ahead_store_the_same_rows(make_store):
    """Matching encodings are used, foreign ones (equal values, other objects) ignored: the
    rows are those of writes without any."""
    plain, ahead = await make_store(), await make_store()
    for i, rec in enumerate(session(5)):
        await plain.put_call(rec)
        source = (
            rec if i % 2 else rec.replace(request_messages=[dict(m) for m in rec.request_messages])
        )
        await ahead.put_call(rec, RequestEncoding.of(source.request_messages, rec.request_tools))
    sql = "SELECT * FROM calls ORDER BY call_id"
    assert columns(ahead, sql) == columns(plain, sql)
    blobs = "SELECT * FROM json_blobs ORDER BY sha256"
    assert columns(ahead, blobs) == columns(plain, blobs)
    for got, want in zip(await ahead.get_rollout_calls("r1"), session(5), strict=True):
        assert_same_json(got, want)


async def test_a_matching_request_encoding_is_not_computed_again(store, monkeypatch):
    records = session(2)
    encodings = [RequestEncoding.of(r.request_messages, r.request_tools) for r in records]
    computed = []
    original = RequestEncoding.of.__func__  # type: ignore[attr-defined]

    def counting(cls, messages, tools):
        computed.append(len(messages))
        return original(cls, messages, tools)

    monkeypatch.setattr(RequestEncoding, "of", classmethod(counting))
    for rec, encoding in zip(records, encodings, strict=True):
        await store.put_call(rec, encoding)
    assert computed == []
    await store.put_call(session(3)[2])  # none given: the store computes it
    assert computed == [6]


async def test_a_prompt_parent_behind_deeper_candidates_still_shares_its_messages(store):
    """Six deeper calls of the rollout that do not prefix the child's prompt (more than
    PostgreSQL reads the messages of with the candidates): the parent is still chosen, and the
    child's messages still split after the parent's."""
    from tests.factories import record

    parent, child = session(2)
    await store.put_call(parent)
    n = child.num_prompt_tokens
    for i in range(6):
        await store.put_call(record(f"s{i}", list(range(100 + i, 100 + i + n - 2)), [7]))
    await store.put_call(child)
    split = "SELECT prompt_parent_call_id, messages_prefix_len FROM calls WHERE call_id = 'c001'"
    assert columns(store, split) == [("c000", 2)]
    assert_same_json(await store.get_call("c001"), child)
