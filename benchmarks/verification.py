"""Reading a benchmark's proxied calls back over REST: each call the harness saw is stored
complete with the engine's token counts, each rollout one chain of its steps.

Must not: send model calls (``sessions``).
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

# Imported by scripts run by path (``benchmarks/load.py``, ``rollout_size.py`` imports it as
# ``sessions``) and by the tests: with the repository root on sys.path ``benchmarks.`` resolves.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sessions import CALL_ID_HEADER, CallResult  # noqa: E402


@dataclass
class Verification:
    rollouts_checked: int = 0
    calls_checked: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.problems.append(text)


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    """GET ``url``: the status and the JSON body."""
    async with session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def verify_calls(
    session: aiohttp.ClientSession, proxy_url: str, calls: list[CallResult], v: Verification
) -> None:
    """Every call whose ``[DONE]`` the harness saw is stored complete, with the engine's token
    counts (``usage``) and, when the harness asked for them, the exact ids and log probs."""
    sem = asyncio.Semaphore(32)

    async def one(r: CallResult) -> None:
        if r.call_id is None:
            v.problem(f"{r.rollout_id} step {r.step}: completed without {CALL_ID_HEADER}")
            return
        async with sem:
            status, rec = await get_json(session, f"{proxy_url}/captures/calls/{r.call_id}")
        v.calls_checked += 1
        if status != 200:
            v.problem(f"{r.call_id}: GET answered {status}")
            return
        problems = check_record(r, rec)
        v.problems += [f"{r.call_id}: {p}" for p in problems]

    await asyncio.gather(*(one(r) for r in calls if r.done))


def check_record(r: CallResult, rec: dict[str, Any]) -> list[str]:
    """What differs between a stored call and what the harness received."""
    out = []
    if rec.get("status") != "complete":
        out.append(f"status {rec.get('status')}")
    if rec.get("rollout_id") not in (None, r.rollout_id):
        out.append(f"rollout {rec.get('rollout_id')} != {r.rollout_id}")
    prompt, gen = rec.get("prompt_token_ids") or [], rec.get("generation_token_ids") or []
    if r.usage is not None and (
        len(prompt) != r.usage.get("prompt_tokens") or len(gen) != r.usage.get("completion_tokens")
    ):
        out.append(f"token counts {len(prompt)}/{len(gen)} != usage {r.usage}")
    if r.prompt_token_ids is not None and prompt != r.prompt_token_ids:
        out.append("prompt token ids differ from what the engine sent")
    if r.generation_token_ids and gen != r.generation_token_ids:
        out.append("generation token ids differ from what the engine sent")
    if r.generation_log_probs:
        import numpy as np

        want = np.asarray(r.generation_log_probs, dtype=np.float32)
        got = np.asarray(rec.get("generation_log_probs") or [], dtype=np.float32)
        if want.shape != got.shape or not np.array_equal(want, got):
            out.append("generation log probs differ from what the engine sent")
    return out


async def verify_chains(
    session: aiohttp.ClientSession,
    proxy_url: str,
    sessions: dict[str, list[CallResult]],
    steps: int,
    v: Verification,
) -> None:
    """Each rollout whose every call completed is one chain of its calls, in order, linked
    parent to child, nothing unlinked, not incomplete."""
    full = {
        rid: [[r.call_id for r in calls]]
        for rid, calls in sessions.items()
        if len(calls) == steps and all(c.ok for c in calls)
    }
    await _verify_rollouts(session, proxy_url, full, v)


async def verify_shared_chains(
    session: aiohttp.ClientSession,
    proxy_url: str,
    results: list[CallResult],
    steps: int,
    v: Verification,
) -> None:
    """Many sessions in one rollout (``CallResult.session_id``): each rollout whose every call
    completed holds exactly one chain per session, each the session's calls in order, linked
    parent to child, nothing unlinked, not incomplete. ``rollouts_checked`` counts sessions."""
    full = session_chains(results, steps)
    await _verify_rollouts(session, proxy_url, full, v)
    v.rollouts_checked += sum(len(chains) for chains in full.values()) - len(full)


def session_chains(results: list[CallResult], steps: int) -> dict[str, list[list[str | None]]]:
    """Rollout -> the chain of call ids of each of its sessions (``CallResult.session_id``),
    for the rollouts whose every session made ``steps`` calls, all complete."""
    plans: dict[str, dict[str, list[CallResult]]] = {}
    for r in sorted(results, key=lambda r: r.step):
        plans.setdefault(r.rollout_id, {}).setdefault(r.session_id or "", []).append(r)
    return {
        rid: [[r.call_id for r in calls] for calls in by_session.values()]
        for rid, by_session in plans.items()
        if all(len(calls) == steps and all(c.ok for c in calls) for calls in by_session.values())
    }


async def _verify_rollouts(
    session: aiohttp.ClientSession,
    proxy_url: str,
    want: dict[str, list[list[str | None]]],
    v: Verification,
) -> None:
    """Each rollout's chains read over REST are ``want[rollout]`` (in any order)."""
    sem = asyncio.Semaphore(32)

    async def one(rollout_id: str, chains: list[list[str | None]]) -> None:
        async with sem:
            status, body = await get_json(
                session, f"{proxy_url}/captures/rollouts/{rollout_id}/chains"
            )
        v.rollouts_checked += 1
        if status != 200:
            v.problem(f"{rollout_id}: chains answered {status}")
            return
        v.problems += chain_problems(rollout_id, chains, body)

    await asyncio.gather(*(one(rid, chains) for rid, chains in want.items()))


def chain_problems(
    rollout_id: str, want: list[list[str | None]], body: dict[str, Any]
) -> list[str]:
    """What differs between a rollout's chains read over REST (``body``) and the chains the
    harness made (``want``: each a list of call ids in order; the chains in any order)."""
    out = []
    got = [[c["call_id"] for c in ch["calls"]] for ch in body.get("chains", [])]
    if sorted(got, key=str) != sorted(want, key=str):
        if len(want) == 1:
            out.append(f"{rollout_id}: chains {got} != {want}")
        else:
            out.append(f"{rollout_id}: {len(got)} chains are not the {len(want)} sessions")
    for ch in body.get("chains", []):
        parents = [c["parent_call_id"] for c in ch["calls"]]
        ids = [c["call_id"] for c in ch["calls"]]
        if parents != [None, *ids[:-1]]:
            out.append(f"{rollout_id}: parents {parents} do not follow {ids}")
    if body.get("unlinked_calls"):
        out.append(f"{rollout_id}: {len(body['unlinked_calls'])} unlinked calls")
    if body.get("incomplete"):
        out.append(f"{rollout_id}: marked incomplete ({body.get('diagnostics')})")
    return out


async def stored_call_count(session: aiohttp.ClientSession, proxy_url: str) -> int:
    status, body = await get_json(session, proxy_url + "/health")
    return int(body["store"]["calls"]) if status == 200 else -1


def by_rollout(results: list[CallResult]) -> dict[str, list[CallResult]]:
    out: dict[str, list[CallResult]] = {}
    for r in sorted(results, key=lambda r: r.step):
        out.setdefault(r.rollout_id, []).append(r)
    return out
