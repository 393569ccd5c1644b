"""What a long session's call spends on the history it repeats, piece by piece, in microseconds
(medians of ``--repeat`` runs, warm), the whole way against the way from the earlier request.

The session is ``long_session.py``'s (a system prompt of about 8 KB, tools of about 20 KB, a
tool call and a result of about 1 KB per turn), written compact as a harness writes it; the
call measured is the one at ``--turn`` (default 120: 240 messages, about 180 KB), after the
call before it, and a prompt of ``--prompt-ids`` ids (54k: the long session's last) whose
parent's prompt is all of it but its last 1,000 ids. Pieces, each the same value both ways
(checked here):

- ``parse``: ``json_bodies.parse_json_object(raw)`` against ``KnownBodies.parse`` after the
  request before (``core.known_bodies``), and for a body with no earlier one kept;
- ``facts``: ``KnownMessages.facts`` of every message (each written with orjson to be looked
  up) against the new messages' only (``ParsedBody.head_facts_for``);
- ``request digest``: ``request_digest`` against ``request_digest_after`` from the earlier
  request's state;
- ``block states``: ``prefixes.block_states`` of the prompt against ``RecordDigests`` seeded
  with the parent's (``seed``);
- the same session as Claude Code sends it (Anthropic Messages: a ``tool_use`` and a
  ``tool_result`` per turn, the history first, ``system`` and ``tools`` after it):
  ``Messages: conversion`` (the front's parse, converting the history to canonical messages,
  against the one taking the earlier request's ``MessagesMemo``), ``Messages: facts`` and
  ``Messages: request digest`` of the canonical messages;
- and as Codex sends it (Responses: reasoning, a message, a function call and its output per
  turn): ``Responses: conversion``, ``Responses: facts``, ``Responses: request digest``.

Run: ``.venv/bin/python benchmarks/history_pieces.py [--turn 120] [--repeat 300]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.long_session import _lines, tools  # noqa: E402
from capture_proxy.core.capture import prepare_request  # noqa: E402
from capture_proxy.core.fronts.messages import MessagesCodec  # noqa: E402
from capture_proxy.core.fronts.responses import ResponsesCodec  # noqa: E402
from capture_proxy.core.json_bodies import parse_json_object  # noqa: E402
from capture_proxy.core.known_bodies import KnownBodies  # noqa: E402
from capture_proxy.core.known_messages import KnownMessages  # noqa: E402
from capture_proxy.core.known_tools import KnownTools  # noqa: E402
from capture_proxy.core.linking.digests import request_digest, request_digest_after  # noqa: E402
from capture_proxy.core.linking.record_digests import RecordDigests  # noqa: E402
from capture_proxy.core.prefixes import block_states  # noqa: E402
from capture_proxy.core.records import CallRecord  # noqa: E402


def session_bodies(turns: int) -> list[bytes]:
    """The requests of a ``turns``-call session, compact JSON."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent." + _lines(8, "system")},
        {"role": "user", "content": "Read every module."},
    ]
    out = []
    for i in range(turns):
        body = {"model": "m", "messages": messages, "tools": tools(20), "max_tokens": 64}
        out.append(orjson.dumps(body))
        arguments = orjson.dumps({"filePath": f"src/module_{i}.py"}).decode()
        call: dict[str, Any] = {"id": f"call_{i}", "type": "function"}
        call["function"] = {"name": "read", "arguments": arguments}
        messages = [
            *messages,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": _lines(0.95, f"out {i}")},
        ]
    return out


def messages_bodies(turns: int) -> list[bytes]:
    """``session_bodies`` as Anthropic Messages requests, in Claude Code's key order."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read every module."}]
    claude_tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]}
        for t in tools(20)
    ]  # fmt: skip
    out = []
    for i in range(turns):
        body = {"model": "m", "messages": messages, "system": "You are a coding agent."
                + _lines(8, "system"), "tools": claude_tools, "max_tokens": 64}  # fmt: skip
        out.append(orjson.dumps(body))
        use: dict[str, Any] = {"type": "tool_use", "id": f"toolu_{i}", "name": "read"}
        use["input"] = {"filePath": f"src/module_{i}.py"}
        result: dict[str, Any] = {"type": "tool_result", "tool_use_id": f"toolu_{i}"}
        result["content"] = _lines(0.95, f"out {i}")
        messages = [
            *messages,
            {"role": "assistant", "content": [{"type": "text", "text": "Reading."}, use]},
            {"role": "user", "content": [result]},
        ]
    return out


def responses_bodies(turns: int) -> list[bytes]:
    """``session_bodies`` as Responses requests, in Codex's key order."""
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent."
                      + _lines(8, "system")}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Read every module."}]},
    ]  # fmt: skip
    codex_tools = [
        {"type": "function", "name": t["function"]["name"],
         "description": t["function"]["description"], "parameters": t["function"]["parameters"]}
        for t in tools(20)
    ]  # fmt: skip
    out = []
    for i in range(turns):
        body = {"model": "m", "stream": False, "input": items, "tools": codex_tools}
        out.append(orjson.dumps(body))
        arguments = orjson.dumps({"filePath": f"src/module_{i}.py"}).decode()
        items = [
            *items,
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": f"Step {i}."}]},
            {"type": "function_call", "call_id": f"call_{i}", "name": "read",
             "arguments": arguments},
            {"type": "function_call_output", "call_id": f"call_{i}",
             "output": _lines(0.95, f"out {i}")},
        ]  # fmt: skip
    return out


