"""``capture-proxy replay``: a recorded harness session through a proxy, then its chains.

Owns the command: read the recording (``harnesses.recorded``), send its calls to a running
proxy (``--proxy``) or to an in-process proxy in front of a scripted engine that answers what
the recording answered, and print what was captured. Must not: change the recording's requests.

What stops it is a ``CommandError`` (one line, no traceback): before anything is sent, a
recording that cannot be read, a ``--rollout`` the proxy would refuse (``core.routing``'s rule)
or a ``--proxy`` that is not an http(s) URL (exit 2); then a proxy that cannot be reached (2),
or one that fails or answers its read API with an error (1). Requests the proxy answered with
an error are counted and the first one's error printed; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from capture_proxy.app import build_proxy_app
from capture_proxy.cli.demo import print_chains, serve_app
from capture_proxy.cli.errors import CommandError
from capture_proxy.config import Settings
from capture_proxy.core.routing import InvalidRolloutId, validate_rollout_id
from capture_proxy.harnesses.recorded import (
    RecordedRequest,
    ReplayedCall,
    error_summary,
    load_recording,
    replay,
    replay_engine_config,
)
from capture_proxy.scripted_engine.app import build_scripted_engine_app
from capture_proxy.store.sqlite import SQLiteStore


async def _read_json(http: aiohttp.ClientSession, proxy_url: str, path: str) -> Any:
    """The JSON a read API ``path`` answers. Raises CommandError (exit 1) naming the path on
    any other answer: an error (a rollout that holds no call, a captures token required), or
    a body that is not JSON."""
    async with http.get(f"{proxy_url}{path}") as resp:
        raw = await resp.read()
        if resp.status == 200:
            try:
                return await resp.json(content_type=None)
            except ValueError:
                pass
    raise CommandError(f"GET {path} answered {resp.status} {error_summary(raw)}", exit_code=1)


async def _print_rollout(proxy_url: str, rollout_id: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        summary = await _read_json(http, proxy_url, f"/captures/rollouts/{rollout_id}")
        chains = await _read_json(http, proxy_url, f"/captures/rollouts/{rollout_id}/chains")
    try:
        print_chains(chains, summary)
        print(f"  linking: {summary['linking']}")
    except (KeyError, TypeError) as exc:  # a server that is not the proxy answered
        raise CommandError(
            f"{proxy_url} answered rollout {rollout_id} with no rollout summary and chains "
            f"(missing {exc}): is it a capture-proxy?",
            exit_code=1,
        ) from exc
    return dict(chains)


def _report_failed(calls: list[ReplayedCall]) -> None:
    """One stderr line for the requests not answered 200: how many, and the first's error."""
    failed = [c for c in calls if c.status != 200]
    if failed:
        first = failed[0]
        print(
            f"capture-proxy replay: {len(failed)} of {len(calls)} requests were not answered "
            f"200; the first (seq {first.seq}): {first.status} {first.error}",
            file=sys.stderr,
        )


def _checked_rollout_id(rollout_id: str | None) -> str:
    """``--rollout``, or ``replay-<unix time>``. Raises CommandError for an id the proxy
    refuses (its path would be a 400, or normalised by the client into another path)."""
    if rollout_id is None:
        return f"replay-{int(time.time())}"
    try:
        return validate_rollout_id(rollout_id)
    except InvalidRolloutId as exc:
        raise CommandError(
            f"--rollout {rollout_id!r} is not a rollout id the proxy accepts: {exc}"
        ) from exc


def _checked_proxy_url(proxy_url: str) -> str:
    """``--proxy`` without a trailing slash. Raises CommandError unless an http(s) URL."""
    parts = urlsplit(proxy_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CommandError(f"--proxy {proxy_url!r} is not an http:// or https:// URL")
    return proxy_url.rstrip("/")


async def _replay_to_proxy(
    recording: list[RecordedRequest], proxy_url: str, rollout_id: str
) -> int:
    """Replay to a running proxy; 0 when every request was answered 200. Raises CommandError:
    the proxy cannot be reached (2), fails mid-way or answers a read with an error (1)."""
    base = f"{proxy_url}/ng-rollout/{rollout_id}/training-token-capture/v1"
    try:
        calls = await replay(recording, base)
        print(f"replayed {len(calls)} requests: {[c.status for c in calls]}")
        _report_failed(calls)
        await _print_rollout(proxy_url, rollout_id)
    except aiohttp.ClientConnectorError as exc:
        reason = exc.os_error.strerror or exc.os_error
        raise CommandError(f"cannot reach the proxy at {proxy_url}: {reason}") from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        raise CommandError(f"the proxy at {proxy_url} failed: {reason}", exit_code=1) from exc
    return 0 if all(c.status == 200 for c in calls) else 1


async def run_replay(
    recording_path: Path,
    *,
    proxy_url: str | None = None,
    rollout_id: str | None = None,
    template: str = "keep_reasoning",
    parent_resolution: str = "captured_tokens",
    store_dir: Path | None = None,
) -> int:
    """Replay a recording (see ``harnesses.recorded``) and print the captured chains; 0 when
    every request was answered 200, else 1. Raises CommandError (see the module docstring)."""
    rollout_id = _checked_rollout_id(rollout_id)
    if proxy_url is not None:
        proxy_url = _checked_proxy_url(proxy_url)
    try:
        recording = load_recording(recording_path)
    except (OSError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    if not recording:
        raise CommandError(f"{recording_path} holds no recorded requests")
    if proxy_url is not None:
        return await _replay_to_proxy(recording, proxy_url, rollout_id)
    with tempfile.TemporaryDirectory(prefix="capture-proxy-replay-") as tmp:
        store = store_dir or Path(tmp) / "store"
        config = replay_engine_config(recording, tokenizer_template=template)
        engine = await serve_app(build_scripted_engine_app(config))
        settings = Settings.model_validate(
            {"backend": engine.url, "store": store, "parent_resolution": parent_resolution}
        )
        proxy = await serve_app(build_proxy_app(settings, SQLiteStore(store)))
        try:
            base = f"{proxy.url}/ng-rollout/{rollout_id}/training-token-capture/v1"
            calls = await replay(recording, base)
            print(f"replayed {len(calls)} requests of {recording_path.name} ({template})")
            for call in calls:
                print(f"  seq {call.seq}: {call.status} {call.call_id} {call.classification}")
            _report_failed(calls)
            await _print_rollout(proxy.url, rollout_id)
            return 0 if all(c.status == 200 for c in calls) else 1
        finally:
            await proxy.runner.cleanup()
            await engine.runner.cleanup()


def run(args: argparse.Namespace) -> int:
    """``capture-proxy replay``: 0 when every replayed request was answered 200."""
    return asyncio.run(
        run_replay(
            args.recording,
            proxy_url=args.proxy,
            rollout_id=args.rollout,
            template=args.template,
            parent_resolution=args.parent_resolution,
            store_dir=args.store,
        )
    )
