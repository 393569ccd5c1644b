"""Random interleavings of several sessions of one rollout, through the pure linking steps
(``prepare_request`` -> ``resolve_step`` -> ``verify_step`` -> ``add_record``), on one index
or on two workers' indexes with shared claims (``serve --workers``).

Every session answers alike turn by turn (its answers are the others'), so all calls of a
turn share a child digest; sessions with the same task are twins (token-identical calls).
Asserted: each call past a session's first is linked (``resolved``) to a call of the turn
before of a session with the same task, no call has two children, and a session that names
its harness session continues its own chain. The final parents are compared with the same
run without history keys (``history_keys=(None, None)``, the order before them): the keys
choose the first candidate, never what links.

A worker's index is made when its first call of the rollout arrives, from the calls stored
so far (``Linker._index``: ``get_rollout_calls`` -> ``add_record``, which tells no history
key); afterwards it catches up before each resolution with the rows stored since
(``refresh_index`` of ``StoredCall``s whose history key a row's message chain gives, as
``of_row`` reads it)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_proxy.core.capture import prepare_request
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.linking.commands import (
    CatchUp,
    Detokenize,
    FindPrefixAncestor,
    ReadParent,
)
from capture_proxy.core.linking.index import LinkIndex, add_record, refresh_index
from capture_proxy.core.linking.parent_lookup import resolve_step
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.stored import of_record
from capture_proxy.core.linking.verification import verify_step
from capture_proxy.core.records import CallRecord
from tests.core.linking.test_siblings_in_flight import _SharedClaims

SYSTEM, USER, ASSISTANT, END = 1, 2, 3, 4
EXAMPLES = int(os.environ.get("HISTORY_FUZZ_EXAMPLES", "300"))


class _Vocab:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        return self.ids.setdefault(text, 100 + len(self.ids))


def _text(text: str, vocab: _Vocab) -> list[int]:
    return [vocab(c) for c in text]  # a token per character: a prefill splits no token


def _render(messages: list[dict[str, Any]], vocab: _Vocab, *, open_last: bool = False) -> list[int]:
    """A toy template: each message its role token, its text's tokens, an end token; the
    generation prompt after them (``open_last``: the last message left open, a prefill). A
    call's prompt + generation is the rendering of its messages and its answer, so a
    continuation's prompt begins with it."""
    role = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
    ids: list[int] = []
    for i, m in enumerate(messages):
        ids += [role[m["role"]], *_text(m["content"], vocab)]
        if not (open_last and i == len(messages) - 1):
            ids.append(END)
    return ids if open_last else [*ids, ASSISTANT]


def _answer(turn: int) -> str:
    return f"answer {turn}"


def _messages(task: int, turn: int) -> list[dict[str, Any]]:
    out = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"task {task}"},
    ]
    for t in range(turn):
        out += [
            {"role": "assistant", "content": _answer(t)},
            {"role": "user", "content": "Continue."},
        ]
    return out


@dataclass
class _Worker:
    index: LinkIndex | None = None
    #: the stored calls this worker's index holds as stored
    seen: set[str] = field(default_factory=set)


