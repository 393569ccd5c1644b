"""The REST read API under ``/captures``: rollouts, chains and calls as JSON.

Owns the reads the training side makes; the JSON shapes they answer with (arrays as JSON lists,
non-finite log probs as ``null``) are ``rest.json_shapes``'s. Chains are built on read by the
core (``build_chains``) from the stored records, so the same captured calls give the same chains
in any arrival order.

The proxy's event loop relays every stream, so nothing here runs long on it: records are
decoded on the store's reader thread, and chains are built and serialised (orjson, numpy
arrays natively, one call at a time so the GIL passes between them) on the REST thread
(``capture-rest``). A 40-turn rollout of 293,000 prompt ids took 120 ms on the loop with the
stdlib's json; now the loop is never held for more than one call's serialisation.

A frozen rollout's reads for training (chains, npz, and the exports in ``rest.downloads``) hold
its snapshot: the calls stored before the freeze. Calls stored after it are named in
``late_call_ids`` and left out. Lifecycle steps are in ``rest.lifecycle``.
"""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from aiohttp import web

from capture_proxy.core.chains import build_chains
from capture_proxy.core.episodes import final_episodes, parse_episode
from capture_proxy.core.images import PromptImage
from capture_proxy.core.lineage import find_lineage
from capture_proxy.core.lineage.find import count_by_kind
from capture_proxy.core.records import CallRecord, CallStatus
from capture_proxy.core.routing import InvalidRolloutId, validate_rollout_id
from capture_proxy.core.samples import write_archive
from capture_proxy.core.summary import link_stats
from capture_proxy.core.weight_filter import WeightFilter, select
from capture_proxy.core.weight_versions import rollout_summary as rollout_weight_versions
from capture_proxy.proxy.errors import BadRequest, MethodNotAllowed, NotFound
from capture_proxy.proxy.keys import LINKER_KEY, RECORDER_KEY, STORE_KEY
from capture_proxy.proxy.traffic_tap import remove_recording
from capture_proxy.rest.deadline import bound_reads
from capture_proxy.rest.images import images_of
from capture_proxy.rest.json_shapes import _chains_body, archive_manifest, call_json, dumps
from capture_proxy.rest.query import WEIGHT_FILTER_PARAMS, one_value, takes
from capture_proxy.rest.rollout_state import RolloutState, diagnostics_json, lifecycle_json
from capture_proxy.rest.weight_query import weight_filter
from capture_proxy.store.base import RolloutInfo

REST_THREAD_KEY = web.AppKey("rest_thread", ThreadPoolExecutor)

#: ``GET /captures/rollouts`` page size: default and maximum.
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000

T = TypeVar("T")


