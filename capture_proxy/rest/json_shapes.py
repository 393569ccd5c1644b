"""The JSON shapes of the read API's calls and rollouts, and their serialisation.

Arrays become JSON lists here (``dumps``: orjson, numpy arrays natively); non-finite log probs
become ``null`` and are named by the call's ``non_finite_logprob`` diagnostic, or
``logprob_out_of_float32_range`` (JSON has no NaN). Used by ``rest.reads`` and
``rest.downloads``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson

from capture_proxy.core.chains import RolloutChains
from capture_proxy.core.lineage import LineageEdge, find_lineage
from capture_proxy.core.records import CallRecord
from capture_proxy.core.summary import main_chain
from capture_proxy.rest.rollout_state import RolloutState, diagnostics_json, lifecycle_json
from capture_proxy.store.base import RolloutInfo


def _plain(value: Any) -> Any:
    """The stdlib fallback's view of a numpy array (non-finite floats as None)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            return [x if math.isfinite(x) else None for x in value.tolist()]
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def dumps(value: Any) -> bytes:
    """JSON bytes: orjson (numpy arrays natively, NaN and infinities as ``null``); the stdlib,
    ASCII-escaped, for what orjson refuses (integers past 64 bits, lone surrogates)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return json.dumps(value, default=_plain, allow_nan=False).encode()


def call_json(record: CallRecord, *, parent_call_id: str | None, detail: bool) -> dict[str, Any]:
    """One call for ``dumps``: token ids uint32 arrays, log probs as float64 (the float32
    value exactly, as engines send it), routed experts ``[num_rows, num_layers, top_k]``.
    ``detail`` adds the request messages and tools, and the request as the harness sent it
    less its history field (``request_received``: what the canonical form leaves out, e.g.
    ``metadata``, server tools, ``cache_control``)."""
    experts = record.routed_experts
    out: dict[str, Any] = {
        "call_id": record.call_id,
        "rollout_id": record.rollout_id,
        "api": record.api,
        "sampling": record.sampling,
        "session_headers": record.session_headers,
        "parent_call_id": parent_call_id,
        "status": record.status.value,
        "created_at": record.created_at,
        "latency_ms": record.latency_ms,
        "model": record.model,
        "stream": record.stream,
        "prompt_mode": record.prompt_mode,
        "weight_versions": record.weight_versions,
        "weight_version_source": record.weight_version_source,
        "finish_reason": record.finish_reason,
        "usage": record.usage,
        "num_prompt_tokens": record.num_prompt_tokens,
        "num_generation_tokens": record.num_generation_tokens,
        "prompt_token_ids": np.ascontiguousarray(record.prompt_token_ids, dtype=np.uint32),
        "generation_token_ids": np.ascontiguousarray(record.generation_token_ids, dtype=np.uint32),
        "generation_log_probs": record.generation_log_probs.astype(np.float64),
        "routed_experts": None if experts is None else np.ascontiguousarray(experts),
        "routed_experts_start": record.routed_experts_start,
        "response_message": record.response_message,
        "linking": record.linking,
        "retry_of": record.retry_of,
        "diagnostics": [d.to_json() for d in record.diagnostics],
        "images": record.images,
        "schema_version": record.schema_version,
    }
    if detail:
        out["request_messages"] = record.request_messages
        out["request_tools"] = record.request_tools
        out["request_received"] = record.request_received
    return out


def _unlinked_json(record: CallRecord, chains: RolloutChains) -> dict[str, Any]:
    superseded_by = chains.superseded.get(record.call_id)
    return {
        "call_id": record.call_id,
        "status": record.status.value,
        "reason": "superseded_retry" if superseded_by else record.status.value,
        "superseded_by": superseded_by,
        "diagnostics": [d.to_json() for d in record.diagnostics],
    }


def _chains_body(
    info: RolloutInfo,
    records: list[CallRecord],
    state: RolloutState,
    chains: RolloutChains,
    calls: dict[str, Any],
    weight_report: dict[str, Any] | None,
) -> dict[str, Any]:
    """``calls``: the kept calls' JSON by call id (every chain call without a weight filter;
    ``weight_report``: the filter's, ``core.weight_filter``); a chain none of whose calls is
    kept is left out."""
    lineage = lineage_json(find_lineage(chains))
    return {
        "rollout_id": info.rollout_id,
        "chains": [
            {
                "chain_id": chain.chain_id,
                "lineage": lineage.get(chain.chain_id, []),
                "calls": [calls[r.call_id] for r in chain.calls if r.call_id in calls],
            }
            for chain in chains.chains
            if any(r.call_id in calls for r in chain.calls)
        ],
        "unlinked_calls": [_unlinked_json(r, chains) for r in chains.unlinked],
        "main_chain_id": _main_chain_id(chains),
        "incomplete": state.incomplete,
        "diagnostics": diagnostics_json(info, records, state),
        "weight_filter": weight_report,
        **lifecycle_json(info),
    }


def lineage_json(lineage: dict[str, list[LineageEdge]]) -> dict[str, list[dict[str, Any]]]:
    """Lineage edges by the chain they lead into: ``{chain_id: [{"kind", "chain_id",
    "from_call_id", "evidence"}]}`` (``core.lineage``)."""
    return {chain_id: [e.to_json() for e in edges] for chain_id, edges in lineage.items()}


def _main_chain_id(chains: RolloutChains) -> str | None:
    main = main_chain(chains)
    return main.chain_id if main is not None else None


def archive_manifest(
    info: RolloutInfo, chains: RolloutChains, state: RolloutState
) -> dict[str, Any]:
    """The rollout-level fields of the npz archive's ``manifest.json`` (and of an export's
    rollout manifest and the tree's): unlinked calls, the main chain, the lineage edges by
    the chain they lead into, completeness, and under ``lifecycle`` the status, version,
    snapshot id, episode, metadata and late calls."""
    return {
        "unlinked_call_ids": [r.call_id for r in chains.unlinked],
        "main_chain_id": _main_chain_id(chains),
        "lineage": lineage_json(find_lineage(chains)),
        "incomplete": state.incomplete,
        # Nested: the archive's own ``version`` is its format's.
        "lifecycle": lifecycle_json(info),
    }