@dataclass
class _Run:
    keys: bool
    workers: int
    late_load: bool
    vocab: _Vocab = field(default_factory=_Vocab)
    known: KnownMessages = field(default_factory=KnownMessages)
    claims: _SharedClaims = field(default_factory=_SharedClaims)
    stored: dict[str, CallRecord] = field(default_factory=dict)
    #: stored order (a row's rowid)
    order: list[str] = field(default_factory=list)
    #: each stored call's own history key, as a row's message chain gives it
    row_history: dict[str, bytes | None] = field(default_factory=dict)
    at: float = 0.0

    def __post_init__(self) -> None:
        self.pool = [_Worker() for _ in range(self.workers)]

    def index(self, w: int) -> LinkIndex:
        """Worker ``w``'s index caught up with every call stored (made from them when new)."""
        worker = self.pool[w]
        if worker.index is None:
            worker.index = LinkIndex()
            for call_id in self.order:
                if self.late_load:  # Linker._index: records, no history key
                    add_record(worker.index, self.stored[call_id])
                else:
                    refresh_index(worker.index, [self._row(call_id)])
                worker.seen.add(call_id)
        fresh = [c for c in self.order if c not in worker.seen]
        refresh_index(worker.index, [self._row(c) for c in fresh])
        worker.seen.update(fresh)
        return worker.index

    def _row(self, call_id: str):
        call = of_record(self.stored[call_id])
        return dataclasses.replace(call, history=self.row_history[call_id])

    def answer(self, w: int, command: Any) -> Any:
        if isinstance(command, CatchUp):
            return self.index(w)
        if isinstance(command, ReadParent):
            return self.stored.get(command.call_id)
        if isinstance(command, FindPrefixAncestor):
            return self.index(w).prefix_ancestor(
                command.prompt_token_ids, model=command.model, exclude=command.exclude
            )
        if isinstance(command, Detokenize):
            return None
        raise AssertionError(f"unexpected command {command}")

    def drive(self, w: int, step: Any) -> Any:
        try:
            command = next(step)
            while True:
                command = step.send(self.answer(w, command))
        except StopIteration as done:
            return done.value

    def send(self, w: int, call_id: str, task: int, turn: int, session: str | None, prefill: bool):
        """Resolve a call (``prefill``: it continues the first letters of its answer)."""
        messages = _messages(task, turn)
        self.at += 1.0
        body: dict[str, Any] = {"model": "m", "messages": messages}
        answer = _answer(turn)
        if prefill:
            messages = [*messages, {"role": "assistant", "content": answer[:3]}]
            body = {"model": "m", "messages": messages, "continue_final_message": True,
                    "add_generation_prompt": False}  # fmt: skip
            answer = answer[3:]
        prepared = prepare_request(body, None, self.known.facts(messages))
        keys = prepared.history_keys if self.keys else (None, None)
        step = resolve_step(
            self.index(w),
            "r1",
            prepared.linking_messages,
            prepared.body,
            call_id=call_id,
            created_at=self.at,
            linking_facts=prepared.linking_facts,
            claims=self.claims if self.workers > 1 else None,
            index_current=lambda: all(c in self.pool[w].seen for c in self.order),
            session=("codex", session) if session else None,
            history_keys=keys,
        )
        resolution = self.drive(w, step)
        received = {**body, **({"prompt_cache_key": session} if session else {})}
        gen = [*_text(answer, self.vocab), END]
        prompt = _render(messages, self.vocab, open_last=prefill)
        record = CallRecord(
            call_id=call_id,
            rollout_id="r1",
            created_at=self.at,
            model="m",
            request_messages=messages,
            request_received=received,
            response_message={"role": "assistant", "content": answer},
            prompt_token_ids=np.asarray(prompt, np.uint32),
            generation_token_ids=np.asarray(gen, np.uint32),
            generation_log_probs=np.full(len(gen), -0.5, np.float32),
        )
        return resolution, prepared, record, keys[0]

    def store(self, w: int, flight: Any) -> CallRecord:
        resolution, prepared, record, own = flight
        step = verify_step(
            record,
            resolution,
            prepared.linking_messages,
            harness_note=None,
            retry_count=None,
            can_decode=False,
            prefill=prepared.prefill,
            digests=RecordDigests(record, prepared.prefill),  # as the executor makes them
        )
        record = self.drive(w, step)
        self.stored[record.call_id] = record
        self.order.append(record.call_id)
        self.row_history[record.call_id] = own
        add_record(self.index(w), record)  # Linker.remember (keeps the key filed in flight)
        self.claims.release(record.call_id)
        return record


@dataclass(frozen=True)
class _Plan:
    tasks: tuple[int, ...]  # per session
    turns: tuple[int, ...]  # per session
    named: bool  # sessions name their harness session
    workers: int
    late_load: bool
    #: (session, worker, the worker's index evicted first) picks
    schedule: tuple[tuple[int, int, bool], ...]
    #: the (session, turn)s sent as prefills
    prefills: frozenset[tuple[int, int]] = frozenset()


