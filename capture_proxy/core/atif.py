"""ATIF export: a rollout's main path as an Agent Trajectory Interchange Format trajectory. Pure.

Follows ATIF-v1.4 (Harbor's RFC 0001, "trajectory-format": ``schema_version``,
``session_id``, ``agent``, ``steps``, ``notes``, ``final_metrics``, ``extra``; v1.3 added
``completion_token_ids`` to a step's metrics, v1.4 ``prompt_token_ids``).

Mapping: the path is the main chain's (the chain with the most generated tokens) longest
root-to-leaf path (``main_path``). Its first call's request messages become steps in order
(``system`` -> a system step, ``user`` -> a user step, ``assistant`` -> an agent step without
metrics, since no captured call produced it, ``tool`` -> an observation result on the agent
step before it). Each path call then adds the messages new in its request (after its parent's
history and answer) and one agent step for its answer: ``message`` (its text),
``reasoning_content``, ``tool_calls`` (``tool_call_id``, ``function_name``, ``arguments`` as
an object; arguments that are not a JSON object are kept as ``{"_raw": text}``),
``model_name``, ``timestamp`` (ISO 8601, UTC) and ``metrics``: ``prompt_tokens``,
``completion_tokens``, ``prompt_token_ids``, ``completion_token_ids``, ``logprobs`` (a
non-finite value as null) and ``extra`` (``call_id``, ``finish_reason``,
``weight_versions``: the call's spans ``[{"version", "start", "end"}]`` over its completion
tokens, null when unknown, and ``weight_version_source``; the call's ``images`` with their
spans and processor params when it has some; with ``include_experts`` the
``routed_experts`` rows ``[num_rows, num_layers, top_k]`` with ``routed_experts_start``).
Root ``extra``: the rollout id, chain and call ids, reward, task id, tags, snapshot id,
version, ``weight_versions`` (the path's completion tokens per weight version, oldest first,
``core.weight_versions``), the other chains and unlinked calls, the diagnostics, and the
rollout's lineage edges (``lineage``: ``[{"kind", "chain_id", "from_call_id", "evidence",
"to_chain_id"}]``, ``core.lineage``).

Sub-agents: a tool result on the path whose tool call spawned another chain (a ``spawned_by``
edge from that call and tool call id) carries ``subagent_trajectory_ref``: ``[{"session_id":
"<rollout_id>/<chain_id>", "extra": {"chain_id", "kind", "evidence"}}]``, the sub-agent's
chain in this rollout (its calls are in ``GET /captures/rollouts/<id>/chains``).

Images (``core.images``): a user message's or a tool result's content with images becomes
ATIF-v1.6 content parts, ``{"type": "text", "text"}`` and ``{"type": "image", "source":
{"media_type", "path"}}`` with ``path`` the image's address in the read API
(``/captures/images/<sha256>``, relative to the proxy); such a trajectory says
``schema_version: ATIF-v1.6`` (a trajectory without images stays v1.4).

Strict mode (``strict=True``) refuses, with ``AtifGaps``, a rollout with any gap: a call's
diagnostic, a rollout-level diagnostic, or an incomplete rollout.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

from capture_proxy.core.chains import Chain, RolloutChains
from capture_proxy.core.images import is_image_part
from capture_proxy.core.lineage import LineageEdge, LineageKind
from capture_proxy.core.metadata import RolloutMetadata
from capture_proxy.core.records import CallRecord
from capture_proxy.core.summary import main_chain
from capture_proxy.core.weight_versions import tokens_by_version

ATIF_VERSION = "ATIF-v1.4"
#: The version of a trajectory with images (v1.6 added multimodal content parts).
ATIF_IMAGES_VERSION = "ATIF-v1.6"
#: Where the read API serves an image (``rest.images``), relative to the proxy.
IMAGE_PATH = "/captures/images/"


class AtifGaps(ValueError):
    """Strict mode: the rollout has gaps. ``gaps``: ``[{"call_id" | None, "kind"}]``."""

    def __init__(self, gaps: list[dict[str, Any]]) -> None:
        kinds = sorted({g["kind"] for g in gaps})
        super().__init__(f"rollout has {len(gaps)} gap diagnostic(s): {', '.join(kinds)}")
        self.gaps = gaps


def main_path(chains: RolloutChains) -> tuple[Chain | None, list[CallRecord]]:
    """The main chain and its longest root-to-leaf path (most tokens; a tie goes to the
    later leaf in chain order), root first. ``(None, [])`` without chains."""
    chain = main_chain(chains)
    if chain is None:
        return None, []
    has_child = {p for p in chain.parent_of.values() if p is not None}
    leaves = [r for r in chain.calls if r.call_id not in has_child]
    leaf = max(reversed(leaves), key=lambda r: r.num_prompt_tokens + r.num_generation_tokens)
    by_id = {r.call_id: r for r in chain.calls}
    path = [leaf]
    while (parent := chain.parent_of[path[-1].call_id]) is not None:
        path.append(by_id[parent])
    return chain, path[::-1]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return json.dumps(content, ensure_ascii=False)


def _content(content: Any) -> Any:
    """A message's content as ATIF: its text, or with images ATIF-v1.6 content parts."""
    if not (isinstance(content, list) and any(is_image_part(p) for p in content)):
        return _text(content)
    parts: list[dict[str, Any]] = []
    for p in content:
        if is_image_part(p):
            source = {"media_type": p.get("media_type"), "path": IMAGE_PATH + str(p.get("sha256"))}
            parts.append({"type": "image", "source": source})
        elif isinstance(p, dict) and "text" in p:
            parts.append({"type": "text", "text": str(p["text"])})
    return parts


