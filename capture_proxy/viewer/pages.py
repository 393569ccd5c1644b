"""The viewer's routes and handlers (see the package docstring)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jinja2
from aiohttp import web
from pydantic import SecretStr

from capture_proxy.core.chains import build_chains
from capture_proxy.core.lineage import find_lineage
from capture_proxy.core.records import CallRecord, DiagnosticKind
from capture_proxy.core.routing import InvalidRolloutId, validate_rollout_id
from capture_proxy.core.summary import link_stats
from capture_proxy.core.view import tokens
from capture_proxy.core.view.call import call_view, plan_call
from capture_proxy.core.view.call_tree import build_call_tree
from capture_proxy.core.view.episode import episode_rows
from capture_proxy.core.view.rollouts import (
    STATUSES,
    RolloutRow,
    format_reward,
    kept_rollout_row,
    matches,
    rollout_row,
)
from capture_proxy.core.weight_versions import tokens_by_version
from capture_proxy.proxy.auth import UI_PREFIX, see_other, set_viewer_cookie, token_matches
from capture_proxy.proxy.errors import NotFound
from capture_proxy.proxy.keys import RECORDER_KEY, STORE_KEY
from capture_proxy.rest.images import get_image
from capture_proxy.rest.reads import REST_THREAD_KEY
from capture_proxy.store.base import RolloutInfo
from capture_proxy.viewer.detokenize import (
    Detokenizer,
    EngineDetokenizer,
    LocalDetokenizer,
    NoDetokenizer,
)

STATIC_DIR = Path(__file__).parent / "static"
#: Rollouts per listing page, and how many rollouts one listing request scans at most while
#: filtering (the next page goes on from where it stopped).
LISTING_PAGE_SIZE = 50
LISTING_MAX_SCAN = 1000
#: Diagnostic kinds offered by the listing's filter.
KINDS = tuple(k.value for k in DiagnosticKind)


@dataclass(frozen=True)
class ViewerConfig:
    """``backend``: engine base URL for ``/detokenize`` (None: no engine); ``tokenizer``: a
    local HF tokenizer directory (preferred when set); ``read_only``: a store browsed without
    a running proxy (said on every page)."""

    captures_token: SecretStr | None = None
    backend: str | None = None
    tokenizer: Path | None = None
    read_only: bool = False


@dataclass
class Viewer:
    config: ViewerConfig
    env: jinja2.Environment
    detokenizer: Detokenizer


VIEWER_KEY = web.AppKey("viewer", Viewer)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("capture_proxy.viewer", "templates"),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["ms"] = lambda v: "–" if v is None else f"{v:,.0f} ms"
    env.filters["lp"] = lambda v: "–" if v is None else f"{v:.3f}"
    env.filters["num"] = lambda v: f"{v:,}"
    env.filters["short"] = lambda v: v if v is None or len(v) <= 14 else v[:14] + "…"
    env.filters["reward"] = format_reward
    env.globals["UI"] = UI_PREFIX
    return env


def _special(text: str) -> bool:
    return text.startswith("<|") and text.endswith("|>")


async def _off_loop(request: web.Request, fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(request.app[REST_THREAD_KEY], fn, *args)


def _render(viewer: Viewer, name: str, **context: Any) -> str:
    return viewer.env.get_template(name).render(
        read_only=viewer.config.read_only,
        auth=viewer.config.captures_token is not None,
        **context,
    )


def _html(body: str, status: int = 200) -> web.Response:
    return web.Response(
        text=body,
        status=status,
        content_type="text/html",
        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"},
    )


async def _page(
    request: web.Request, name: str, http_status: int = 200, **context: Any
) -> web.Response:
    viewer = request.app[VIEWER_KEY]
    body = await _off_loop(request, lambda: _render(viewer, name, **context))
    return _html(body, http_status)


async def _not_found(request: web.Request, what: str) -> web.Response:
    return await _page(request, "error.html", 404, title="Not found", message=what)


def _rollout_diag_kinds(request: web.Request, info: RolloutInfo) -> list[str]:
    kinds = [d.kind for d in info.diagnostics]
    loss = request.app[RECORDER_KEY].losses.diagnostic(info.rollout_id)
    if loss is not None and loss.kind not in kinds:
        kinds.append(loss.kind)
    return kinds


def _needs_calls(info: RolloutInfo) -> bool:
    """Whether the listing row needs the rollout's calls: the store does not keep its number of
    chains, or it has late calls (the row counts them; the store's figures leave them out)."""
    return info.num_chains is None or bool(info.late_call_ids)


def _rows(
    batch: list[tuple[RolloutInfo, list[str], list[CallRecord] | None]], now: float
) -> list[RolloutRow]:
    """The rows of ``batch`` (each rollout's info, rollout-level diagnostic kinds and, when
    ``_needs_calls``, its calls; else the counts the store keeps)."""
    rows = []
    for info, kinds, records in batch:
        # The trainer's metadata (core.metadata.RolloutMetadata): a dash when absent.
        metadata = info.metadata.to_json() if info.metadata is not None else None
        incomplete = info.incomplete or DiagnosticKind.STORE_FAILED.value in kinds
        frozen = info.snapshot is not None
        if records is not None:
            rows.append(
                rollout_row(
                    rollout_id=info.rollout_id,
                    created_at=info.created_at,
                    incomplete=incomplete,
                    rollout_diagnostic_kinds=kinds,
                    records=records,
                    metadata=metadata,
                    now=now,
                    frozen=frozen,
                )
            )
            continue
        assert info.num_chains is not None
        rows.append(
            kept_rollout_row(
                rollout_id=info.rollout_id,
                created_at=info.created_at,
                incomplete=incomplete,
                rollout_diagnostic_kinds=kinds,
                num_calls=info.num_calls,
                num_chains=info.num_chains,
                num_failed=info.num_failed,
                num_incomplete=info.num_incomplete,
                refused_links=info.num_refused,
                call_diagnostic_kinds=info.call_diagnostic_kinds,
                metadata=metadata,
                now=now,
                frozen=frozen,
            )
        )
    return rows


async def rollouts_page(request: web.Request) -> web.Response:
    """``?status=complete|incomplete|failed&kind=<diagnostic kind>&after=<rollout id>``."""
    status = request.query.get("status") or None
    kind = request.query.get("kind") or None
    after = request.query.get("after") or None
    problems = []
    if status is not None and status not in STATUSES:
        problems.append(f"unknown status {status!r}")
    if after is not None:
        try:
            validate_rollout_id(after)
        except InvalidRolloutId as exc:
            problems.append(f"after: {exc}")
    if problems:
        return await _page(
            request, "error.html", 400, title="Bad request", message="; ".join(problems)
        )
    store = request.app[STORE_KEY]
    found: list[RolloutRow] = []
    cursor, scanned, now = after, 0, time.time()
    while True:
        infos = await store.list_rollouts(limit=LISTING_PAGE_SIZE, after=cursor)
        # The calls only of a rollout whose counts the store does not keep (``_needs_calls``).
        batch = [
            (
                i,
                _rollout_diag_kinds(request, i),
                await store.get_rollout_calls(i.rollout_id) if _needs_calls(i) else None,
            )
            for i in infos
        ]
        for row in await _off_loop(request, _rows, batch, now):
            cursor, scanned = row.rollout_id, scanned + 1
            if matches(row, status=status, kind=kind):
                found.append(row)
                if len(found) == LISTING_PAGE_SIZE:
                    break
        if len(found) == LISTING_PAGE_SIZE or scanned >= LISTING_MAX_SCAN:
            next_after = cursor  # more may follow
            break
        if len(infos) < LISTING_PAGE_SIZE:
            next_after = None
            break
    return await _page(
        request,
        "rollouts.html",
        rows=found,
        status=status,
        kind=kind,
        after=after,
        next_after=next_after,
        statuses=STATUSES,
        kinds=KINDS,
        scanned=scanned,
    )


def _rollout_model(rollout_id: str, records: list[CallRecord]) -> dict[str, Any]:
    tree = build_call_tree(rollout_id, records)
    chains = build_chains(rollout_id, records)
    stats = link_stats(records, chains)
    lineage = find_lineage(chains)
    episode = episode_rows(records, chains, lineage) if lineage else []
    versions = tokens_by_version(records)
    return {"tree": tree, "stats": stats, "episode": episode, "weight_versions": versions}


async def rollout_page(request: web.Request) -> web.Response:
    try:
        rollout_id = validate_rollout_id(request.match_info["rollout_id"])
    except InvalidRolloutId as exc:
        return await _page(request, "error.html", 400, title="Bad request", message=str(exc))
    store = request.app[STORE_KEY]
    info = await store.get_rollout(rollout_id)
    if info is None:
        return await _not_found(request, f"rollout {rollout_id} not found")
    records = await store.get_rollout_calls(rollout_id)
    model = await _off_loop(request, _rollout_model, rollout_id, records)
    row = (
        await _off_loop(
            request, _rows, [(info, _rollout_diag_kinds(request, info), records)], time.time()
        )
    )[0]
    return await _page(request, "rollout.html", info=info, row=row, **model)


async def call_page(request: web.Request) -> web.Response:
    """``?page=N``: 1-based page of the call's sequence (default: where its new tokens
    begin)."""
    call_id = request.match_info["call_id"]
    raw = request.query.get("page", "")
    page = int(raw) if raw.isascii() and raw.isdigit() else None
    store = request.app[STORE_KEY]
    record = await store.get_call(call_id)
    if record is None:
        return await _not_found(request, f"call {call_id} not found")
    records = await store.get_rollout_calls(record.rollout_id)
    plan = await _off_loop(request, plan_call, record, records, page)
    viewer = request.app[VIEWER_KEY]
    texts = await viewer.detokenizer.texts(plan.token_ids())
    view = await _off_loop(request, call_view, plan, texts)
    return await _page(
        request,
        "call.html",
        view=view,
        record=record,
        text_source=viewer.detokenizer.source if texts else NoDetokenizer.source,
        bucket_bounds=tokens.BUCKET_BOUNDS,
        special=_special,
    )


def _safe_next(value: str | None) -> str:
    """Only a page of the viewer (no open redirect)."""
    if value and value.startswith(UI_PREFIX + "/") and "//" not in value and "\\" not in value:
        return value
    return UI_PREFIX + "/"


async def login_page(request: web.Request) -> web.Response:
    viewer = request.app[VIEWER_KEY]
    expected = viewer.config.captures_token
    if request.method == "POST":
        form = await request.post()
        target = _safe_next(str(form.get("next") or ""))
        if expected is None:
            return see_other(target)
        if token_matches(str(form.get("token") or ""), expected):
            response = see_other(target)
            set_viewer_cookie(response, expected)
            return response
        return await _page(request, "login.html", 401, next=target, failed=True)
    target = _safe_next(request.query.get("next"))
    if expected is None:
        return see_other(target)
    return await _page(request, "login.html", next=target, failed="failed" in request.query)


def _detokenizer_ctx(viewer: Viewer) -> Callable[[web.Application], Any]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        config = viewer.config
        session = None
        if config.tokenizer is not None:
            viewer.detokenizer = LocalDetokenizer(config.tokenizer)  # loaded on first use
        elif config.backend is not None:
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=10.0),
                connector=aiohttp.TCPConnector(limit=16),
            )
            viewer.detokenizer = EngineDetokenizer(session, config.backend)
        try:
            yield
        finally:
            if session is not None:
                await session.close()

    return ctx


