"""Exports for the trainer over REST: the bulk stream of frozen rollouts, and per rollout the
token tree and ATIF.

    GET /captures/export?status=frozen&after=<cursor>&limit=N&episodes=final|all
        Arrow IPC stream (``core.export``), one record batch per frozen rollout with a cursor
        greater than ``after`` (default 0, at most ``store.base.MAX_CURSOR``), in cursor
        order, at most ``limit`` (1-1000, default 100). ``X-Capture-Next-After``: the cursor
        to pass as ``after`` for the next page (the last one sent; ``after`` itself on an
        empty page). ``episodes=final`` (default): a superseded episode is a batch of 0 rows
        with ``superseded_by`` set. ``min_weight_version``, ``weight_version``,
        ``unknown_weight_version``: keep only the samples whose generated tokens pass
        (``core.weight_filter``); each rollout's manifest names the dropped ones under
        ``weight_filter``. A parameter but ``weight_version`` given twice is a 400
        (``rest.query``).

    GET /captures/rollouts/<id>/tree
        ``application/zip``: the snapshot's chains as one token trie (``core.token_tree``):
        ``manifest.json`` + ``tree.npz``.
    GET /captures/rollouts/<id>/atif?strict=false&agent_name=&agent_version=&experts=false
        The main path as an ATIF-v1.4 trajectory (``core.atif``); ``strict=true``: 422
        (``rollout_has_gaps``) for a rollout with any gap diagnostic, naming them.

Cursors are the store's freeze sequence (``store.base``): a rollout frozen later sorts after
every cursor handed out before, so a trainer that commits the cursor of each rollout it has
durably taken and resumes ``after`` it neither loses nor repeats one, whatever was frozen or
retired meanwhile.

The work per rollout (chains, samples, encoding) runs on the REST thread; the loop only moves
bytes, each write's wait for the client bounded (``rest.sending``, ``read_send_timeout_s``).
Once the stream has started, an error (or a client that stops taking bytes) can no longer
change the status: the stream is cut without Arrow's end-of-stream marker, which every reader
reports as an error.
"""

from __future__ import annotations

import io
from typing import Any

from aiohttp import web

from capture_proxy.core.atif import AtifGaps, trajectory
from capture_proxy.core.chains import build_chains
from capture_proxy.core.episodes import final_episodes, parse_episode
from capture_proxy.core.export import CONTENT_TYPE, ExportEncoder
from capture_proxy.core.images import PromptImage
from capture_proxy.core.lineage import find_lineage
from capture_proxy.core.records import CallRecord
from capture_proxy.core.samples import ChainSample, chain_samples
from capture_proxy.core.token_tree import build_token_tree, write_tree
from capture_proxy.core.weight_filter import WeightFilter, select
from capture_proxy.proxy.errors import BadRequest, Unprocessable
from capture_proxy.proxy.keys import RECORDER_KEY, STORE_KEY
from capture_proxy.rest.images import images_of
from capture_proxy.rest.json_shapes import archive_manifest, dumps
from capture_proxy.rest.query import WEIGHT_FILTER_PARAMS, one_value, takes
from capture_proxy.rest.reads import (
    MAX_PAGE_SIZE,
    _json,
    _load,
    _off_loop,
    snapshot_records,
)
from capture_proxy.rest.rollout_state import RolloutState, diagnostics_json, lifecycle_json
from capture_proxy.rest.sending import end, send
from capture_proxy.rest.weight_query import weight_filter
from capture_proxy.store.base import MAX_CURSOR, RolloutInfo

DEFAULT_EXPORT_PAGE = 100


