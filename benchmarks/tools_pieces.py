"""What a call spends on its ``tools`` in the pure core, in microseconds (best of N, warm).

The last request of each harness fixture (OpenCode: chat completions, ~21 KB of tools; Codex:
Responses, ~17 KB; Claude Code: Messages, ~31 KB), parsed as the call handler parses it, with
the messages' facts known (as on every call of a session after its first). Pieces:

- ``parse``: the front's parse (chat: validation; Responses/Messages: the conversion to the
  canonical request), with and without the ``tools`` field (the difference is the tools');
- ``encoding``: the tools' part of the record's ``RequestEncoding`` (canonical text, SHA-256);
- ``received``: ``received_refs`` of the received body (Responses/Messages keep their own
  tools there: another canonical text and SHA-256);
- ``digest``: ``request_digest`` of the prepared body, with and without ``tools``.

Run: ``PYTHONPATH=<tree> .venv/bin/python benchmarks/tools_pieces.py [--repeat 2000]``; a
tree without ``core.known_tools`` (before the memo) is timed the old way, so the same script
measures both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import capture_proxy
from capture_proxy.core.capture import prepare_request
from capture_proxy.core.fronts import front_for
from capture_proxy.core.known_messages import KnownMessages, message_digests
from capture_proxy.core.linking import digests
from capture_proxy.core.request_encoding import RequestEncoding
from capture_proxy.core.stored_form import received_refs

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
SESSIONS = {
    "opencode": FIXTURES / "opencode" / "logs" / "03_step_limit_ignored.jsonl",
    "codex": FIXTURES / "codex" / "01_tool_session.jsonl",
    "claude_code": FIXTURES / "claude_code" / "01_tool_session.jsonl",
}
MEMO = importlib.util.find_spec("capture_proxy.core.known_tools") is not None


def last_request(path: Path) -> tuple[str, dict[str, Any]]:
    found = None
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        body = entry.get("body")
        if isinstance(body, dict) and body.get("tools"):
            found = (entry["path"], body)
    assert found is not None, path
    return found


def best_us(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        best = min(best, time.perf_counter_ns() - t0)
    return best / 1000


def pieces(path: str, body: dict[str, Any], repeat: int) -> dict[str, float]:
    front = front_for(path)
    assert front is not None
    known = KnownMessages()
    kwargs: dict[str, Any] = {"known": known}
    if MEMO:
        from capture_proxy.core.known_tools import KnownTools

        kwargs["known_tools"] = KnownTools()
    without = {k: v for k, v in body.items() if k != "tools"}
    parsed = front.parse(body, **kwargs)
    facts = parsed.message_facts or known.facts(parsed.chat["messages"])
    prepared = prepare_request(parsed.chat, None, facts)
    tools = prepared.body.get("tools")
    messages = prepared.body["messages"]
    texts = message_digests(facts)
    received = parsed.received
    received_without = {k: v for k, v in received.items() if k != "tools"}
    semantic_without = {k: v for k, v in prepared.body.items() if k != "tools"}
    out = {
        "parse": best_us(lambda: front.parse(body, **kwargs), repeat),
        "parse, no tools": best_us(lambda: front.parse(without, **kwargs), repeat),
        "encoding, no tools": best_us(lambda: RequestEncoding.of(messages, None, texts), repeat),
        "received, no tools": best_us(lambda: received_refs(received_without, {}), repeat),
        "digest, no tools": best_us(lambda: digests.request_digest(semantic_without), repeat),
    }
    if MEMO:  # as the proxy calls them: with the facts the front gave
        tf, rtf, rt = parsed.tools_facts, parsed.received_tools_facts, received.get("tools")
        enc = RequestEncoding.of(messages, tools, texts, tf, rt, rtf)
        known_texts = [
            (enc.tools, enc.tools_text, enc.tools_sha256),
            (enc.received_tools, enc.received_tools_text, enc.received_tools_sha256),
        ]
        sorted_text = tf.sorted_text if tf is not None else None
        out["encoding"] = best_us(
            lambda: RequestEncoding.of(messages, tools, texts, tf, rt, rtf), repeat
        )
        out["received"] = best_us(lambda: received_refs(received, {}, known=known_texts), repeat)
        out["digest"] = best_us(lambda: digests.request_digest(prepared.body, sorted_text), repeat)
    else:  # as the proxy called them before the memo
        enc = RequestEncoding.of(messages, tools, texts)
        refs: Any = received_refs
        chat_tools = (enc.tools, enc.tools_text, enc.tools_sha256)
        out["encoding"] = best_us(lambda: RequestEncoding.of(messages, tools, texts), repeat)
        out["received"] = best_us(
            lambda: refs(received, {}, tools=chat_tools[0], tools_text=chat_tools[1],
                         tools_sha256=chat_tools[2]),
            repeat,
        )  # fmt: skip
        out["digest"] = best_us(lambda: digests.request_digest(prepared.body), repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    print(f"capture_proxy: {capture_proxy.__file__}")
    print(f"tools memo: {'yes' if MEMO else 'no'}; best of {args.repeat}, us")
    for name, session in SESSIONS.items():
        path, body = last_request(session)
        got = pieces(path, body, args.repeat)
        tools_kb = len(json.dumps(body["tools"])) / 1024
        print(f"{name} ({path}, {len(body['tools'])} tools, {tools_kb:.1f} KB):")
        total = 0.0
        for piece in ("parse", "encoding", "received", "digest"):
            with_, without = got[piece], got[f"{piece}, no tools"]
            total += with_ - without
            print(
                f"  {piece:9} {with_:8.1f}  without tools {without:8.1f}"
                f"  tools {with_ - without:7.1f}"
            )
        print(f"  tools in all: {total:.1f}")


if __name__ == "__main__":
    main()
