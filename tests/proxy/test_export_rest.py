"""Tier 2: the bulk export (Arrow IPC), the token tree and ATIF over REST, and the readers
(bearer token, manifest with the samples): normal path, retries, restart, bad input."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import urllib.error
import zipfile

import numpy as np
import pyarrow as pa
import pytest

from capture_proxy import readers
from capture_proxy.core.export import EXPORT_FORMAT, MANIFEST_KEY
from capture_proxy.scripted_engine import Faults, ScriptedEngineConfig
from tests.proxy.conftest import ON_BOTH_STORES, MakeStack, Stack
from tests.proxy.test_npz_and_retention import MOE, _session


async def _freeze(stack: Stack, rollout: str) -> dict:
    resp = await stack.client.post(f"/captures/rollouts/{rollout}/freeze")
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def _export(stack: Stack, query: str = "") -> tuple[list[tuple[dict, pa.RecordBatch]], dict]:
    resp = await stack.client.get(f"/captures/export?{query}")
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/vnd.apache.arrow.stream"
    reader = pa.ipc.open_stream(io.BytesIO(await resp.read()))
    assert reader.schema.metadata[b"format"] == EXPORT_FORMAT.encode()
    out = []
    while True:
        try:
            item = reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            break
        out.append((json.loads(item.custom_metadata[MANIFEST_KEY.encode()]), item.batch))
    return out, dict(resp.headers)


@ON_BOTH_STORES
async def test_export_rows_are_the_npz_samples_exactly(make_stack: MakeStack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(moe=MOE))
    await _session(stack, "r1", steps=2)
    await stack.client.put(
        "/captures/rollouts/r1/metadata", json={"reward": 0.5, "tags": {"a": "b"}}
    )
    snap = await _freeze(stack, "r1")
    npz = readers.load_chains(
        await (await stack.client.get("/captures/rollouts/r1/chains?format=npz")).read()
    )
    [(manifest, batch)], headers = await _export(stack)
    assert headers["X-Capture-Next-After"] == "1" and headers["X-Capture-Count"] == "1"
    assert manifest["rollout_id"] == "r1" and manifest["cursor"] == snap["cursor"] == 1
    assert manifest["snapshot"]["snapshot_id"] == snap["snapshot_id"]
    assert (manifest["version"], manifest["num_samples"], manifest["superseded_by"]) == (4, 2, None)
    assert manifest["metadata"] == {"reward": 0.5, "task_id": None, "tags": {"a": "b"}}
    assert manifest["main_chain_id"] == npz.main_chain_id == npz[1].chain_id
    rows = readers.ExportedRollout(manifest, batch).samples()
    assert [r["main_chain"] for r in rows] == [False, True]
    for row, sample in zip(rows, npz, strict=True):
        for name in ("input_ids", "loss_mask", "log_probs", "routed_experts_mask"):
            assert row[name].dtype == sample.arrays[name].dtype
            assert row[name].tobytes() == sample.arrays[name].tobytes(), name
        assert np.array_equal(row["routed_experts"], sample.arrays["routed_experts"])
        assert row["generation_spans"].tolist() == sample.arrays["generation_spans"].tolist()
        assert row["call_ids"] == sample.call_ids
        assert (row["reward"], row["named_rewards"], row["tags"]) == (0.5, None, {"a": "b"})
        assert (row["snapshot_id"], row["version"], row["cursor"]) == (snap["snapshot_id"], 4, 1)


@ON_BOTH_STORES
async def test_pages_follow_the_freeze_order_and_a_repeat_is_the_same(stack: Stack):
    for rid in ("c", "a", "b", "open"):
        await _session(stack, rid, steps=1)
    for rid in ("c", "a", "b"):
        await _freeze(stack, rid)
    first, headers = await _export(stack, "limit=2")
    assert [m["rollout_id"] for m, _ in first] == ["c", "a"]
    assert headers["X-Capture-Next-After"] == "2"
    again, _ = await _export(stack, "limit=2")  # a retried request: the same rollouts
    assert [(m, b.to_pydict()) for m, b in again] == [(m, b.to_pydict()) for m, b in first]
    rest, headers = await _export(stack, "after=2&limit=2")
    assert [m["rollout_id"] for m, _ in rest] == ["b"]
    empty, headers = await _export(stack, "after=3")
    assert empty == [] and headers["X-Capture-Next-After"] == "3"


@ON_BOTH_STORES
async def test_only_the_final_episode_has_rows_unless_all_are_asked_for(stack: Stack):
    for rid in ("t1", "t1-a1", "t2"):
        await _session(stack, rid, steps=1)
        await _freeze(stack, rid)
    got, _ = await _export(stack)
    assert [(m["rollout_id"], m["superseded_by"], b.num_rows) for m, b in got] == [
        ("t1", "t1-a1", 0),
        ("t1-a1", None, 2),
        ("t2", None, 2),
    ]
    got, _ = await _export(stack, "episodes=all")
    assert [(m["rollout_id"], m["superseded_by"], b.num_rows) for m, b in got] == [
        ("t1", None, 2),
        ("t1-a1", None, 2),
        ("t2", None, 2),
    ]
    assert [(m["episode_of"], m["attempt"]) for m, _ in got] == [("t1", 0), ("t1", 1), ("t2", 0)]


@ON_BOTH_STORES
async def test_export_after_a_restart_is_the_same(make_stack: MakeStack):
    stack = await make_stack()
    for rid in ("a", "b"):
        await _session(stack, rid, steps=1)
        await _freeze(stack, rid)
    before, _ = await _export(stack)
    await stack.client.close()
    stack = await make_stack()
    after, _ = await _export(stack)
    assert [(m, b.to_pydict()) for m, b in after] == [(m, b.to_pydict()) for m, b in before]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("status=open", "status"),
        ("after=-1", "after"),
        ("after=x", "after"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("episodes=last", "episodes"),
    ],
)
async def test_bad_export_parameters_are_400s_naming_them(stack: Stack, query, param):
    resp = await stack.client.get(f"/captures/export?{query}")
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param


@pytest.mark.parametrize(
    ("after", "shown"),
    [
        ("9223372036854775808", "9223372036854775808"),
        ("99999999999999999999999", "99999999999999999999999"),
        ("1" * 5000, f"{'1' * 40}... (5000 digits)"),
    ],
)
async def test_a_cursor_past_64_bits_is_a_400_saying_the_bound(stack: Stack, after, shown):
    resp = await stack.client.get(f"/captures/export?after={after}")
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": "after: a cursor is at most 9223372036854775807 (a 64-bit signed integer), "
        f"got {shown}",
        "type": "invalid_request_error",
        "param": "after",
        "code": "invalid_cursor",
    }


@ON_BOTH_STORES
async def test_the_largest_cursor_is_an_empty_page(stack: Stack):
    await _session(stack, "r1")
    await _freeze(stack, "r1")
    for after in ("9223372036854775807", "0" * 30 + "9223372036854775807"):
        page, headers = await _export(stack, f"after={after}")
        assert page == []
        assert headers["X-Capture-Next-After"] == "9223372036854775807"


@ON_BOTH_STORES
async def test_tree_holds_every_path_once_and_each_path_exactly(stack: Stack):
    await _session(stack, "r1", steps=3)
    await _freeze(stack, "r1")
    npz = readers.load_chains(
        await (await stack.client.get("/captures/rollouts/r1/chains?format=npz")).read()
    )
    resp = await stack.client.get("/captures/rollouts/r1/tree")
    assert resp.status == 200 and resp.content_type == "application/zip"
    tree = readers.load_tree(await resp.read())
    assert tree.num_path_tokens == sum(len(s.arrays["input_ids"]) for s in npz)
    # The title call and the agent chain share the start of the system prompt at most.
    assert tree.num_tokens < tree.num_path_tokens
    assert [leaf["leaf_call_id"] for leaf in tree.leaves] == [s.leaf_call_id for s in npz]
    for i, sample in enumerate(npz):
        idx = tree.path_indices(i)
        for name in ("input_ids", "loss_mask", "log_probs"):
            assert tree.arrays[name][idx].tobytes() == sample.arrays[name].tobytes()
        assert tree.arrays["positions"][idx].tolist() == list(range(len(idx)))
    resp = await stack.client.get("/captures/rollouts/nope/tree")
    assert resp.status == 404


@ON_BOTH_STORES
async def test_atif_steps_carry_the_tokens_and_strict_refuses_gaps(stack: Stack):
    await _session(stack, "r1", steps=2)
    atif = await stack.get_json("/captures/rollouts/r1/atif?agent_name=opencode")
    chains = await stack.get_json("/captures/rollouts/r1/chains")
    agent = chains["chains"][1]["calls"]
    assert atif["schema_version"] == "ATIF-v1.4" and atif["session_id"] == "r1"
    assert atif["agent"] == {
        "name": "opencode",
        "version": "unknown",
        "model_name": "scripted-qwen",
    }
    assert [s["source"] for s in atif["steps"]] == ["system", "user", "agent", "agent"]
    assert [s["step_id"] for s in atif["steps"]] == [1, 2, 3, 4]
    for step, call in zip(atif["steps"][2:], agent, strict=True):
        m = step["metrics"]
        assert m["prompt_token_ids"] == call["prompt_token_ids"]
        assert m["completion_token_ids"] == call["generation_token_ids"]
        assert m["logprobs"] == call["generation_log_probs"]
        assert m["extra"]["call_id"] == call["call_id"]
    first = atif["steps"][2]
    [tc] = first["tool_calls"]
    assert first["observation"] == {
        "results": [{"source_call_id": tc["tool_call_id"], "content": "out 0"}]
    }
    assert atif["extra"]["other_chain_ids"] == [chains["chains"][0]["chain_id"]]
    assert atif["extra"]["gaps"] == []
    assert (await stack.get_json("/captures/rollouts/r1/atif?strict=true"))["steps"] == atif[
        "steps"
    ]
    resp = await stack.client.get("/captures/rollouts/r1/atif?strict=yes")
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "strict"


@ON_BOTH_STORES
async def test_strict_atif_of_a_rollout_with_a_gap_is_a_422(make_stack: MakeStack):
    stack = await make_stack(engine_config=ScriptedEngineConfig(faults=Faults(nan_logprob_at=1)))
    await _session(stack, "r1", steps=1)
    resp = await stack.client.get("/captures/rollouts/r1/atif?strict=true")
    assert resp.status == 422
    error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("rollout_has_gaps", "strict")
    assert "non_finite_logprob" in error["message"]
    loose = await stack.get_json("/captures/rollouts/r1/atif")
    assert {g["kind"] for g in loose["extra"]["gaps"]} == {"non_finite_logprob"}


@ON_BOTH_STORES
async def test_readers_send_the_bearer_token_and_return_the_manifest(make_stack: MakeStack):
    stack = await make_stack(captures_token="read-secret")
    headers = {"Authorization": "Bearer read-secret"}
    await _session(stack, "r1", steps=1)
    resp = await stack.client.post("/captures/rollouts/r1/freeze", headers=headers)
    assert resp.status == 200
    base = str(stack.client.make_url("/")).rstrip("/")

    def read_all():
        chains = readers.fetch_chains(base, "r1", token="read-secret")
        tree = readers.fetch_tree(base, "r1", token="read-secret")
        atif = readers.fetch_atif(base, "r1", token="read-secret", strict=True)
        exported = list(readers.iter_rollouts(base, token="read-secret"))
        try:
            readers.fetch_chains(base, "r1")
        except urllib.error.HTTPError as exc:
            refused = exc.code
        return chains, tree, atif, exported, refused

    chains, tree, atif, exported, refused = await asyncio.to_thread(read_all)
    assert refused == 401
    assert (chains.incomplete, chains.unlinked_call_ids) == (False, [])
    assert chains.main_chain_id == chains[1].chain_id and chains.main_chain == [chains[1]]
    assert chains.manifest["lifecycle"]["status"] == "frozen"
    assert len(chains) == 2 and tree.num_path_tokens == sum(
        len(s.arrays["input_ids"]) for s in chains
    )
    assert atif["session_id"] == "r1"
    assert [r.rollout_id for r in exported] == ["r1"]


def test_load_chains_of_something_else_is_a_value_error(tmp_path):
    for junk in (b"not a zip", b""):
        with pytest.raises(ValueError, match="not a chains archive"):
            readers.load_chains(junk)
    empty = io.BytesIO()
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("other.txt", "x")
    with pytest.raises(ValueError, match="not a chains archive"):
        readers.load_chains(empty.getvalue())
    with pytest.raises(ValueError, match="not a token tree archive"):
        readers.load_tree(b"junk")
    path = tmp_path / "x.zip"
    path.write_bytes(b"junk")
    with pytest.raises(ValueError):
        readers.load_chains(path)


def test_the_bulk_reader_without_pyarrow_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what a missing package looks like
    with pytest.raises(ImportError, match=r"pip install 'capture-proxy\[arrow\]'"):
        next(readers.iter_rollouts("http://127.0.0.1:9"))


class _CutAfter(io.RawIOBase):
    """An export page whose connection drops after ``cut`` bytes (the proxy's
    ``read_send_timeout_s`` ran out while the trainer worked on a rollout)."""

    def __init__(self, data: bytes, cut: int) -> None:
        self._data, self._cut, self._at = data, cut, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._at >= self._cut:
            raise ConnectionResetError("connection reset by peer")
        n = min(len(buffer), self._cut - self._at)
        buffer[:n] = self._data[self._at : self._at + n]
        self._at += n
        return n


async def test_a_cut_export_page_is_asked_again_after_the_last_rollout_handed_out(
    make_stack: MakeStack, monkeypatch
):
    stack = await make_stack()
    for rollout in ("r1", "r2", "r3"):
        await _session(stack, rollout, steps=1)
        assert (await stack.client.post(f"/captures/rollouts/{rollout}/freeze")).status == 200
    base = str(stack.client.make_url("/")).rstrip("/")
    real_get = readers._get
    asked: list[str] = []

    def get(url: str, token, timeout_s):
        asked.append(url)
        with real_get(url, token, timeout_s) as resp:
            data = resp.read()
        if len(asked) == 1:  # the first page is cut in its second rollout
            return io.BufferedReader(_CutAfter(data, len(data) // 2))
        return io.BytesIO(data)

    monkeypatch.setattr(readers, "_get", get)
    got = await asyncio.to_thread(lambda: list(readers.iter_rollouts(base)))
    assert [r.rollout_id for r in got] == ["r1", "r2", "r3"]
    cursors = [int(r.manifest["cursor"]) for r in got]
    assert cursors == sorted(cursors)
    assert "after=0&" in asked[0] and f"after={cursors[0]}&" in asked[1]
    assert len(asked) == 2  # the resumed page is short: the end

    # cut every time with nothing read in between: raised after CUT_RESUMES more asks
    asked.clear()

    def always_cut(url: str, token, timeout_s):
        asked.append(url)
        return io.BufferedReader(_CutAfter(b"", 0))

    monkeypatch.setattr(readers, "_get", always_cut)
    with pytest.raises(ConnectionResetError):
        await asyncio.to_thread(lambda: list(readers.iter_rollouts(base)))
    assert len(asked) == readers.CUT_RESUMES + 1