def _tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") or {}
        raw = fn.get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            args = None
        if not isinstance(args, dict):
            args = {"_raw": raw}
        out.append(
            {
                "tool_call_id": tc.get("id", ""),
                "function_name": fn.get("name", ""),
                "arguments": args,
            }
        )
    return out


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _finite(values: Any) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in values.tolist()]


class _Steps:
    def __init__(
        self, rollout_id: str, spawned: dict[tuple[str, str], list[tuple[str, LineageEdge]]]
    ) -> None:
        self.steps: list[dict[str, Any]] = []
        self.last_agent: dict[str, Any] | None = None
        self.last_call_id: str | None = None
        self.rollout_id = rollout_id
        #: (from_call_id, tool_call_id) -> (the sub-agent's chain id, its spawned_by edge)
        self.spawned = spawned

    def _result(self, tool_call_id: Any, content: Any) -> dict[str, Any]:
        result: dict[str, Any] = {"source_call_id": tool_call_id, "content": _content(content)}
        edges = self.spawned.get((self.last_call_id or "", str(tool_call_id or "")), [])
        if edges:
            result["subagent_trajectory_ref"] = [
                {
                    "session_id": f"{self.rollout_id}/{chain_id}",
                    "extra": {"chain_id": chain_id, "kind": e.kind.value, "evidence": e.evidence},
                }
                for chain_id, e in edges
            ]
        return result

    def add(self, step: dict[str, Any]) -> None:
        step = {"step_id": len(self.steps) + 1, **step}
        self.steps.append(step)
        if step["source"] == "agent":
            self.last_agent = step

    def messages(self, messages: list[dict[str, Any]]) -> None:
        for m in messages:
            role = m.get("role")
            if role == "tool" and self.last_agent is not None:
                results = self.last_agent.setdefault("observation", {"results": []})["results"]
                results.append(self._result(m.get("tool_call_id"), m.get("content")))
            elif role == "assistant":
                step: dict[str, Any] = {"source": "agent", "message": _text(m.get("content"))}
                if m.get("reasoning_content"):
                    step["reasoning_content"] = m["reasoning_content"]
                if m.get("tool_calls"):
                    step["tool_calls"] = _tool_calls(m)
                step["extra"] = {"captured": False}
                self.add(step)
                self.last_call_id = None
            else:
                source = "system" if role in ("system", "developer") else "user"
                self.add({"source": source, "message": _content(m.get("content"))})

    def answer(self, call: CallRecord, include_experts: bool) -> None:
        message = call.response_message or {}
        step: dict[str, Any] = {
            "source": "agent",
            "timestamp": _iso(call.created_at),
            "message": _text(message.get("content")),
        }
        if call.model:
            step["model_name"] = call.model
        if message.get("reasoning_content"):
            step["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            step["tool_calls"] = _tool_calls(message)
        extra: dict[str, Any] = {
            "call_id": call.call_id,
            "finish_reason": call.finish_reason,
            "weight_versions": call.weight_versions,
            "weight_version_source": call.weight_version_source,
        }
        if call.images:
            # each image's span in prompt_token_ids and its processor params
            extra["images"] = call.images
        if include_experts and call.routed_experts is not None:
            extra["routed_experts"] = call.routed_experts.tolist()
            extra["routed_experts_start"] = call.routed_experts_start
        step["metrics"] = {
            "prompt_tokens": call.num_prompt_tokens,
            "completion_tokens": call.num_generation_tokens,
            "prompt_token_ids": call.prompt_token_ids.tolist(),
            "completion_token_ids": call.generation_token_ids.tolist(),
            "logprobs": _finite(call.generation_log_probs),
            "extra": extra,
        }
        self.add(step)
        self.last_call_id = call.call_id


#: Diagnostics that record what happened without any token data missing or altered: a retry
#: (the harness asked again; the superseded call is kept aside), a rewritten harness note, and
#: tools left out of the prompt (the prompt ids are what the engine saw; Codex always sends some).
NOT_GAPS = frozenset({"retry", "harness_note_rewritten", "tools_not_rendered"})


def gaps(
    records: list[CallRecord], rollout_diagnostics: list[dict[str, Any]], incomplete: bool
) -> list[dict[str, Any]]:
    """Every gap of a rollout: each call diagnostic (but the ``NOT_GAPS`` ones), each
    rollout-level one, incompleteness."""
    out: list[dict[str, Any]] = [
        {"call_id": r.call_id, "kind": str(d.kind)}
        for r in records
        for d in r.diagnostics
        if d.kind not in NOT_GAPS
    ]
    out += [{"call_id": None, "kind": d["kind"]} for d in rollout_diagnostics]
    if incomplete and not any(g["kind"] == "capture_incomplete" for g in out):
        out.append({"call_id": None, "kind": "capture_incomplete"})
    return out


def trajectory(
    rollout_id: str,
    records: list[CallRecord],
    chains: RolloutChains,
    *,
    metadata: RolloutMetadata,
    rollout_diagnostics: list[dict[str, Any]],
    incomplete: bool,
    agent_name: str = "unknown",
    agent_version: str = "unknown",
    strict: bool = False,
    include_experts: bool = False,
    extra: dict[str, Any] | None = None,
    lineage: dict[str, list[LineageEdge]] | None = None,
) -> dict[str, Any]:
    """The ATIF trajectory of a rollout (see the module docstring). ``records``: the calls
    the read holds (the snapshot's); ``extra``: more root ``extra`` fields (snapshot id,
    version); ``lineage``: the rollout's edges by the chain they lead into
    (``core.lineage.find_lineage``). Raises AtifGaps in strict mode when the rollout has any
    gap."""
    found = gaps(records, rollout_diagnostics, incomplete)
    if strict and found:
        raise AtifGaps(found)
    chain, path = main_path(chains)
    edges = [
        (to_chain, edge)
        for to_chain, chain_edges in (lineage or {}).items()
        for edge in chain_edges
    ]
    spawned: dict[tuple[str, str], list[tuple[str, LineageEdge]]] = {}
    for to_chain, edge in edges:
        if edge.kind is LineageKind.SPAWNED_BY:
            key = (edge.from_call_id, str(edge.evidence.get("tool_call_id") or ""))
            spawned.setdefault(key, []).append((to_chain, edge))
    steps = _Steps(rollout_id, spawned)
    parent: CallRecord | None = None
    for call in path:
        history = call.request_messages or []
        steps.messages(history if parent is None else history[len(parent.request_messages) + 1 :])
        steps.answer(call, include_experts)
        parent = call
    with_images = any(c.images for c in path)
    total_prompt = sum(c.num_prompt_tokens for c in path)
    total_completion = sum(c.num_generation_tokens for c in path)
    return {
        "schema_version": ATIF_IMAGES_VERSION if with_images else ATIF_VERSION,
        "session_id": rollout_id,
        "agent": {
            "name": agent_name,
            "version": agent_version,
            **({"model_name": path[0].model} if path and path[0].model else {}),
        },
        "steps": steps.steps,
        "notes": (
            "Exported by capture-proxy from captured token data: the main chain's longest "
            "path; agent steps with metrics are captured calls, with the exact prompt and "
            "completion token ids and log probs the engine returned."
        ),
        "final_metrics": {
            "total_prompt_tokens": total_prompt,
            "total_completion_tokens": total_completion,
            "total_steps": len(steps.steps),
        },
        "extra": {
            "rollout_id": rollout_id,
            "chain_id": chain.chain_id if chain else None,
            "call_ids": [c.call_id for c in path],
            "weight_versions": tokens_by_version(path),
            "reward": metadata.reward,
            "task_id": metadata.task_id,
            "tags": metadata.tags,
            "other_chain_ids": [c.chain_id for c in chains.chains if c is not chain],
            "unlinked_call_ids": [r.call_id for r in chains.unlinked],
            "gaps": found,
            "lineage": [{**edge.to_json(), "to_chain_id": to} for to, edge in edges],
            **(extra or {}),
        },
    }
