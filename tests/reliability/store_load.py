"""Load against a proxy whose store stops taking writes, and the checks of what it stored.

Sessions of the three wire APIs (``tests/proxy/api_clients``), streamed and whole, run at once
through the proxy. A session whose call is refused (``store_failure = refuse``: a 503, or a
stream's in-band error with no clean end) waits until the test says writes succeed again
(``Load.recovered``) and sends the same request again, as an SDK retries; one whose call was
answered goes on with the answer. ``Load.stalled`` is set once every session is waiting or
done, so the test knows the store is full without sleeping. Every wait has a deadline.

``Attempt``: one call as the harness saw it: ``answered`` (a success: a 200 whole answer, or a
stream with its clean end), ``refused``, and the call id the proxy named (``X-Capture-Call-Id``;
a refused whole answer names none).
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tests.proxy.api_clients import Reply, harness

APIS = ("chat_completions", "responses", "messages")
#: The event that ends a stream cleanly, by API.
CLEAN_END = {
    "chat_completions": "[DONE]",
    "responses": "response.completed",
    "messages": "message_stop",
}


@dataclass(frozen=True)
class Attempt:
    rollout_id: str
    api: str
    stream: bool
    step: int
    answered: bool
    call_id: str | None


def _stream_end(reply: Reply) -> str | None:
    last = reply.events[-1].data if reply.events else None
    if last == "[DONE]":
        return "[DONE]"
    return last.get("type") if isinstance(last, dict) else None


def outcome(api: str, stream: bool, reply: Reply) -> bool:
    """True: answered as a success; False: refused because the store refused its record.
    Raises AssertionError for anything else (the test's failure)."""
    if stream and reply.status == 200 and reply.events:
        end = _stream_end(reply)
        if end == CLEAN_END[api]:
            return True
        last = reply.events[-1].data
        error = last.get("error") if isinstance(last, dict) else None
        if api == "responses" and isinstance(last, dict):
            error = (last.get("response") or {}).get("error")
        assert isinstance(error, dict), f"{api} stream ended neither cleanly nor refused: {last}"
        if api == "messages":
            assert error["type"] == "overloaded_error", error
        else:
            assert error["code"] == "store_unavailable", error
        return False
    if reply.status == 200:
        return True
    assert reply.status == 503, (reply.status, reply.body)
    error = reply.body["error"]
    assert error["type"] == ("overloaded_error" if api == "messages" else "server_error"), error
    return False


@dataclass
class Load:
    """The sessions' shared state and their attempts."""

    client: Any  # anything with aiohttp's ``post(path, json=...)``: a TestClient, a session
    sessions: int
    steps: int
    deadline_s: float
    #: ``milestone`` is set once this many calls were answered (0: never)
    milestone_answers: int = 0
    attempts: list[Attempt] = field(default_factory=list)
    recovered: asyncio.Event = field(default_factory=asyncio.Event)
    stalled: asyncio.Event = field(default_factory=asyncio.Event)
    milestone: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0
    done: int = 0
    num_answered: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def _check_stalled(self) -> None:
        if self.waiting + self.done == self.sessions:
            self.stalled.set()

    async def session(self, api: str, stream: bool, rollout_id: str) -> None:
        h = harness(api, SimpleNamespace(client=self.client), rollout_id, stream=stream)
        for step in range(self.steps):
            retries_after_recovery = 0
            while True:
                reply = await h.send()
                answered = outcome(api, stream, reply)
                self.attempts.append(
                    Attempt(rollout_id, api, stream, step, answered, reply.call_id)
                )
                if answered:
                    self.num_answered += 1
                    if self.num_answered == self.milestone_answers:
                        self.milestone.set()
                    break
                if self.recovered.is_set():
                    retries_after_recovery += 1
                    assert retries_after_recovery <= 2, f"{rollout_id}: refused after recovery"
                self.waiting += 1
                self._check_stalled()
                await asyncio.wait_for(self.recovered.wait(), self.deadline_s)
                self.waiting -= 1
            h.append_turn(reply)
            if reply.tool_calls:
                h.append_tool_results([(t, f"output of {n}") for t, n, _ in reply.tool_calls])
        self.done += 1
        self._check_stalled()

    def start(self, prefix: str) -> list[asyncio.Task[None]]:
        """``sessions`` sessions, round robin over the APIs and stream/whole."""
        kinds = [(api, stream) for api in APIS for stream in (False, True)]
        self.tasks = [
            asyncio.create_task(self.session(*kinds[i % len(kinds)], f"{prefix}-{i:03d}"))
            for i in range(self.sessions)
        ]
        return self.tasks

    @property
    def answered(self) -> list[Attempt]:
        return [a for a in self.attempts if a.answered]

    @property
    def refused(self) -> list[Attempt]:
        return [a for a in self.attempts if not a.answered]

    def by_kind(self) -> dict[str, int]:
        """Attempts by API, stream or whole, answered or refused (for the test's figures)."""
        return dict(
            Counter(
                f"{a.api}/{'stream' if a.stream else 'whole'}/"
                f"{'answered' if a.answered else 'refused'}"
                for a in self.attempts
            )
        )


def metric(text: str, name: str) -> float:
    """An unlabelled sample of the Prometheus text (0 when absent)."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def get_json(client: Any, path: str) -> tuple[int, Any]:
    async with client.get(path) as resp:
        return resp.status, await resp.json()


async def stored_calls(client: Any, rollout_ids: set[str]) -> dict[str, list[str]]:
    """Each rollout's stored call ids, once each (its chains' calls, then the unlinked ones),
    by REST; checked against the summary's ``num_calls``."""
    out: dict[str, list[str]] = {}
    for rollout_id in sorted(rollout_ids):
        status, body = await get_json(client, f"/captures/rollouts/{rollout_id}/chains")
        if status == 404:
            out[rollout_id] = []
            continue
        assert status == 200, body
        ids = [c["call_id"] for chain in body["chains"] for c in chain["calls"]]
        ids += [c["call_id"] for c in body["unlinked_calls"]]
        out[rollout_id] = list(dict.fromkeys(ids))
        status, summary = await get_json(client, f"/captures/rollouts/{rollout_id}")
        assert summary["num_calls"] == len(out[rollout_id]), (rollout_id, summary, ids)
    return out


