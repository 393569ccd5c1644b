"""The trainer's hand-off over REST: freeze, metadata, retire (DESIGN.md, "Rollout lifecycle").

Owns the HTTP shapes of the lifecycle; the steps themselves are the store's (atomic, durable,
idempotent: ``store.base``), the validation of metadata is the core's (``core.metadata``).

    POST /captures/rollouts/<id>/freeze    -> {rollout_id, snapshot_id, version, num_calls,
                                               frozen_at, cursor}
    PUT  /captures/rollouts/<id>/metadata  {reward, task_id, tags}
                                           -> {rollout_id, version, metadata}
    POST /captures/rollouts/<id>/retire    {snapshot_id, version}
                                           -> {rollout_id, snapshot_id, version, deleted_calls,
                                               retired_at}

Errors: 400 naming the field (bad JSON body, metadata, snapshot id or version), 404 for a
rollout nothing is known of, 409 for a state that refuses the step (``rollout_deleted``,
``rollout_not_frozen``, ``snapshot_mismatch`` with ``param`` naming the identifier that does
not match), 503 ``store_unavailable`` for a freeze of a rollout whose lost calls cannot be
marked yet.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from capture_proxy.core.json_bodies import MAX_NESTING, text_problem
from capture_proxy.core.metadata import MetadataError, RolloutMetadata
from capture_proxy.proxy.errors import (
    BadRequest,
    Conflict,
    NotFound,
    ProxyError,
    ServiceUnavailable,
)
from capture_proxy.proxy.keys import LINKER_KEY, RECORDER_KEY, STORE_KEY
from capture_proxy.proxy.traffic_tap import remove_recording
from capture_proxy.rest.query import takes
from capture_proxy.rest.reads import _rollout_id
from capture_proxy.store.base import LifecycleConflict, RolloutDeleted, RolloutNotFound

_SNAPSHOT_ID = re.compile(r"[0-9a-f]{32}")


def lifecycle_error(exc: Exception, rollout_id: str) -> ProxyError:
    """The client error for a store's lifecycle exception (others are re-raised as is)."""
    if isinstance(exc, RolloutNotFound):
        return NotFound(f"rollout {rollout_id} not found", param="rollout_id", code="not_found")
    if isinstance(exc, RolloutDeleted):
        return Conflict(
            f"rollout {rollout_id} was deleted or retired (its tombstone lasts "
            "tombstone_retention_s)",
            param="rollout_id",
            code="rollout_deleted",
        )
    if isinstance(exc, LifecycleConflict):
        return Conflict(str(exc), param=exc.field, code=exc.code)
    raise exc


async def _json_body(request: web.Request) -> Any:
    """The body as JSON, checked by the fronts' own text check (``text_problem``: no lone
    surrogate, no nesting past ``MAX_NESTING``). Raises BadRequest naming the field."""
    raw = await request.read()
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(
            f"body: not valid JSON ({exc})", param="body", code="invalid_json"
        ) from exc
    except RecursionError as exc:
        raise BadRequest(
            f"body: nests past {MAX_NESTING} levels", param="body", code="invalid_json"
        ) from exc
    problem = text_problem(value)
    if problem is not None:
        raise BadRequest(str(problem), param=problem.param, code="invalid_text")
    return value


async def freeze_rollout(request: web.Request) -> web.Response:
    """Freeze a rollout: later calls are late (or refused, ``late_calls = refuse``). A repeat
    answers the same snapshot. A rollout whose first call is still in flight is frozen empty.
    A rollout with calls answered but not stored whose loss the store has not taken yet
    (``proxy.losses``) is marked first; while it cannot be, the freeze is a 503: its snapshot
    would read as complete."""
    rollout_id = _rollout_id(request)
    linker = request.app[LINKER_KEY]
    if not await request.app[RECORDER_KEY].losses.mark(rollout_id):
        raise ServiceUnavailable(
            f"rollout {rollout_id} has calls answered but not stored, and the store does not "
            "yet take the mark that says so (store_failed); freeze it once writes succeed",
            param="rollout_id",
            code="store_unavailable",
        )
    try:
        snap = await request.app[STORE_KEY].freeze_rollout(
            rollout_id, known_elsewhere=linker.has_calls(rollout_id)
        )
    except (RolloutNotFound, RolloutDeleted) as exc:
        raise lifecycle_error(exc, rollout_id) from exc
    return web.json_response({"rollout_id": rollout_id, **snap.to_json()})


async def put_metadata(request: web.Request) -> web.Response:
    """Replace the rollout's metadata (reward, task_id, tags; see ``core.metadata``)."""
    rollout_id = _rollout_id(request)
    try:
        metadata = RolloutMetadata.from_json(await _json_body(request))
    except MetadataError as exc:
        raise BadRequest(str(exc), param=exc.field, code="invalid_metadata") from exc
    try:
        version = await request.app[STORE_KEY].set_metadata(rollout_id, metadata)
    except (RolloutNotFound, RolloutDeleted) as exc:
        raise lifecycle_error(exc, rollout_id) from exc
    return web.json_response(
        {"rollout_id": rollout_id, "version": version, "metadata": metadata.to_json()}
    )


def _retire_identifiers(body: Any) -> tuple[str, int]:
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object with snapshot_id and version", param="body")
    snapshot_id = body.get("snapshot_id")
    if not isinstance(snapshot_id, str) or not _SNAPSHOT_ID.fullmatch(snapshot_id):
        raise BadRequest(
            "snapshot_id: must be the 32 hex digits the freeze answered",
            param="snapshot_id",
            code="invalid_snapshot_id",
        )
    version = body.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise BadRequest(
            "version: must be the integer the freeze or the export answered",
            param="version",
            code="invalid_version",
        )
    return snapshot_id, version


async def retire_rollout(request: web.Request) -> web.Response:
    """Retire a frozen rollout with the snapshot id and version read: its calls are deleted, a
    tombstone keeps the identifiers (a retry answers the same), late calls are refused."""
    rollout_id = _rollout_id(request)
    snapshot_id, version = _retire_identifiers(await _json_body(request))
    try:
        done = await request.app[STORE_KEY].retire_rollout(rollout_id, snapshot_id, version)
    except (RolloutNotFound, LifecycleConflict) as exc:
        raise lifecycle_error(exc, rollout_id) from exc
    request.app[LINKER_KEY].forget(rollout_id)
    remove_recording(request.app, rollout_id)
    return web.json_response(done.to_json())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/captures/rollouts/{rollout_id}/freeze", takes()(freeze_rollout))
    app.router.add_put("/captures/rollouts/{rollout_id}/metadata", takes()(put_metadata))
    app.router.add_post("/captures/rollouts/{rollout_id}/retire", takes()(retire_rollout))
