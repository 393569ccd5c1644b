"""``capture-proxy demo``: the main job end to end on one machine, in one command.

Starts the scripted engine and the proxy on free loopback ports, drives a short multi-step
session through the proxy (the real OpenCode CLI when installed, else a built-in scripted
client that behaves like a harness), then reads the captured chains back over REST and prints
them. The store is the embedded default, so the captured rollout stays readable afterwards
with ``capture-proxy serve --store <dir>``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from capture_proxy.app import build_proxy_app
from capture_proxy.cli.engine import load_policy
from capture_proxy.config import Settings
from capture_proxy.harnesses.opencode import MODEL_ID as OPENCODE_MODEL_ID
from capture_proxy.harnesses.opencode import find_opencode, run_opencode
from capture_proxy.scripted_engine.app import ScriptedEngineConfig, build_scripted_engine_app
from capture_proxy.scripted_engine.policy import Policy
from capture_proxy.store.sqlite import SQLiteStore

OPENCODE_POLICY = Path(__file__).resolve().parents[1] / "policies" / "opencode.json"
DEMO_TIMEOUT_S = 240

DEMO_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(props)},
        },
    }
    for name, description, props in [
        ("bash", "Run a shell command", {"command": {"type": "string"}}),
        ("read", "Read a file", {"filePath": {"type": "string"}}),
    ]
]


@dataclass
class Running:
    """An app served on a free loopback port: its runner (``cleanup()`` stops it) and URL."""

    runner: web.AppRunner
    url: str


async def serve_app(app: web.Application) -> Running:
    """Serve ``app`` on a free port of 127.0.0.1 until ``cleanup()``."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert runner.addresses
    port = runner.addresses[0][1]
    return Running(runner, f"http://127.0.0.1:{port}")


async def _scripted_client_session(base_url: str) -> None:
    """A harness-like client: title request, then agent steps until a text answer."""
    url = base_url + "/chat/completions"
    task = "List the files and read the README, then summarise."
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        title = {
            "model": "scripted-qwen",
            "stream": True,
            "messages": [
                {"role": "system", "content": "You are a title generator."},
                {"role": "user", "content": task},
            ],
        }
        async with http.post(url, json=title) as resp:
            await resp.read()
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": task},
        ]
        for step in range(8):
            body = {"model": "scripted-qwen", "messages": messages, "tools": DEMO_TOOLS}
            async with http.post(url, json=body) as resp:
                resp.raise_for_status()
                message = (await resp.json())["choices"][0]["message"]
            tool_calls = message.get("tool_calls") or []
            echoed: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("reasoning_content"):
                echoed["reasoning_content"] = message["reasoning_content"]
            if tool_calls:
                echoed["tool_calls"] = tool_calls
            messages.append(echoed)
            if not tool_calls:
                return
            for tc in tool_calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": tc["id"],
                        "content": f"(demo output of {tc['function']['name']}, step {step})",
                    }
                )


def _opencode_session(binary: Path, base_url: str, work_dir: Path) -> str:
    project = work_dir / "project"
    project.mkdir()
    (project / "notes.txt").write_text("capture-proxy demo notes\nline two\n")
    result = run_opencode(
        binary,
        base_url,
        project,
        "Read notes.txt, list the files, then summarise.",
        home_dir=work_dir / "home",
        timeout_s=DEMO_TIMEOUT_S,
    )
    if not result.ok:
        raise RuntimeError(f"OpenCode run failed: {result.describe()}")
    return f"OpenCode {binary} ({result.duration_s:.1f} s)"