def _json(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


async def _off_loop(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on the REST thread."""
    return await asyncio.get_running_loop().run_in_executor(request.app[REST_THREAD_KEY], fn, *args)


def _rollout_id(request: web.Request) -> str:
    try:
        return validate_rollout_id(request.match_info["rollout_id"])
    except InvalidRolloutId as exc:
        raise BadRequest(str(exc), param="rollout_id", code="invalid_rollout_id") from exc


def snapshot_records(info: RolloutInfo, records: list[CallRecord]) -> list[CallRecord]:
    """The calls a training read holds: all but the late ones (stored after the freeze)."""
    if not info.late_call_ids:
        return records
    late = set(info.late_call_ids)
    return [r for r in records if r.call_id not in late]


async def _load(request: web.Request) -> tuple[RolloutInfo, list[CallRecord]]:
    """The rollout and its snapshot's calls (late calls left out). 404 when unknown; a
    rollout the store does not know but whose answered calls it lost (their loss not yet
    marked: ``proxy.losses``) is an empty, incomplete one."""
    rollout_id = _rollout_id(request)
    found = await request.app[STORE_KEY].get_rollout_with_calls(rollout_id)  # one hop
    if found is None:
        loss = request.app[RECORDER_KEY].losses.pending.get(rollout_id)
        if loss is not None:
            return RolloutInfo(rollout_id, loss.since, 0, True), []
        raise NotFound(f"rollout {rollout_id} not found", param="rollout_id", code="not_found")
    info, records = found
    return info, snapshot_records(info, records)


def _page_params(request: web.Request) -> tuple[int, str | None]:
    raw = one_value(request, "limit", str(DEFAULT_PAGE_SIZE))
    # (at most 9 characters: int() refuses a string of more than 4,300 digits)
    limit = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 10 else 0
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise BadRequest(
            f"limit must be an integer from 1 to {MAX_PAGE_SIZE}, got {raw!r}",
            param="limit",
            code="invalid_limit",
        )
    after = one_value(request, "after")
    if after is not None:
        try:
            validate_rollout_id(after)
        except InvalidRolloutId as exc:
            raise BadRequest(f"after: {exc}", param="after", code="invalid_rollout_id") from exc
    return limit, after


def _listing_json(
    page: list[tuple[RolloutInfo, list[CallRecord] | None, RolloutState]], next_after: str | None
) -> bytes:
    rollouts = [
        {
            "rollout_id": info.rollout_id,
            "created_at": info.created_at,
            "num_calls": info.num_calls,
            "num_chains": _num_chains(info, records),
            "incomplete": state.incomplete,
            **lifecycle_json(info),
        }
        for info, records, state in page
    ]
    return dumps({"rollouts": rollouts, "next_after": next_after})


def _num_chains(info: RolloutInfo, records: list[CallRecord] | None) -> int:
    """The rollout's number of chains: kept by the store, else built from ``records``."""
    if records is None:
        assert info.num_chains is not None
        return info.num_chains
    return len(build_chains(info.rollout_id, records).chains)


async def list_rollouts(request: web.Request) -> web.Response:
    """One page of rollouts in rollout id order (``?limit``, default 100, at most 1,000;
    ``?after=<rollout id>``: the page after that id). ``next_after`` names the last rollout
    of the page when more rollouts follow it (pass it as ``after``), null on the last page
    (one rollout more than the page is fetched to know). Reads the store's rows of the page,
    no call: the number of chains is kept per rollout (``RolloutInfo.num_chains``); only a
    rollout whose store does not keep it has its calls loaded and its chains built."""
    limit, after = _page_params(request)
    store = request.app[STORE_KEY]
    recorder = request.app[RECORDER_KEY]
    infos = await store.list_rollouts(limit=limit + 1, after=after)
    more = len(infos) > limit
    infos = infos[:limit]
    page = [
        (
            info,
            None
            if info.num_chains is not None
            else snapshot_records(info, await store.get_rollout_calls(info.rollout_id)),
            RolloutState(info, recorder),
        )
        for info in infos
    ]
    next_after = infos[-1].rollout_id if more else None
    return _json(await _off_loop(request, _listing_json, page, next_after))


def _summary_json(
    info: RolloutInfo, records: list[CallRecord], state: RolloutState, episodes: list[str]
) -> bytes:
    chains = build_chains(info.rollout_id, records)
    status_counts = Counter(r.status.value for r in records)
    return dumps(
        {
            "rollout_id": info.rollout_id,
            "created_at": info.created_at,
            "num_calls": len(records),
            "num_complete": status_counts.get(CallStatus.COMPLETE.value, 0),
            "num_incomplete": status_counts.get(CallStatus.INCOMPLETE.value, 0),
            "num_failed": status_counts.get(CallStatus.FAILED.value, 0),
            "num_chains": len(chains.chains),
            "num_roots": len(chains.chains),
            "num_branches": sum(c.num_branches for c in chains.chains),
            # calls by prompt mode (records before schema v4 have none and are not counted)
            "prompt_modes": dict(
                sorted(Counter(r.prompt_mode for r in records if r.prompt_mode).items())
            ),
            **rollout_weight_versions(records),
            "chains": [
                {
                    "chain_id": c.chain_id,
                    "num_calls": len(c.calls),
                    "num_generation_tokens": sum(r.num_generation_tokens for r in c.calls),
                }
                for c in chains.chains
            ],
            "linking": link_stats(records, chains),
            "lineage": count_by_kind(find_lineage(chains)),
            "incomplete": state.incomplete,
            "diagnostics": diagnostics_json(info, records, state),
            **lifecycle_json(info),
            "snapshot": info.snapshot.to_json() if info.snapshot else None,
            "episodes": {
                "rollout_ids": episodes,
                "final": final_episodes(episodes).get(parse_episode(info.rollout_id).base),
            },
        }
    )


async def get_rollout(request: web.Request) -> web.Response:
    info, records = await _load(request)
    state = RolloutState(info, request.app[RECORDER_KEY])
    episodes = await request.app[STORE_KEY].list_episodes(parse_episode(info.rollout_id).base)
    return _json(await _off_loop(request, _summary_json, info, records, state, episodes))


def _chains_json(
    info: RolloutInfo, records: list[CallRecord], state: RolloutState, wf: WeightFilter | None
) -> bytes:
    chains = build_chains(info.rollout_id, records)
    selection = select(chains, wf) if wf is not None else None
    kept = selection.call_ids() if selection is not None else None
    report = selection.report if selection is not None else None
    calls = {
        r.call_id: call_json(r, parent_call_id=chain.parent_of[r.call_id], detail=False)
        for chain in chains.chains
        for r in chain.calls
        if kept is None or r.call_id in kept
    }
    try:
        # One call per serialisation, spliced in whole: the GIL passes between calls.
        fragments = {k: orjson.Fragment(dumps(v)) for k, v in calls.items()}
        return orjson.dumps(_chains_body(info, records, state, chains, fragments, report))
    except TypeError:  # something outside the calls orjson refuses: all of it the slow way
        return dumps(_chains_body(info, records, state, chains, calls, report))


def _chains_npz(
    info: RolloutInfo,
    records: list[CallRecord],
    state: RolloutState,
    wf: WeightFilter | None,
    images: dict[str, PromptImage],
) -> bytes:
    chains = build_chains(info.rollout_id, records)
    selection = select(chains, wf)
    buf = io.BytesIO()
    manifest = {**archive_manifest(info, chains, state), "weight_filter": selection.report}
    write_archive(chains, buf, manifest, samples=selection.samples(), images=images)
    return buf.getvalue()


async def get_rollout_chains(request: web.Request) -> web.Response:
    """JSON by default; ``?format=npz``: a zip of one ``.npz`` per chain path plus
    ``manifest.json`` for training loaders (see ``core.samples``, ``readers.load_chains``).
    Both take the weight-version filter (``rest.weight_query``)."""
    fmt = one_value(request, "format", "json")
    if fmt not in ("json", "npz"):
        raise BadRequest("format must be json or npz", param="format", code="invalid_format")
    wf = weight_filter(request)
    info, records = await _load(request)
    state = RolloutState(info, request.app[RECORDER_KEY])
    if fmt == "npz":
        disposition = f'attachment; filename="{info.rollout_id}.chains.zip"'
        return web.Response(
            body=await _off_loop(
                request,
                _chains_npz,
                info,
                records,
                state,
                wf,
                await images_of(request.app[STORE_KEY], records),
            ),
            content_type="application/zip",
            headers={"Content-Disposition": disposition},
        )
    return _json(await _off_loop(request, _chains_json, info, records, state, wf))


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
    return _json(dumps(call_json(record, parent_call_id=parent_call_id, detail=True)))


async def delete_rollout(request: web.Request) -> web.Response:
    """Delete a rollout's calls and leave a tombstone, so a late or retried call cannot
    resurrect it (it is refused and the harness still gets its answer). Idempotent (a repeat
    deletes 0 calls); 404 without a tombstone for a rollout nothing is known of."""
    rollout_id = _rollout_id(request)
    linker = request.app[LINKER_KEY]
    deleted = await request.app[STORE_KEY].delete_rollout(
        rollout_id, known_elsewhere=linker.has_calls(rollout_id)
    )
    if deleted is None:
        raise NotFound(
            f"rollout {rollout_id} not found (nothing stored, in flight or deleted under it)",
            param="rollout_id",
            code="not_found",
        )
    linker.forget(rollout_id)
    remove_recording(request.app, rollout_id)
    return web.json_response({"rollout_id": rollout_id, "deleted_calls": deleted})


async def _rest_thread(app: web.Application) -> AsyncIterator[None]:
    app[REST_THREAD_KEY] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-rest")
    try:
        yield
    finally:
        app[REST_THREAD_KEY].shutdown(wait=True, cancel_futures=True)


async def unknown_captures_path(request: web.Request) -> web.Response:
    """Under ``/captures``, what no read-API route took: a 405 with ``Allow`` when a route
    exists for the path with other methods (``POST /captures/rollouts``), else a 404. Routed
    for ``/captures`` and ``/captures/{tail}`` after every other ``/captures`` route (the
    lifecycle's and the export's too), so it takes only what none of them took."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is request.match_info.route.resource or not resource.canonical.startswith(
            "/captures/"
        ):
            continue
        match, methods = await resource.resolve(request)
        if match is None:
            allowed |= methods
    if allowed:
        raise MethodNotAllowed(
            f"{request.method} is not allowed on {request.path} (allowed: "
            f"{', '.join(sorted(allowed))})",
            allowed=tuple(sorted(allowed)),
        )
    raise NotFound(f"no such read API path: {request.path}", code="not_found")


def add_routes(app: web.Application, *, read_only: bool = False) -> None:
    """The read API's routes, the REST thread (started and stopped with the app) and the
    lifting of a read's deadline as its answer starts (``rest.deadline``); ``read_only``:
    without ``DELETE``."""
    app.cleanup_ctx.append(_rest_thread)
    bound_reads(app)
    app.router.add_get("/captures/rollouts", takes("limit", "after")(list_rollouts))
    app.router.add_get("/captures/rollouts/{rollout_id}", takes()(get_rollout))
    app.router.add_get(
        "/captures/rollouts/{rollout_id}/chains",
        takes("format", *WEIGHT_FILTER_PARAMS)(get_rollout_chains),
    )
    app.router.add_get("/captures/calls/{call_id}", takes()(get_call))
    if not read_only:
        app.router.add_delete("/captures/rollouts/{rollout_id}", takes()(delete_rollout))
        return
    # The proxy's writes, answered as refused here rather than as unknown paths.
    app.router.add_delete("/captures/rollouts/{rollout_id}", refuse_read_only)
    app.router.add_post("/captures/rollouts/{rollout_id}/freeze", refuse_read_only)
    app.router.add_put("/captures/rollouts/{rollout_id}/metadata", refuse_read_only)
    app.router.add_post("/captures/rollouts/{rollout_id}/retire", refuse_read_only)


async def refuse_read_only(request: web.Request) -> web.Response:
    """A write (delete, freeze, metadata, retire) to ``serve --read-only``: a 405."""
    raise MethodNotAllowed(
        f"{request.method} {request.path}: this server is read-only (serve --read-only): "
        "freeze, metadata, retire and delete go to the proxy that captured the rollout",
        allowed=("GET", "HEAD"),
        code="read_only",
    )
