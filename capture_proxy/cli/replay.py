"""``capture-proxy replay``: a recorded harness session through a proxy, then its chains.

Owns the command: read the recording (``harnesses.recorded``), send its calls to a running
proxy (``--proxy``) or to an in-process proxy in front of a scripted engine that answers what
the recording answered, and print what was captured. Must not: change the recording's requests.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from capture_proxy.app import build_proxy_app
from capture_proxy.cli.demo import print_chains, serve_app
from capture_proxy.config import Settings
from capture_proxy.harnesses.recorded import load_recording, replay, replay_engine_config
from capture_proxy.scripted_engine.app import build_scripted_engine_app
from capture_proxy.store.sqlite import SQLiteStore


async def _print_rollout(proxy_url: str, rollout_id: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.get(f"{proxy_url}/captures/rollouts/{rollout_id}") as resp:
            summary = await resp.json()
        async with http.get(f"{proxy_url}/captures/rollouts/{rollout_id}/chains") as resp:
            chains = await resp.json()
    print_chains(chains, summary)
    print(f"  linking: {summary['linking']}")
    return chains


async def run_replay(
    recording_path: Path,
    *,
    proxy_url: str | None = None,
    rollout_id: str | None = None,
    template: str = "keep_reasoning",
    parent_resolution: str = "captured_tokens",
    store_dir: Path | None = None,
) -> int:
    """Replay a recording (see ``harnesses.recorded``) and print the captured chains."""
    try:
        recording = load_recording(recording_path)
    except (OSError, ValueError) as exc:
        print(f"replay: {exc}")
        return 2
    if not recording:
        print(f"replay: {recording_path} holds no recorded requests")
        return 2
    rollout_id = rollout_id or f"replay-{int(time.time())}"
    if proxy_url is not None:
        base = f"{proxy_url.rstrip('/')}/ng-rollout/{rollout_id}/training-token-capture/v1"
        calls = await replay(recording, base)
        print(f"replayed {len(calls)} requests: {[c.status for c in calls]}")
        await _print_rollout(proxy_url.rstrip("/"), rollout_id)
        return 0 if all(c.status == 200 for c in calls) else 1
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
