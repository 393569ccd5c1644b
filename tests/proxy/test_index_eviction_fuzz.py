"""Random interleavings of several rollouts' twin sessions through a ``Linker`` on a real
``SQLiteStore``, once with ``max_rollouts=1`` (every other rollout's index loaded evicts the
least recently used one: ``RolloutIndexes._evict``), once with ``max_calls=1`` (the same as
soon as an index grows) and once with bounds never reached.

Each rollout has 2-3 twin sessions (one task, token-identical answers turn by turn), each
optionally naming its harness session. A pick moves one session on: its call in flight is
finished (verify, put, remember, release, as the flow drives it), else its next call is
resolved and stays in flight while other picks run: other rollouts' calls then load their
indexes, which evicts this rollout's under the small bound unless its calls in flight keep it
(their entries, each counted as the child of the candidate it was resolved to, are not in the
store: a reload would give the twin's continuation the candidate already taken, a branch with
the other twin left childless).

Asserted: the chains read back from the store are the same under both bounds, each session is
one chain (no branch, no call left behind; a session that names its harness session continues
its own calls), the in-flight counts follow the calls in flight at every step, each call in
flight is in the index its rollout has in memory, and once every call is released nothing is
counted and nothing keeps an index."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_proxy.core.capture import PreparedRequest, prepare_request
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.records import CallRecord
from capture_proxy.proxy.cache_bounds import CacheBounds
from capture_proxy.proxy.linker import Linker
from capture_proxy.store.sqlite import SQLiteStore

EXAMPLES = int(os.environ.get("EVICTION_FUZZ_EXAMPLES", "60"))
SYSTEM, USER, ASSISTANT, END = 1, 2, 3, 4
KNOWN = KnownMessages()


def _answer(turn: int) -> str:
    return f"answer {turn}"


def _messages(turn: int) -> list[dict[str, Any]]:
    """A twin's request at ``turn`` (every twin, every rollout: the same task)."""
    out = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Count the files."},
    ]
    for t in range(turn):
        out += [
            {"role": "assistant", "content": _answer(t)},
            {"role": "user", "content": "Continue."},
        ]
    return out


def _text(text: str) -> list[int]:
    return [100 + ord(c) for c in text]


def _render(messages: list[dict[str, Any]]) -> list[int]:
    """A toy template (a token per character): a call's prompt + generation begins its
    continuation's prompt, so each continuation verifies by tokens."""
    role = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
    ids: list[int] = []
    for m in messages:
        ids += [role[m["role"]], *_text(m["content"]), END]
    return [*ids, ASSISTANT]


@dataclass(frozen=True)
class _Plan:
    #: per rollout, per session, its number of turns
    turns: tuple[tuple[int, ...], ...]
    #: per rollout: its sessions name their harness session
    named: tuple[bool, ...]
    #: (rollout, session) picks, each moving that session on
    schedule: tuple[tuple[int, int], ...]


@st.composite
def plans(draw: st.DrawFn) -> _Plan:
    rollouts = draw(st.integers(2, 3))
    turns = tuple(
        tuple(draw(st.lists(st.integers(1, 3), min_size=2, max_size=3))) for _ in range(rollouts)
    )
    named = tuple(draw(st.lists(st.booleans(), min_size=rollouts, max_size=rollouts)))
    pick = st.integers(0, rollouts - 1).flatmap(
        lambda r: st.tuples(st.just(r), st.integers(0, len(turns[r]) - 1))
    )
    schedule = tuple(draw(st.lists(pick, max_size=40)))
    return _Plan(turns, named, schedule)


@dataclass
class _Flight:
    rollout_id: str
    call_id: str
    at: float
    turn: int
    session: str | None
    prepared: PreparedRequest
    resolution: Resolution