async def health(client: Any) -> tuple[int, Any]:
    return await get_json(client, "/health")


async def metrics_text(client: Any) -> str:
    async with client.get("/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def answered_ids(load: Load) -> dict[str, list[str]]:
    """Each rollout's answered call ids, in order (every answer names its call)."""
    out: dict[str, list[str]] = {a.rollout_id: [] for a in load.attempts}
    for a in load.answered:
        assert a.call_id is not None, a
        out[a.rollout_id].append(a.call_id)
    return out


async def check_refused_run(client: Any, load: Load) -> dict[str, int]:
    """``store_failure = refuse`` after recovery: every answered call is stored, exactly once,
    and nothing else is (a refused stream's call id is unknown); each session is one chain of
    its answered calls in order; ``store_failures`` counts the refusals. Returns figures."""
    answered = answered_ids(load)
    stored = await stored_calls(client, set(answered))
    assert stored == answered  # the same ids, once each, in chain order
    for a in load.refused:
        if a.call_id is not None:  # a stream names its call before the refusal
            status, _ = await get_json(client, f"/captures/calls/{a.call_id}")
            assert status == 404, a
    for rollout_id, ids in answered.items():
        status, chains = await get_json(client, f"/captures/rollouts/{rollout_id}/chains")
        assert [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]] == [ids]
        assert chains["incomplete"] is False and chains["diagnostics"]["rollout"] == []
    text = await metrics_text(client)
    assert metric(text, "capture_proxy_store_failures_total") == len(load.refused)
    assert metric(text, "capture_proxy_calls_answered_unstored_total") == 0
    return {
        "sent": len(load.attempts),
        "answered": len(load.answered),
        "stored": sum(len(v) for v in stored.values()),
        "refused": len(load.refused),
        "store_failures": int(metric(text, "capture_proxy_store_failures_total")),
    }


async def lost_calls(client: Any, load: Load) -> dict[str, list[str]]:
    """``store_failure = answer``: each rollout's answered calls that are not stored."""
    answered = answered_ids(load)
    stored = await stored_calls(client, set(answered))
    for rollout_id, ids in stored.items():
        assert set(ids) <= set(answered[rollout_id]), rollout_id  # nothing unanswered
        assert len(ids) == len(set(ids))
    return {r: [i for i in ids if i not in stored[r]] for r, ids in answered.items()}


async def check_marked_losses(client: Any, lost: dict[str, list[str]]) -> None:
    """Each rollout with lost calls reads incomplete with one ``store_failed`` naming exactly
    them; the others read complete."""
    for rollout_id, ids in lost.items():
        status, summary = await get_json(client, f"/captures/rollouts/{rollout_id}")
        assert status == 200, (rollout_id, summary)
        kinds = {d["kind"]: d["details"] for d in summary["diagnostics"]["rollout"]}
        if ids:
            assert summary["incomplete"] is True, rollout_id
            assert sorted(kinds["store_failed"]["call_ids"]) == sorted(ids), rollout_id
        else:
            assert "store_failed" not in kinds and summary["incomplete"] is False, rollout_id