def print_chains(chains: dict[str, Any], summary: dict[str, Any]) -> None:
    """A readable view of ``GET /captures/rollouts/<id>/chains``."""
    print(
        f"\nrollout {chains['rollout_id']}: {summary['num_calls']} calls, "
        f"{summary['num_chains']} chains, incomplete={chains['incomplete']}"
    )
    for n, chain in enumerate(chains["chains"], 1):
        print(f"  chain {n} (root {chain['chain_id']}):")
        index: dict[str, int] = {}
        prev_len: dict[str, int] = {}
        for i, call in enumerate(chain["calls"], 1):
            index[call["call_id"]] = i
            prompt = len(call["prompt_token_ids"])
            gen = len(call["generation_token_ids"])
            parent = call["parent_call_id"]
            link = f"child of #{index[parent]}" if parent else "root"
            new = prompt - prev_len[parent] if parent else prompt
            prev_len[call["call_id"]] = prompt + gen
            msg = call.get("response_message") or {}
            tools = [tc["function"]["name"] for tc in msg.get("tool_calls") or []]
            what = f"tools {tools}" if tools else repr((msg.get("content") or "")[:40])
            print(
                f"    #{i} {call['call_id']} {link:<11} prompt {prompt:>5} tok "
                f"(+{new} new)  generation {gen:>3} tok  {call['finish_reason']:<10} {what}"
            )
    for call in chains["unlinked_calls"]:
        print(f"  unlinked {call['call_id']} ({call['status']}): {call['diagnostics']}")


def read_again_hint(store_dir: Path, rollout_id: str) -> str:
    """How to read the demo's store once the demo (and its engine) has stopped: commands
    that need no engine."""
    return (
        "\nRead it again later (no engine needed):\n"
        f"  .venv/bin/capture-proxy show --store {store_dir} {rollout_id}\n"
        f"  .venv/bin/capture-proxy serve --read-only --store {store_dir}\n"
        f"    then GET http://127.0.0.1:8080/captures/rollouts/{rollout_id}/chains, "
        "or open http://127.0.0.1:8080/captures/ui/"
    )


async def run_demo(
    *, store_dir: Path | None, use_opencode: str = "auto", policy_path: Path | None = None
) -> int:
    """Run the demo; returns a process exit code (0: a complete chain was captured)."""
    binary = find_opencode() if use_opencode != "no" else None
    if use_opencode == "yes" and binary is None:
        print("demo: OpenCode is not installed (run scripts/install-opencode)")
        return 1
    if policy_path is not None:
        policy = load_policy(policy_path)  # a CommandError naming the file and problem
    elif binary is not None and OPENCODE_POLICY.exists():
        policy = Policy.load(OPENCODE_POLICY)
    else:
        policy = Policy.default()
    store_dir = store_dir or Path("capture-store")
    rollout_id = f"demo-{int(time.time())}"

    # also serving the model name OpenCode is configured with (the engine refuses others)
    config = ScriptedEngineConfig(policy=policy, model_aliases=(OPENCODE_MODEL_ID,))
    engine = await serve_app(build_scripted_engine_app(config))
    settings = Settings(backend=engine.url, store=store_dir)
    proxy = await serve_app(build_proxy_app(settings, SQLiteStore(store_dir)))
    base_url = f"{proxy.url}/ng-rollout/{rollout_id}/training-token-capture/v1"
    print(f"engine  {engine.url} (scripted, vLLM dialect)")
    print(f"proxy   {proxy.url} -> store {store_dir.resolve()}")
    print(f"harness base_url {base_url}")
    try:
        if binary is not None:
            with tempfile.TemporaryDirectory(prefix="capture-proxy-demo-") as tmp:
                driver = await asyncio.to_thread(_opencode_session, binary, base_url, Path(tmp))
        else:
            await _scripted_client_session(base_url)
            driver = "built-in scripted client (OpenCode not installed)"
        print(f"session driven by {driver}")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async with http.get(f"{proxy.url}/captures/rollouts/{rollout_id}") as resp:
                summary = await resp.json()
            async with http.get(f"{proxy.url}/captures/rollouts/{rollout_id}/chains") as resp:
                chains = await resp.json()
        print_chains(chains, summary)
        print(read_again_hint(store_dir, rollout_id))
        ok = not chains["incomplete"] and any(len(c["calls"]) > 1 for c in chains["chains"])
        return 0 if ok else 1
    finally:
        await proxy.runner.cleanup()
        await engine.runner.cleanup()


def run(args: argparse.Namespace) -> int:
    """``capture-proxy demo``: 0 when a complete chain was captured."""
    return asyncio.run(
        run_demo(store_dir=args.store, use_opencode=args.opencode, policy_path=args.policy)
    )