def add_viewer_routes(app: web.Application, config: ViewerConfig) -> None:
    """The viewer's routes (add them before any catch-all ``/captures`` route); needs the read
    API's store, recorder and REST thread (``rest.add_routes``)."""
    viewer = Viewer(config, _environment(), NoDetokenizer())
    app[VIEWER_KEY] = viewer
    app.cleanup_ctx.append(_detokenizer_ctx(viewer))
    app.router.add_get(UI_PREFIX, _redirect_root)
    app.router.add_get(UI_PREFIX + "/", rollouts_page)
    app.router.add_route("*", UI_PREFIX + "/login", login_page)
    app.router.add_get(UI_PREFIX + "/rollouts/{rollout_id}", rollout_page)
    app.router.add_get(UI_PREFIX + "/calls/{call_id}", call_page)
    # A call's images for its page (the viewer cookie opens only /captures/ui paths).
    app.router.add_get(UI_PREFIX + "/images/{sha256}", get_image)
    app.router.add_get(UI_PREFIX + "/static/{name}", static_files(STATIC_DIR))


def static_files(directory: Path) -> Callable[[web.Request], Any]:
    """``GET /captures/ui/static/<name>``: one of the files of ``directory`` (listed once, at
    start-up); any other name is a 404, never a file-system lookup (a name too long for the
    file system was a 500 under aiohttp's static route)."""
    files = {p.name: p for p in directory.iterdir() if p.is_file()}

    async def serve(request: web.Request) -> web.StreamResponse:
        path = files.get(request.match_info["name"])
        if path is None:
            raise NotFound(f"no such viewer file: {request.match_info['name'][:64]}")
        return web.FileResponse(path)

    return serve


async def _redirect_root(request: web.Request) -> web.Response:
    return see_other(UI_PREFIX + "/")
