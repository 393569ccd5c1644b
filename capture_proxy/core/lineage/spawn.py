"""The ``spawned_by`` rule of lineage (see ``capture_proxy.core.lineage.find``). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture_proxy.core.lineage.messages import (
    compared,
    message_text,
    squash,
    text_parts,
    text_sha256,
)
from capture_proxy.core.lineage.model import LineageEdge, LineageKind
from capture_proxy.core.lineage.rollout import Rollout, positions
from capture_proxy.core.records import CallRecord


def _first_user(messages: list[Mapping[str, Any]]) -> tuple[int, Mapping[str, Any]] | None:
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            return i, message
    return None


def spawned(rollout: Rollout, root: CallRecord) -> LineageEdge | None:
    first = _first_user(compared(root.request_messages))
    if first is None:
        return None
    index, message = positions(root)[first[0]], first[1]
    for text in dict.fromkeys([squash(message_text(message)), *map(squash, text_parts(message))]):
        entries = rollout.tool_inputs.get(text) if text else None
        if not entries:
            continue
        allowed = {c.call_id for c in rollout.earlier_other((e[0] for e in entries), root)}
        entries = [e for e in entries if e[0].call_id in allowed]
        # the root's session's first (Claude Code's only: a sub-agent is its spawner's
        # session); OpenCode's: its parent session's only (a sub-agent has a session of its own)
        entries = rollout.best(LineageKind.SPAWNED_BY, root, entries, lambda e: e[0])
        if not entries:
            continue
        unused = [e for e in entries if (e[0].call_id, e[1]) not in rollout.used_spawns]
        call, tool_call_id, name, arg, rule = (unused or entries)[0]
        rollout.used_spawns.add((call.call_id, tool_call_id))
        evidence = {
            "rule": rule,
            "tool_name": name,
            "tool_call_id": tool_call_id,
            "field": arg,
            "message_index": index,
            "text_sha256": text_sha256(text),
            "num_chars": len(text),
            **rollout.session_evidence(root, call),
        }
        chain_id = rollout.chain_of[call.call_id]
        return LineageEdge(LineageKind.SPAWNED_BY, chain_id, call.call_id, evidence)
    return None