def _export_params(request: web.Request) -> tuple[int, int, bool]:
    status = one_value(request, "status", "frozen")
    if status != "frozen":
        raise BadRequest(
            f"status: only frozen rollouts are exported (a snapshot is what a cursor can "
            f"hold), got {status!r}",
            param="status",
            code="invalid_status",
        )
    raw_after = one_value(request, "after", "0")
    if not (raw_after.isascii() and raw_after.isdigit()):
        raise BadRequest(
            f"after: must be a cursor (a non-negative integer) from an earlier export, got "
            f"{raw_after!r}",
            param="after",
            code="invalid_cursor",
        )
    # Leading zeros off before int(): it refuses strings of more than 4,300 digits.
    digits = raw_after.lstrip("0") or "0"
    if len(digits) > len(str(MAX_CURSOR)) or int(digits) > MAX_CURSOR:
        shown = (
            raw_after if len(raw_after) <= 40 else f"{raw_after[:40]}... ({len(raw_after)} digits)"
        )
        raise BadRequest(
            f"after: a cursor is at most {MAX_CURSOR} (a 64-bit signed integer), got {shown}",
            param="after",
            code="invalid_cursor",
        )
    raw_limit = one_value(request, "limit", str(DEFAULT_EXPORT_PAGE))
    # (at most 9 characters: int() refuses a string of more than 4,300 digits)
    limit = (
        int(raw_limit) if raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) < 10 else 0
    )
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise BadRequest(
            f"limit must be an integer from 1 to {MAX_PAGE_SIZE}, got {raw_limit!r}",
            param="limit",
            code="invalid_limit",
        )
    episodes = one_value(request, "episodes", "final")
    if episodes not in ("final", "all"):
        raise BadRequest(
            f"episodes must be final or all, got {episodes!r}", param="episodes", code="invalid"
        )
    return int(digits), limit, episodes == "all"


def export_manifest(
    info: RolloutInfo,
    records: list[CallRecord],
    state: RolloutState,
    superseded_by: str | None,
    wf: WeightFilter | None = None,
) -> tuple[dict[str, Any], list[ChainSample]]:
    """A rollout's export manifest and samples (none for a superseded episode; those ``wf``
    keeps, its report in the manifest's ``weight_filter``)."""
    assert info.snapshot is not None
    chains = build_chains(info.rollout_id, records)
    base = archive_manifest(info, chains, state)
    lifecycle = base.pop("lifecycle")
    manifest = {
        "rollout_id": info.rollout_id,
        "cursor": info.snapshot.cursor,
        "snapshot": info.snapshot.to_json(),
        "version": info.version,
        "episode_of": lifecycle["episode_of"],
        "attempt": lifecycle["attempt"],
        "superseded_by": superseded_by,
        "metadata": info.metadata.to_json(),
        "late_call_ids": lifecycle["late_call_ids"],
        **base,
        "diagnostics": diagnostics_json(info, records, state),
        "weight_filter": None,
    }
    if superseded_by is not None:
        return manifest, []
    selection = select(chains, wf)
    manifest["weight_filter"] = selection.report
    return manifest, selection.samples()


def _encode(
    encoder: ExportEncoder,
    info: RolloutInfo,
    records: list[CallRecord],
    state: RolloutState,
    superseded_by: str | None,
    wf: WeightFilter | None,
    images: dict[str, PromptImage],
) -> bytes:
    manifest, samples = export_manifest(info, records, state, superseded_by, wf)
    return encoder.rollout(manifest, samples, info.metadata, images)


