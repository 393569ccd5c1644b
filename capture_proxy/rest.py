"""The REST read API under ``/captures``: rollouts, chains and calls as JSON.

Owns the JSON shapes the training side reads. Chains are built on read by the core
(``build_chains``) from the stored records, so the same captured calls give the same chains in
any arrival order. Arrays become JSON lists here; non-finite log probs become ``null`` and are
named by the call's ``non_finite_logprob`` diagnostic (JSON has no NaN).
"""

from __future__ import annotations

import io
import math
from collections import Counter
from typing import Any

from aiohttp import web

from capture_proxy.core.chains import RolloutChains, build_chains
from capture_proxy.core.records import CallRecord, CallStatus
from capture_proxy.core.routing import InvalidRolloutId, validate_rollout_id
from capture_proxy.core.samples import write_archive
from capture_proxy.core.summary import link_stats
from capture_proxy.proxy.errors import BadRequest, NotFound
from capture_proxy.proxy.linker import Linker
from capture_proxy.proxy.recorder import Recorder
from capture_proxy.store.base import CaptureStore, RolloutInfo

STORE_KEY = web.AppKey("store", CaptureStore)
RECORDER_KEY = web.AppKey("recorder", Recorder)
LINKER_KEY = web.AppKey("linker", Linker)


def _log_probs_json(record: CallRecord) -> list[float | None]:
    return [float(x) if math.isfinite(x) else None for x in record.generation_log_probs.tolist()]


def call_json(record: CallRecord, *, parent_call_id: str | None, detail: bool) -> dict[str, Any]:
    """One call as JSON. ``detail`` adds the request messages and tools."""
    out: dict[str, Any] = {
        "call_id": record.call_id,
        "rollout_id": record.rollout_id,
        "parent_call_id": parent_call_id,
        "status": record.status.value,
        "created_at": record.created_at,
        "latency_ms": record.latency_ms,
        "model": record.model,
        "stream": record.stream,
        "finish_reason": record.finish_reason,
        "usage": record.usage,
        "num_prompt_tokens": record.num_prompt_tokens,
        "num_generation_tokens": record.num_generation_tokens,
        "prompt_token_ids": record.prompt_token_ids.tolist(),
        "generation_token_ids": record.generation_token_ids.tolist(),
        "generation_log_probs": _log_probs_json(record),
        "routed_experts": None if record.routed_experts is None else record.routed_experts.tolist(),
        "routed_experts_start": record.routed_experts_start,
        "response_message": record.response_message,
        "linking": record.linking,
        "retry_of": record.retry_of,
        "diagnostics": [d.to_json() for d in record.diagnostics],
        "schema_version": record.schema_version,
    }
    if detail:
        out["request_messages"] = record.request_messages
        out["request_tools"] = record.request_tools
    return out


def _rollout_id(request: web.Request) -> str:
    try:
        return validate_rollout_id(request.match_info["rollout_id"])
    except InvalidRolloutId as exc:
        raise BadRequest(str(exc), param="rollout_id", code="invalid_rollout_id") from exc


async def _load(request: web.Request) -> tuple[RolloutInfo, list[CallRecord], RolloutChains]:
    rollout_id = _rollout_id(request)
    store = request.app[STORE_KEY]
    info = await store.get_rollout(rollout_id)
    if info is None:
        raise NotFound(f"rollout {rollout_id} not found", param="rollout_id", code="not_found")
    records = await store.get_rollout_calls(rollout_id)
    return info, records, build_chains(rollout_id, records)


def _diagnostics(
    info: RolloutInfo, records: list[CallRecord], recorder: Recorder
) -> dict[str, Any]:
    by_kind = Counter(d.kind for r in records for d in r.diagnostics)
    rollout_level = [d.to_json() for d in info.diagnostics]
    if info.rollout_id in recorder.unstored_incomplete:
        rollout_level.append(
            {
                "kind": "store_failed",
                "details": {"reason": recorder.unstored_incomplete[info.rollout_id]},
            }
        )
    return {"rollout": rollout_level, "calls_by_kind": dict(sorted(by_kind.items()))}


def _incomplete(info: RolloutInfo, recorder: Recorder) -> bool:
    return info.incomplete or info.rollout_id in recorder.unstored_incomplete


def _unlinked_json(record: CallRecord, chains: RolloutChains) -> dict[str, Any]:
    superseded_by = chains.superseded.get(record.call_id)
    return {
        "call_id": record.call_id,
        "status": record.status.value,
        "reason": "superseded_retry" if superseded_by else record.status.value,
        "superseded_by": superseded_by,
        "diagnostics": [d.to_json() for d in record.diagnostics],
    }


