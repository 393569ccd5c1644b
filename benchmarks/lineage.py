"""Read-time cost of lineage (``core.lineage.find_lineage``) as a rollout grows, against the
chain building it follows (``core.chains.build_chains``), in the same run.

Shapes: ``session``: one main agent of T turns whose every 10th turn starts a sub-agent (a
root of 2 calls) and whose history grows by 2 messages a turn; ``samples``: N parallel
samples of one task (roots of 3 calls, no edge); ``forks``: T turns, a fork after every 10th
(a root replaying the main history). Prints, per size, the milliseconds of each and the
microseconds per call, and the ratio of lineage's per-call cost at the largest size to the
smallest (linear in the rollout's messages: per call it grows with the history length, as the
records' own messages do, and no more).

    .venv/bin/python benchmarks/lineage.py [--sizes 250,1000,4000]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from capture_proxy.core.chains import build_chains
from capture_proxy.core.lineage import find_lineage
from capture_proxy.core.records import CallRecord


def _record(call_id: str, t: float, prompt: list[int], gen: list[int], messages, answer):
    return CallRecord(
        call_id=call_id,
        rollout_id="bench",
        created_at=t,
        prompt_token_ids=np.asarray(prompt, np.uint32),
        generation_token_ids=np.asarray(gen, np.uint32),
        generation_log_probs=np.zeros(len(gen), np.float32),
        request_messages=messages,
        response_message=answer,
        linking={"verdict": "root"},
    )


def _tool_turn(i: int, spawn: bool) -> dict[str, Any]:
    name, args = (
        ("Agent", {"prompt": f"Sub-task {i}: look at module {i} and report."})
        if spawn
        else (
            "Bash",
            {"command": f"ls dir{i}"},
        )
    )
    call = {
        "id": f"toolu_{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }
    return {"role": "assistant", "content": f"step {i}", "tool_calls": [call]}


def session(turns: int, forks: bool) -> list[CallRecord]:
    """One main chain (token-linked by ``parent_call_id``) and its sub-agents or forks."""
    out: list[CallRecord] = []
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "task"},
    ]
    prompt: list[int] = [1, 2]
    parent = None
    for i in range(turns):
        spawn = i % 10 == 0
        answer = _tool_turn(i, spawn and not forks)
        r = _record(f"m{i}", float(i), list(prompt), [3, 4], list(history), answer)
        r.parent_call_id, r.linking = parent, {"verdict": "resolved" if parent else "root"}
        out.append(r)
        parent = r.call_id
        if spawn and not forks:
            sub = [{"role": "user", "content": f"Sub-task {i}: look at module {i} and report."}]
            out.append(
                _record(
                    f"s{i}", i + 0.5, [9000 + i], [5], sub, {"role": "assistant", "content": "ok"}
                )
            )
        if spawn and forks:
            fork = [
                *history[1:],
                answer,
                {
                    "role": "tool",
                    "tool_call_id": f"toolu_{i}",
                    "content": "Fork started \u2014 that fork is you.",
                },
            ]
            out.append(
                _record(
                    f"f{i}", i + 0.5, [8000 + i], [5], fork, {"role": "assistant", "content": "ok"}
                )
            )
        history += [answer, {"role": "tool", "tool_call_id": f"toolu_{i}", "content": f"out {i}"}]
        prompt += [3, 4, 5]
    return out


def samples(n: int) -> list[CallRecord]:
    out = []
    for s in range(n):
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
        parent = None
        for t in range(3):
            answer = _tool_turn(1000 * s + t, False)
            r = _record(f"x{s}.{t}", s + t / 10, [s, t], [7], list(msgs), answer)
            r.parent_call_id, r.linking = parent, {"verdict": "resolved" if parent else "root"}
            out.append(r)
            parent = r.call_id
            msgs += [
                answer,
                {"role": "tool", "tool_call_id": f"toolu_{1000 * s + t}", "content": "o"},
            ]
    return out


def _ms(fn: Any, *args: Any) -> tuple[float, Any]:
    best, value = float("inf"), None
    for _ in range(3):
        t0 = time.perf_counter()
        value = fn(*args)
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="250,1000,4000")
    sizes = [int(s) for s in parser.parse_args().sizes.split(",")]
    for shape in ("session", "forks", "samples"):
        per_call = []
        for n in sizes:
            records = samples(n // 3) if shape == "samples" else session(n, shape == "forks")
            chains_ms, chains = _ms(build_chains, "bench", records)
            lineage_ms, lineage = _ms(find_lineage, chains)
            msgs = sum(len(r.request_messages) for r in records)
            per_call.append(lineage_ms * 1000 / len(records))
            edges = sum(map(len, lineage.values()))
            print(
                f"{shape:8} calls={len(records):5} messages={msgs:9} edges={edges:4} "
                f"build_chains={chains_ms:8.1f} ms lineage={lineage_ms:8.1f} ms "
                f"({per_call[-1]:6.1f} us/call, {lineage_ms * 1e6 / max(msgs, 1):5.2f} ns/message)"
            )
        ratio = per_call[-1] / per_call[0]
        print(f"{shape:8} lineage per call, largest / smallest size: {ratio:.2f}x")


if __name__ == "__main__":
    main()