class _Run:
    def __init__(self, plan: _Plan, store: SQLiteStore, max_rollouts: int, max_calls: int) -> None:
        self.plan = plan
        self.store = store
        self.linker = Linker(
            store, max_rollouts=max_rollouts, bounds=CacheBounds.of(index_calls=max_calls)
        )
        self.turn = [[0] * len(t) for t in plan.turns]
        self.flight: dict[tuple[int, int], _Flight] = {}
        self.at = 0.0

    async def step(self, r: int, s: int) -> None:
        """Session ``s`` of rollout ``r`` moves on: its call in flight ends, else its next
        call is resolved (and stays in flight)."""
        call = self.flight.pop((r, s), None)
        if call is not None:
            await self._finish(call)
        elif self.turn[r][s] < self.plan.turns[r][s]:
            self.flight[r, s] = await self._resolve(r, s, self.turn[r][s])
            self.turn[r][s] += 1
        self._check_counts()

    async def _resolve(self, r: int, s: int, turn: int) -> _Flight:
        messages = _messages(turn)
        session = f"s{s}" if self.plan.named[r] else None
        prepared = prepare_request(
            {"model": "m", "messages": messages}, None, KNOWN.facts(messages)
        )
        self.at += 1.0
        call_id = f"r{r}-s{s}-{turn}"
        resolution = await self.linker.resolve(
            f"r{r}",
            prepared.linking_messages,
            prepared.body,
            call_id=call_id,
            created_at=self.at,
            linking_facts=prepared.linking_facts,
            session=("codex", session) if session else None,
            history_keys=prepared.history_keys,
        )
        return _Flight(f"r{r}", call_id, self.at, turn, session, prepared, resolution)

    async def _finish(self, call: _Flight) -> None:
        """The rest of the call as the flow drives it: verify, put, remember, release."""
        messages = _messages(call.turn)
        gen = [*_text(_answer(call.turn)), END]
        received: dict[str, Any] = {"model": "m", "messages": messages}
        if call.session is not None:
            received["prompt_cache_key"] = call.session
        record = CallRecord(
            call_id=call.call_id,
            rollout_id=call.rollout_id,
            created_at=call.at,
            model="m",
            request_messages=messages,
            request_received=received,
            response_message={"role": "assistant", "content": _answer(call.turn)},
            prompt_token_ids=np.asarray(_render(messages), np.uint32),
            generation_token_ids=np.asarray(gen, np.uint32),
            generation_log_probs=np.full(len(gen), -0.5, np.float32),
        )
        linker = self.linker
        record = await linker.verify(
            record,
            call.resolution,
            call.prepared.linking_messages,
            harness_note=None,
            retry_count=None,
            decode=None,
        )
        await self.store.put_call(record)
        session = ("codex", call.session) if call.session else None
        await linker.remember(record, session=session)
        linker.release(call.rollout_id, call.call_id)

    def _check_counts(self) -> None:
        """The linker counts exactly the calls in flight, and each is in its rollout's index
        in memory (not in one evicted: a reload from the store would not know it)."""
        linker = self.linker
        flying = {c.call_id: c.rollout_id for c in self.flight.values()}
        assert linker.indexes.in_flight_calls == flying
        assert linker.indexes.in_flight == dict(Counter(flying.values()))
        for call_id, rollout_id in flying.items():
            index = linker.indexes.peek(rollout_id)
            assert index is not None and call_id in index.entries, (call_id, list(linker.indexes))

    async def play(self) -> dict[str, str | None]:
        """The schedule, then every session played to its end (round robin across the
        rollouts, so indexes keep being evicted and loaded); the parents stored."""
        for r, s in self.plan.schedule:
            await self.step(r, s)
        left = True
        while left:
            left = False
            for r, sessions in enumerate(self.plan.turns):
                for s, turns in enumerate(sessions):
                    if (r, s) in self.flight or self.turn[r][s] < turns:
                        await self.step(r, s)
                        left = True
        linker = self.linker
        assert linker.indexes.in_flight == {} and linker.indexes.in_flight_calls == {}
        # nothing is in flight: a rollout loaded now leaves only itself under the small bound
        await linker._index("fresh")
        if linker.indexes.max_rollouts == 1 or linker.indexes.max_calls == 1:
            assert list(linker.indexes) == ["fresh"]
        parents: dict[str, str | None] = {}
        for r in range(len(self.plan.turns)):
            for record in await self.store.get_rollout_calls(f"r{r}"):
                assert record.call_id not in parents
                parents[record.call_id] = record.parent_call_id
                if record.parent_call_id is not None:
                    assert (record.linking or {}).get("verdict") == "resolved", record.linking
        return parents


def _check_chains(plan: _Plan, parents: dict[str, str | None]) -> None:
    """Each session one chain: every call past a session's first continues a call of the
    turn before in its rollout (its own session's when sessions are named), no call has two
    children, and the chains are as long as the sessions."""
    expected = {
        f"r{r}-s{s}-{t}"
        for r, sessions in enumerate(plan.turns)
        for s, turns in enumerate(sessions)
        for t in range(turns)
    }
    assert set(parents) == expected
    children: dict[str, list[str]] = {}
    for call_id, parent in parents.items():
        rollout, s, t = call_id.split("-")
        if t == "0":
            assert parent is None, call_id
            continue
        assert parent is not None, f"{call_id} is not linked"
        pr, ps, pt = parent.split("-")
        assert pr == rollout and int(pt) == int(t) - 1, (call_id, parent)
        if plan.named[int(rollout[1:])]:
            assert ps == s, f"{call_id} continued {parent}, not its own session's call"
        children.setdefault(parent, []).append(call_id)
    branched = {p: c for p, c in children.items() if len(c) > 1}
    assert not branched, f"branches: {branched}"
    for r, sessions in enumerate(plan.turns):
        lengths = []
        for call_id, parent in parents.items():
            if parent is None and call_id.startswith(f"r{r}-"):
                length, here = 1, call_id
                while here in children:
                    (here,) = children[here]
                    length += 1
                lengths.append(length)
        assert sorted(lengths) == sorted(sessions), f"r{r}: chains {lengths}, sessions {sessions}"


async def _parents(
    plan: _Plan, path: Path, max_rollouts: int, max_calls: int = 131_072
) -> dict[str, str | None]:
    store = SQLiteStore(path, synchronous="normal")
    await store.open()
    try:
        return await _Run(plan, store, max_rollouts, max_calls).play()
    finally:
        await store.close()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_twin_sessions_end_as_the_same_chains_whether_or_not_indexes_are_evicted(plan):
    with tempfile.TemporaryDirectory() as tmp:
        pressed = asyncio.run(_parents(plan, Path(tmp) / "small", max_rollouts=1))
        roomy = asyncio.run(_parents(plan, Path(tmp) / "large", max_rollouts=10_000))
        # the call bound instead: every other rollout's index goes as soon as one grows
        by_calls = asyncio.run(
            _parents(plan, Path(tmp) / "calls", max_rollouts=10_000, max_calls=1)
        )
    _check_chains(plan, roomy)
    _check_chains(plan, pressed)
    _check_chains(plan, by_calls)
    assert pressed == roomy == by_calls
