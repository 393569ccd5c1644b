"""Tier 4: weights move under the rollout, on a real vLLM 0.32 (CPU, started by
``scripts/e2e-vllm`` with ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-scale-out``).

An 1,800-token call (``ignore_eos``, sampled) goes through the proxy; once vLLM has generated some
of it (its ``vllm:generation_tokens_total`` counter), the engine is paused in each mode
(abort, keep, wait), its version updated (``/update_weight_version``) and resumed. Both prompt
modes, whole and streamed. Checked: what the harness got, the stored ids, log probs and
weight-version spans, and, for the calls continued after an abort, the audit (transformers'
own log probs for the stitched tokens) within the bf16 tolerance.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture_proxy.proxy.weight_watch import WEIGHT_WATCHERS_KEY
from tests.realengine.conftest import VLLM_MODEL, RealStack, _stack

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(900)]

#: The issue's scenario is a 600-token call; vLLM CPU writes about 200 tokens/s of this tiny
#: model, so a 600-token call is over in 3 s, and on a loaded machine the harness and the
#: proxy (one event loop with the test) lag the engine by seconds: the calls here are 1,800
#: tokens, so the pause falls well inside them (a pause that still falls after the end is
#: tried again, ``_paused_inside``).
MAX_TOKENS = 1800
LONG_TOKENS = MAX_TOKENS
#: tokens vLLM generates before the pause
PAUSE_AFTER = 120
WAIT_S = 300.0
MODEL_DIR = os.environ.get("CAPTURE_PROXY_VLLM_MODEL_DIR", "")
_COUNTER = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", re.M)
_versions = itertools.count(1)
#: one line per case, for the issue's table (printed with -s)
TABLE: list[str] = []


@pytest.fixture
async def exact(aiohttp_client, tmp_path) -> Any:
    """Exact-token mode over vLLM's /inference/v1/generate (its spans name each token's
    version), the model directory's tokenizer decoding the ids."""
    (tmp_path / "x").mkdir()
    async for stack in _stack(
        aiohttp_client,
        tmp_path / "x",
        prompt_mode="exact_tokens",
        tokens_in_dialect="vllm_generate",
        tokenizer=MODEL_DIR,
        weight_version_poll_s=0.2,
    ):
        yield stack


@pytest.fixture
async def template(aiohttp_client, tmp_path) -> Any:
    (tmp_path / "t").mkdir()
    async for stack in _stack(aiohttp_client, tmp_path / "t", weight_version_poll_s=0.2):
        yield stack


def _generated_so_far(engine: httpx.Client) -> float:
    text = engine.get("/metrics").text
    return sum(float(v) for v in _COUNTER.findall(text))


async def _engine_post(stack: RealStack, path: str, **body: Any) -> Any:
    resp = await asyncio.to_thread(stack.engine.post, path, json=body or None, timeout=WAIT_S)
    resp.raise_for_status()
    return resp.json()


async def _when_generated(stack: RealStack, since: float, tokens: int) -> None:
    """Wait (bounded) until vLLM has generated ``tokens`` more tokens than ``since``."""
    deadline = time.monotonic() + WAIT_S
    while await asyncio.to_thread(_generated_so_far, stack.engine) < since + tokens:
        assert time.monotonic() < deadline, "vLLM generated too slowly"
        await asyncio.sleep(0.05)  # polling an observable condition, not a timing guess