async def list_rollouts(request: web.Request) -> web.Response:
    store = request.app[STORE_KEY]
    recorder = request.app[RECORDER_KEY]
    out = []
    for info in await store.list_rollouts():
        chains = build_chains(info.rollout_id, await store.get_rollout_calls(info.rollout_id))
        out.append(
            {
                "rollout_id": info.rollout_id,
                "created_at": info.created_at,
                "num_calls": info.num_calls,
                "num_chains": len(chains.chains),
                "incomplete": _incomplete(info, recorder),
            }
        )
    return web.json_response({"rollouts": out})


async def get_rollout(request: web.Request) -> web.Response:
    info, records, chains = await _load(request)
    recorder = request.app[RECORDER_KEY]
    status_counts = Counter(r.status.value for r in records)
    summary = {
        "rollout_id": info.rollout_id,
        "created_at": info.created_at,
        "num_calls": len(records),
        "num_complete": status_counts.get(CallStatus.COMPLETE.value, 0),
        "num_incomplete": status_counts.get(CallStatus.INCOMPLETE.value, 0),
        "num_failed": status_counts.get(CallStatus.FAILED.value, 0),
        "num_chains": len(chains.chains),
        "num_roots": len(chains.chains),
        "num_branches": sum(c.num_branches for c in chains.chains),
        "chains": [
            {
                "chain_id": c.chain_id,
                "num_calls": len(c.calls),
                "num_generation_tokens": sum(r.num_generation_tokens for r in c.calls),
            }
            for c in chains.chains
        ],
        "linking": link_stats(records, chains),
        "incomplete": _incomplete(info, recorder),
        "diagnostics": _diagnostics(info, records, recorder),
    }
    return web.json_response(summary)


async def get_rollout_chains(request: web.Request) -> web.Response:
    """JSON by default; ``?format=npz``: a zip of one ``.npz`` per chain path plus
    ``manifest.json`` for training loaders (see ``core.samples``, ``readers.load_chains``)."""
    fmt = request.query.get("format", "json")
    if fmt not in ("json", "npz"):
        raise BadRequest("format must be json or npz", param="format", code="invalid_format")
    info, records, chains = await _load(request)
    recorder = request.app[RECORDER_KEY]
    if fmt == "npz":
        buf = io.BytesIO()
        extra = {
            "unlinked_call_ids": [r.call_id for r in chains.unlinked],
            "incomplete": _incomplete(info, recorder),
        }
        write_archive(chains, buf, extra)
        disposition = f'attachment; filename="{info.rollout_id}.chains.zip"'
        return web.Response(
            body=buf.getvalue(),
            content_type="application/zip",
            headers={"Content-Disposition": disposition},
        )
    body = {
        "rollout_id": info.rollout_id,
        "chains": [
            {
                "chain_id": chain.chain_id,
                "calls": [
                    call_json(r, parent_call_id=chain.parent_of[r.call_id], detail=False)
                    for r in chain.calls
                ],
            }
            for chain in chains.chains
        ],
        "unlinked_calls": [_unlinked_json(r, chains) for r in chains.unlinked],
        "incomplete": _incomplete(info, recorder),
        "diagnostics": _diagnostics(info, records, recorder),
    }
    return web.json_response(body)


async def get_call(request: web.Request) -> web.Response:
    call_id = request.match_info["call_id"]
    store = request.app[STORE_KEY]
    record = await store.get_call(call_id)
    if record is None:
        raise NotFound(f"call {call_id} not found", param="call_id", code="not_found")
    if record.linking is not None:
        # Linked at capture time (resolved by digest, verified by tokens): the stored link.
        parent_call_id = record.parent_call_id
    else:
        chains = build_chains(record.rollout_id, await store.get_rollout_calls(record.rollout_id))
        parent_call_id = chains.parent_of.get(record.call_id, record.parent_call_id)
    return web.json_response(call_json(record, parent_call_id=parent_call_id, detail=True))


async def delete_rollout(request: web.Request) -> web.Response:
    """Delete a rollout's calls and leave a tombstone, so a late or retried call cannot
    resurrect it (it is refused and the harness still gets its answer). Idempotent."""
    rollout_id = _rollout_id(request)
    deleted = await request.app[STORE_KEY].delete_rollout(rollout_id)
    request.app[LINKER_KEY].forget(rollout_id)
    return web.json_response({"rollout_id": rollout_id, "deleted_calls": deleted})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/captures/rollouts", list_rollouts)
    app.router.add_get("/captures/rollouts/{rollout_id}", get_rollout)
    app.router.add_get("/captures/rollouts/{rollout_id}/chains", get_rollout_chains)
    app.router.add_get("/captures/calls/{call_id}", get_call)
    app.router.add_delete("/captures/rollouts/{rollout_id}", delete_rollout)