@st.composite
def plans(draw: st.DrawFn) -> _Plan:
    n = draw(st.integers(2, 4))
    tasks = tuple(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    turns = tuple(draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)))
    workers = draw(st.integers(1, 2))
    pick = st.tuples(
        st.integers(0, n - 1),
        st.integers(0, workers - 1),
        st.sampled_from([False] * 9 + [True]),
    )
    schedule = tuple(draw(st.lists(pick, max_size=60)))
    prefills = draw(st.frozensets(st.tuples(st.integers(0, n - 1), st.integers(0, 3))))
    late = draw(st.booleans())
    return _Plan(tasks, turns, draw(st.booleans()), workers, late, schedule, prefills)


def _play(plan: _Plan, keys: bool) -> dict[str, CallRecord]:
    """Each pick moves its session on: stores its call in flight, else sends its next call
    (on the picked worker); then the calls left are played to their end, session by session."""
    run = _Run(keys, plan.workers, plan.late_load)
    n = len(plan.tasks)
    turn = [0] * n
    flight: list[tuple[int, Any] | None] = [None] * n

    def step(s: int, w: int, evict: bool = False) -> None:
        if evict and all(f is None or f[0] != w for f in flight):
            # RolloutIndexes._evict (or a restart): made again from the store when next used (with
            # none of its calls in flight: those it would forget, keys or not)
            run.pool[w] = _Worker()
        if flight[s] is not None:
            on, call = flight[s]
            run.store(on, call)
            flight[s] = None
        elif turn[s] < plan.turns[s]:
            session = f"s{s}" if plan.named else None
            prefill = (s, turn[s]) in plan.prefills
            call_id = f"s{s}-{turn[s]}"
            flight[s] = (w, run.send(w, call_id, plan.tasks[s], turn[s], session, prefill))
            turn[s] += 1

    for s, w, evict in plan.schedule:
        step(s, w, evict)
    for s in range(n):
        while flight[s] is not None or turn[s] < plan.turns[s]:
            step(s, s % plan.workers)
    return run.stored


def _check(plan: _Plan, stored: dict[str, CallRecord]) -> None:
    children: dict[str, list[str]] = {}
    for call_id, record in stored.items():
        s, t = (int(x) for x in call_id[1:].split("-"))
        if t == 0:
            assert record.parent_call_id is None, call_id
            continue
        parent = record.parent_call_id
        assert parent is not None and record.linking["verdict"] == "resolved", (call_id, record)
        ps, pt = (int(x) for x in parent[1:].split("-"))
        assert pt == t - 1 and plan.tasks[ps] == plan.tasks[s], (call_id, parent)
        if plan.named:
            assert ps == s, f"{call_id} continued {parent}, not its own session's call"
        children.setdefault(parent, []).append(call_id)
    branched = {p: c for p, c in children.items() if len(c) > 1}
    assert not branched, f"branches: {branched}"


def _parents(stored: dict[str, CallRecord]) -> dict[str, str | None]:
    return {c: r.parent_call_id for c, r in stored.items()}


def _ok(plan: _Plan, stored: dict[str, CallRecord]) -> bool:
    try:
        _check(plan, stored)
    except AssertionError:
        return False
    return True


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_sessions_that_answered_alike_each_end_as_their_own_chain(plan):
    """With every call's history key known (filed in flight, or read from its row), each
    session ends as its own chain. Where a worker's index was made from the store (late, or
    after an eviction) its calls have none: a continuation may then take a wrong first
    candidate and count itself its child, as every continuation could before the keys, and a
    later one branch under the call it leaves childless; the keys must then do no worse than
    the order before them. A final parent the keys change is one where that order was
    wrong, or (sessions unnamed) a twin's call for a token-identical one."""
    new, old = _play(plan, keys=True), _play(plan, keys=False)
    if not plan.late_load or _ok(plan, old):
        _check(plan, new)
    if _parents(new) != _parents(old) and plan.named:
        assert not _ok(plan, old)