def _body(
    stack: RealStack, stream: bool, seed: int, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    return {
        "model": stack.model,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": seed,
        "stream": stream,
        "return_token_ids": True,
    }


async def _read(resp: Any, stream: bool, progress: asyncio.Event | None = None) -> dict[str, Any]:
    """What the harness got: status, tokens, finish reason, whether the stream ended cleanly;
    ``progress`` is set once ``PAUSE_AFTER`` tokens of a stream have arrived."""
    if not stream:
        body = await resp.json()
        if resp.status != 200:
            return {"status": resp.status, "error": body["error"]}
        choice = body["choices"][0]
        return {
            "status": 200,
            "tokens": len(choice.get("token_ids") or []),
            "finish": choice["finish_reason"],
            "done": True,
        }
    tokens, finish, done, error = 0, None, False, None
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
        for choice in chunk.get("choices") or []:
            tokens += len(choice.get("token_ids") or [])
            finish = choice.get("finish_reason") or finish
        if progress is not None and tokens >= PAUSE_AFTER:
            progress.set()
    return {"status": resp.status, "tokens": tokens, "finish": finish, "done": done, "error": error}


async def _paused_call(
    stack: RealStack, pause: str, stream: bool, rollout: str, max_tokens: int = MAX_TOKENS
):
    """The 600-token call, paused ``PAUSE_AFTER`` tokens in with mode ``pause`` and resumed
    under a new version. Returns (what the harness got, the stored call, old, new version).
    A call is paused once vLLM's counter of generated tokens has risen by ``PAUSE_AFTER``, a
    stream also once the harness has read as many, whichever comes first."""
    old = (await asyncio.to_thread(stack.engine.get, "/weight_info")).json()["weight_version"]
    new = f"step-{os.getpid()}-{next(_versions)}"
    # The proxy reads the version every 0.2 s: make sure it has the current one before the
    # call (an observed version is the one last read, which a test cannot wait 0.2 s for).
    [watcher] = stack.client.server.app[WEIGHT_WATCHERS_KEY].by_backend.values()
    assert await watcher.read_version() == old
    since = await asyncio.to_thread(_generated_so_far, stack.engine)
    progress = asyncio.Event()
    call = asyncio.create_task(_call(stack, rollout, stream, progress, max_tokens))
    try:
        # The engine's counter too for a stream: on a loaded machine the harness may read
        # its tokens seconds after vLLM made them (the pause would come after the end).
        waits = [asyncio.create_task(_when_generated(stack, since, PAUSE_AFTER))]
        if stream:
            waits.append(asyncio.create_task(progress.wait()))
        done, pending = await asyncio.wait(waits, timeout=WAIT_S, return_when="FIRST_COMPLETED")
        for task in pending:
            task.cancel()
        assert done, "neither the harness nor vLLM saw the call's first tokens in time"
        for task in done:
            task.result()
        await _engine_post(stack, f"/pause?mode={pause}")
        await _engine_post(stack, "/update_weight_version", new_version=new)
    finally:
        await _engine_post(stack, "/resume")
    got, call_id = await asyncio.wait_for(call, WAIT_S)
    stored = await stack.get_json(f"/captures/calls/{call_id}")
    return got, stored, old, new


def _pause_fell_inside(stored: dict[str, Any], old: str) -> bool:
    """Whether the engine was paused while the call generated (not after its end)."""
    kinds = {d["kind"] for d in stored["diagnostics"]}
    spans = stored["weight_versions"] or []
    two = len({s["version"] for s in spans}) > 1
    return two or bool(
        kinds & {"generation_resumed", "generation_aborted", "weight_version_changed"}
    )


async def _paused_inside(
    stack: RealStack, pause: str, stream: bool, rollout: str, max_tokens: int = MAX_TOKENS
):
    """``_paused_call`` until the pause falls inside the call (at most 5 tries): on a loaded
    machine the proxy and the harness can lag the engine by seconds, and the pause then comes
    after the engine has finished (nothing to test then, no failure of the proxy)."""
    for attempt in range(5):
        result = await _paused_call(stack, pause, stream, f"{rollout}-{attempt}", max_tokens)
        if _pause_fell_inside(result[1], result[2]):
            return result
        stored = result[1]
        print(
            f"the pause fell after the call's end (try {attempt}): spans "
            f"{stored['weight_versions']}, diagnostics {[d['kind'] for d in stored['diagnostics']]}"
        )
    raise AssertionError(f"the pause never fell inside the call: {result[0]}")


async def _call(
    stack: RealStack, rollout: str, stream: bool, progress: asyncio.Event, max_tokens: int
) -> tuple[dict[str, Any], str]:
    resp = await stack.chat(rollout, _body(stack, stream, 7, max_tokens))
    return await _read(resp, stream, progress), resp.headers["X-Capture-Call-Id"]


def _row(case: str, got: dict[str, Any], stored: dict[str, Any]) -> None:
    spans = [(s["version"][-6:], s["start"], s["end"]) for s in stored["weight_versions"] or []]
    TABLE.append(
        f"| {case} | {got['status']} | {got.get('tokens', '-')} | {got.get('finish', '-')} | "
        f"{stored['status']} | {len(stored['generation_token_ids'])} | {spans} | "
        f"{stored['weight_version_source']} |"
    )
    print(TABLE[-1])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_abort_is_continued_in_exact_token_mode(exact: RealStack, stream: bool, tmp_path):
    got, stored, old, new = await _paused_inside(exact, "abort", stream, f"abort-x-{stream}")
    _row(f"abort, exact_tokens, {'streamed' if stream else 'whole'}", got, stored)
    assert got == {
        "status": 200,
        "tokens": MAX_TOKENS,
        "finish": "length",
        "done": True,
        **({"error": None} if stream else {}),
    }
    assert stored["status"] == "complete"
    assert len(stored["generation_token_ids"]) == MAX_TOKENS
    assert len(stored["generation_log_probs"]) == MAX_TOKENS
    spans = stored["weight_versions"]
    assert stored["weight_version_source"] == "engine_spans"
    assert [s["version"] for s in spans] == [old, new]  # the new one last
    assert spans[0]["start"] == 0 and spans[-1]["end"] == MAX_TOKENS
    assert spans[0]["end"] == spans[1]["start"] >= PAUSE_AFTER
    [resume] = next(d for d in stored["diagnostics"] if d["kind"] == "generation_resumed")[
        "details"
    ]["resumes"]
    assert resume["at_token"] == spans[0]["end"] and resume["paused"] is True
    # the stitched log probs are the model's own for the stitched tokens (the audit)
    await _audit_passes(tmp_path / "x" / "store", stored["rollout_id"])
    # a call after the update: one span of the new version
    after = await exact.chat(f"after-x-{stream}", {**_body(exact, False, 3), "max_tokens": 8})
    later = await exact.get_json(f"/captures/calls/{after.headers['X-Capture-Call-Id']}")
    assert later["weight_versions"] == [{"version": new, "start": 0, "end": 8}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_abort_in_backend_template_mode_is_an_honest_refusal(
    template: RealStack, stream: bool
):
    got, stored, old, _ = await _paused_inside(template, "abort", stream, f"abort-t-{stream}")
    _row(f"abort, backend_template, {'streamed' if stream else 'whole'}", got, stored)
    if stream:
        assert got["status"] == 200 and not got["done"] and got["error"] is not None
        assert got["finish"] is None  # no finish reason reached the harness
    else:
        assert got["status"] == 503 and got["error"]["code"] == "generation_aborted"
    assert stored["status"] == "incomplete" and stored["finish_reason"] == "abort"
    n = len(stored["generation_token_ids"])
    assert PAUSE_AFTER <= n < MAX_TOKENS
    assert stored["weight_versions"] == [{"version": old, "start": 0, "end": n}]
    assert any(d["kind"] == "generation_aborted" for d in stored["diagnostics"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("pause", ["keep", "wait"])
@pytest.mark.parametrize("mode", ["exact_tokens", "backend_template"])
async def test_keep_and_wait_hold_the_call(
    exact: RealStack, template: RealStack, mode: str, pause: str, stream: bool
):
    stack = exact if mode == "exact_tokens" else template
    rollout = f"{pause}-{mode}-{stream}"
    if pause == "wait":
        got, stored, old, new = await _paused_call(stack, pause, stream, rollout, LONG_TOKENS)
    else:
        got, stored, old, new = await _paused_inside(stack, pause, stream, rollout, LONG_TOKENS)
    _row(f"{pause}, {mode}, {'streamed' if stream else 'whole'}", got, stored)
    assert got["status"] == 200 and got["tokens"] == LONG_TOKENS and got["finish"] == "length"
    assert stored["status"] == "complete"
    assert len(stored["generation_token_ids"]) == LONG_TOKENS
    spans = stored["weight_versions"]
    changed = [d["details"] for d in stored["diagnostics"] if d["kind"] == "weight_version_changed"]
    if pause == "wait":  # the call finished before the pause took effect
        assert spans == [{"version": old, "start": 0, "end": LONG_TOKENS}] and not changed
    elif mode == "exact_tokens":  # vLLM's spans: the exact boundary, the new version last
        assert [s["version"] for s in spans] == [old, new]
        assert spans[0]["end"] >= PAUSE_AFTER and spans[-1]["end"] == LONG_TOKENS
    else:  # observed: the older version on every token, the change and where it fell said
        assert spans == [{"version": old, "start": 0, "end": LONG_TOKENS}]
        [[change]] = [c["changes"] for c in changed]
        assert (change["from"], change["to"]) == (old, new)
        assert change["tokens"][1] == LONG_TOKENS


async def _audit_passes(store_dir: Path, rollout: str) -> None:
    torch = pytest.importorskip("torch", reason="the audit extra: scripts/install-audit")
    del torch
    from capture_proxy.audit.compare import Thresholds
    from capture_proxy.audit.model import AuditModel, ModelOptions
    from capture_proxy.audit.run import AuditOptions, load_samples, run_audit
    from tests.realengine.test_audit import MODELS

    # test_audit's bf16 tolerance was measured on 16-token answers; over 600 tokens vLLM's and
    # transformers' bf16 kernels drift further apart on a few tokens (max 0.0215 seen), while
    # a log prob of the wrong context (a bad stitch) is off by 0.1-0.5 (test_audit's figures).
    long_bf16 = Thresholds(
        token_delta=0.05, max_mean_abs_delta=0.005, max_fraction_over=0.0, max_k3=1e-4
    )
    samples = await asyncio.to_thread(
        load_samples, AuditOptions(str(store_dir), rollout_ids=[rollout])
    )
    model = AuditModel(ModelOptions(MODELS / VLLM_MODEL, dtype="bfloat16"))
    result = run_audit(samples, model, None, AuditOptions("test", thresholds=long_bf16))
    lp = result.document["log_probs"]
    print(
        f"audit of {rollout}: {lp['num_compared']} tokens, mean |delta| "
        f"{lp['mean_abs_delta']:.5f}, max {lp['max_abs_delta']:.5f}; worst "
        f"{[(w['position'], round(w['delta'], 4)) for w in result.document['worst'][:3]]}"
    )
    assert lp["num_compared"] == MAX_TOKENS
    assert result.passed, result.failures