async def export_rollouts(request: web.Request) -> web.StreamResponse:
    """Stream one page of frozen rollouts as Arrow IPC (see the module docstring)."""
    after, limit, all_episodes = _export_params(request)
    wf = weight_filter(request)
    store = request.app[STORE_KEY]
    recorder = request.app[RECORDER_KEY]
    infos = await store.list_frozen(after=after, limit=limit)
    next_after = infos[-1].snapshot.cursor if infos and infos[-1].snapshot else after
    resp = web.StreamResponse(
        headers={
            "Content-Type": CONTENT_TYPE,
            "X-Capture-Next-After": str(next_after),
            "X-Capture-Count": str(len(infos)),
        }
    )
    encoder = ExportEncoder()
    await resp.prepare(request)
    await send(request, resp, encoder.header())
    for info in infos:
        records = snapshot_records(info, await store.get_rollout_calls(info.rollout_id))
        superseded_by = None
        if not all_episodes:
            base = parse_episode(info.rollout_id).base
            final = final_episodes(await store.list_episodes(base)).get(base, info.rollout_id)
            superseded_by = None if final == info.rollout_id else final
        state = RolloutState(info, recorder)
        images = await images_of(store, records) if superseded_by is None else {}
        batch = await _off_loop(
            request, _encode, encoder, info, records, state, superseded_by, wf, images
        )
        await send(request, resp, batch)
    await send(request, resp, encoder.end())
    await end(request, resp)
    return resp


def _tree_zip(info: RolloutInfo, records: list[CallRecord], state: RolloutState) -> bytes:
    chains = build_chains(info.rollout_id, records)
    tree = build_token_tree(info.rollout_id, [s for c in chains.chains for s in chain_samples(c)])
    buf = io.BytesIO()
    write_tree(tree, buf, archive_manifest(info, chains, state))
    return buf.getvalue()


async def get_tree(request: web.Request) -> web.Response:
    """The rollout's snapshot as one token tree (``core.token_tree``), built on the REST thread."""
    info, records = await _load(request)
    state = RolloutState(info, request.app[RECORDER_KEY])
    return web.Response(
        body=await _off_loop(request, _tree_zip, info, records, state),
        content_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="{info.rollout_id}.tree.zip"'},
    )


def _flag(request: web.Request, name: str) -> bool:
    raw = one_value(request, name, "false")
    if raw not in ("true", "false"):
        raise BadRequest(f"{name} must be true or false, got {raw!r}", param=name)
    return raw == "true"


def _name(request: web.Request, name: str) -> str:
    raw = one_value(request, name, "unknown")
    if not 1 <= len(raw) <= 256:
        raise BadRequest(f"{name} must have 1-256 characters", param=name)
    return raw


def _atif_json(
    info: RolloutInfo,
    records: list[CallRecord],
    state: RolloutState,
    options: dict[str, Any],
) -> bytes:
    chains = build_chains(info.rollout_id, records)
    lifecycle = lifecycle_json(info)
    return dumps(
        trajectory(
            info.rollout_id,
            records,
            chains,
            metadata=info.metadata,
            rollout_diagnostics=diagnostics_json(info, records, state)["rollout"],
            incomplete=state.incomplete,
            extra={k: lifecycle[k] for k in ("status", "snapshot_id", "version", "episode_of")},
            lineage=find_lineage(chains),
            **options,
        )
    )


async def get_atif(request: web.Request) -> web.Response:
    """The rollout's main path as ATIF (``core.atif``); strict: 422 for any gap."""
    options = {
        "strict": _flag(request, "strict"),
        "include_experts": _flag(request, "experts"),
        "agent_name": _name(request, "agent_name"),
        "agent_version": _name(request, "agent_version"),
    }
    info, records = await _load(request)
    state = RolloutState(info, request.app[RECORDER_KEY])
    try:
        return _json(await _off_loop(request, _atif_json, info, records, state, options))
    except AtifGaps as exc:
        raise Unprocessable(
            f"strict ATIF refused: {exc} (see GET /captures/rollouts/{info.rollout_id})",
            param="strict",
            code="rollout_has_gaps",
        ) from exc


def add_routes(app: web.Application) -> None:
    app.router.add_get(
        "/captures/export",
        takes("status", "after", "limit", "episodes", *WEIGHT_FILTER_PARAMS)(export_rollouts),
    )
    app.router.add_get("/captures/rollouts/{rollout_id}/tree", takes()(get_tree))
    app.router.add_get(
        "/captures/rollouts/{rollout_id}/atif",
        takes("strict", "experts", "agent_name", "agent_version")(get_atif),
    )