def front_rows(
    label: str, bodies: list[bytes], codec: Any, member: str, repeat: int
) -> list[tuple[str, float, float]]:
    """A converting front's pieces at the last of ``bodies``, whole and from the earlier
    request (its ``front_memo``)."""
    kept = KnownBodies()
    known = KnownMessages()
    earlier = kept.parse(bodies[-2], "rollout", member)
    first = codec.parse(earlier.body, history=earlier)
    earlier.keep_facts(first.chat["messages"], known.facts(first.chat["messages"]))
    earlier_prepared = prepare_request(first.chat, None).body
    _, state = request_digest_after(earlier_prepared, None)
    earlier.keep_digest_state(state)
    later = kept.parse(bodies[-1], "rollout", member)
    whole_body = parse_json_object(bodies[-1])
    alone = codec.parse(whole_body)
    later_request = codec.parse(later.body, history=later)
    assert orjson.dumps(later_request.chat) == orjson.dumps(alone.chat)

    canonical = later_request.chat["messages"]
    head = later.head_facts_for(canonical)
    assert known.facts(canonical, head) == known.facts(canonical) and len(head) > 1
    prepared = prepare_request(later_request.chat, None).body
    assert request_digest_after(prepared, None, state)[0] == request_digest(prepared)
    return [
        (
            f"{label}: conversion",
            median_us(lambda: codec.parse(whole_body), repeat),
            median_us(lambda: codec.parse(later.body, history=later), repeat),
        ),
        (
            f"{label}: facts",
            median_us(lambda: known.facts(canonical), repeat),
            median_us(lambda: known.facts(canonical, head), repeat),
        ),
        (
            f"{label}: request digest",
            median_us(lambda: request_digest(prepared), repeat),
            median_us(lambda: request_digest_after(prepared, None, state), repeat),
        ),
    ]


def median_us(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _record(prompt: np.ndarray) -> CallRecord:
    return CallRecord(
        call_id="c",
        rollout_id="r",
        created_at=0.0,
        model="m",
        prompt_token_ids=prompt,
        generation_token_ids=np.array([1, 2, 3], np.uint32),
        generation_log_probs=np.zeros(3, np.float32),
        request_messages=[],
        response_message=None,
    )


def chat_rows(bodies: list[bytes], repeat: int) -> list[tuple[str, float, float]]:
    """The chat front's pieces at the last of ``bodies``, whole and from the earlier request."""
    earlier_raw, raw = bodies[-2], bodies[-1]
    took = []
    for _ in range(repeat):
        kept = KnownBodies()
        kept.parse(earlier_raw, "rollout", "messages")
        t0 = time.perf_counter()
        kept.parse(raw, "rollout", "messages")
        took.append(time.perf_counter() - t0)
    whole = median_us(lambda: parse_json_object(raw), repeat)
    none_kept = median_us(lambda: KnownBodies().parse(raw, "rollout", "messages"), repeat)
    kept = KnownBodies()
    earlier = kept.parse(earlier_raw, "rollout", "messages")
    later = kept.parse(raw, "rollout", "messages")
    assert later.body == parse_json_object(raw) and later.repeated == len(earlier.body["messages"])

    known = KnownMessages()
    earlier.keep_facts(earlier.body["messages"], known.facts(earlier.body["messages"]))
    messages = later.body["messages"]
    head = later.head_facts_for(messages)
    assert len(head) == later.repeated
    assert known.facts(messages, head) == known.facts(messages)

    tools_text = KnownTools().facts(later.body["tools"]).sorted_text
    _, state = request_digest_after(earlier.body, tools_text)
    digest = request_digest_after(later.body, tools_text, state)[0]
    assert digest == request_digest(later.body, tools_text)
    return [
        ("parse", whole, statistics.median(took) * 1e6),
        ("parse, no earlier body kept", whole, none_kept),
        (
            "facts",
            median_us(lambda: known.facts(messages), repeat),
            median_us(lambda: known.facts(messages, head), repeat),
        ),
        (
            "request digest",
            median_us(lambda: request_digest(later.body, tools_text), repeat),
            median_us(lambda: request_digest_after(later.body, tools_text, state), repeat),
        ),
    ]


def block_rows(prompt_ids: int, repeat: int) -> list[tuple[str, float, float]]:
    """The prompt's block states, whole and from a parent's whose prompt is all of it but its
    last 1,000 ids."""
    ids = np.random.default_rng(1).integers(0, 150_000, prompt_ids, dtype=np.uint32)
    parent = RecordDigests(_record(ids[: prompt_ids - 1000].copy()))
    parent.block_states()

    def seeded() -> list[Any]:
        child = RecordDigests(_record(ids))
        child.seed(parent)
        return child.block_states()

    assert [s.digest() for s in seeded()] == [s.digest() for s in block_states(ids)]
    return [
        ("block states", median_us(lambda: block_states(ids), repeat), median_us(seeded, repeat))
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turn", type=int, default=120)
    p.add_argument("--prompt-ids", type=int, default=54_000)
    p.add_argument("--repeat", type=int, default=300)
    args = p.parse_args(argv)
    bodies = session_bodies(args.turn)
    rows = chat_rows(bodies, args.repeat) + block_rows(args.prompt_ids, args.repeat)
    rows += front_rows(
        "Messages", messages_bodies(args.turn), MessagesCodec(), "messages", args.repeat
    )
    rows += front_rows(
        "Responses", responses_bodies(args.turn), ResponsesCodec(), "input", args.repeat
    )
    messages = orjson.loads(bodies[-1])["messages"]
    print(
        f"call {args.turn} of a session: {len(messages)} messages, "
        f"{len(bodies[-1]) / 1024:.0f} KB; a prompt of {args.prompt_ids} ids; "
        f"medians of {args.repeat}"
    )
    print(f"  {'piece':30} {'whole':>10} {'from earlier':>13} {'ratio':>7}")
    for name, before, after in rows:
        print(f"  {name:30} {before:8.1f}us {after:11.1f}us {after / before:6.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
