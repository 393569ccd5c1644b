"""The stack the Codex, Claude Code and OpenCode sessions e2e tests (and the fixture recorder)
run a harness against.

The scripted engine (vLLM dialect, real Qwen tokenizer, a policy from
``capture_proxy/policies/``) and a real proxy server in front of it, both on loopback ports
(the harness is an external process), a temporary SQLite store; optionally ``record_dir``
(``serve --record-dir``) and ``proxy_token`` (the harness's own dummy key, so that its
``Authorization: Bearer`` / ``x-api-key`` header is really checked). Also the checks both
harness modules share: the REST reads, the engine call behind each stored call, and
token-exactness of every link.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.harnesses import claude_code, codex, opencode
from capture_proxy.scripted_engine.app import build_scripted_engine_app
from capture_proxy.scripted_engine.policy import Policy
from capture_proxy.scripted_engine.state import SENT_CALLS, ScriptedEngineConfig, SentCall
from capture_proxy.store.sqlite import SQLiteStore

POLICIES = Path(__file__).resolve().parents[2] / "capture_proxy" / "policies"
PROMPT_MODES = ["backend_template", "exact_tokens"]
#: the scripted engine's context length (``ScriptedEngineConfig.max_model_len``)
MAX_MODEL_LEN = 32768
NOTES_LINES = ["TODO: count the files", "alpha é ✓", "  indented beta"]
NOTES_TEXT = "\n".join(NOTES_LINES) + "\n"
DONE_TEXT = NOTES_TEXT.replace("TODO: count the files", "DONE: counted the files")
REST_TIMEOUT_S = 30


@dataclass
class HarnessStack:
    """Engine + proxy on loopback; ``root`` is the proxy's ``http://127.0.0.1:PORT``."""

    root: str
    proxy_port: int
    session: aiohttp.ClientSession
    sent: list[SentCall]  # what the engine answered, in arrival order
    prompt_mode: str

    def capture_root(self, rollout: str) -> str:
        """``http://127.0.0.1:PORT/ng-rollout/<rollout>/training-token-capture``."""
        return f"{self.root}/ng-rollout/{rollout}/training-token-capture"

    async def get(self, path: str) -> Any:
        async with self.session.get(self.root + path) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port: int = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


@contextlib.asynccontextmanager
async def harness_stack(
    tokenizer: Any,
    tmp_path: Path,
    *,
    policy: Policy,
    prompt_mode: str,
    proxy_token: str | None = None,
    record_dir: Path | None = None,
    settings: dict[str, Any] | None = None,
) -> AsyncIterator[HarnessStack]:
    """``settings``: more proxy settings (e.g. ``image_processors``)."""
    # serving the model name the harnesses are configured with (the engine refuses others)
    served = ScriptedEngineConfig(
        policy=policy,
        max_model_len=MAX_MODEL_LEN,
        model_name=codex.MODEL_ID,
        model_aliases=tuple(sorted({claude_code.MODEL_ID, opencode.MODEL_ID} - {codex.MODEL_ID})),
    )
    engine_app = build_scripted_engine_app(served, tokenizer)
    engine, engine_port = await _serve(engine_app)
    try:
        config = Settings.model_validate(
            {
                "backend": f"http://127.0.0.1:{engine_port}",
                "store": tmp_path / "store",
                "prompt_mode": prompt_mode,
                "proxy_token": proxy_token,
                "record_dir": record_dir,
                **(settings or {}),
            }
        )
        proxy, port = await _serve(build_proxy_app(config, SQLiteStore(tmp_path / "store")))
        try:
            timeout = aiohttp.ClientTimeout(total=REST_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                yield HarnessStack(
                    f"http://127.0.0.1:{port}", port, session, engine_app[SENT_CALLS], prompt_mode
                )
        finally:
            await proxy.cleanup()
    finally:
        await engine.cleanup()


async def run_harness(fn: Any, *args: Any, timeout_s: float, **kw: Any) -> Any:
    """A blocking driver (``run_codex`` / ``run_claude``) in a thread, bounded twice: the
    driver kills the harness's process group after ``timeout_s``, the wait gives up 20 s
    later."""
    return await asyncio.wait_for(
        asyncio.to_thread(fn, *args, timeout_s=timeout_s, **kw), timeout=timeout_s + 20
    )


def make_project(tmp_path: Path) -> Path:
    """The scratch project: ``notes.txt`` only (what ``ls`` must list)."""
    project = (tmp_path / "project").resolve()
    project.mkdir()
    (project / "notes.txt").write_text(NOTES_TEXT, encoding="utf-8")
    return project


def full(call: dict[str, Any]) -> list[int]:
    return call["prompt_token_ids"] + call["generation_token_ids"]


def extends(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    """The child's prompt begins with the parent's prompt + generation ids."""
    head = full(parent)
    return (
        len(child["prompt_token_ids"]) > len(head)
        and child["prompt_token_ids"][: len(head)] == head
    )


def sent_for(sent: list[SentCall], prompt_ids: list[int]) -> SentCall:
    matches = [s for s in sent if s.prompt_token_ids == prompt_ids]
    assert len(matches) == 1, f"{len(matches)} engine calls have this call's prompt ids"
    return matches[0]


def check_engine_calls(stack: HarnessStack, calls: list[dict[str, Any]]) -> None:
    """Each stored call is exactly one engine call over its prompt mode's endpoint, holding
    exactly what the engine sampled; in exact-token mode the engine got token ids, exactly
    the stored prompt ids."""
    assert len(stack.sent) == len(calls), [len(s.prompt_token_ids) for s in stack.sent]
    for call in calls:
        s = sent_for(stack.sent, call["prompt_token_ids"])
        assert call["generation_token_ids"] == s.generation_token_ids, call["call_id"]
        assert call["generation_log_probs"] == pytest.approx(s.generation_log_probs)
        body = s.request_body
        if stack.prompt_mode == "backend_template":
            assert "messages" in body and "prompt" not in body, call["call_id"]
        else:
            assert "messages" not in body, call["call_id"]
            assert body["prompt"] == call["prompt_token_ids"], call["call_id"]


def tool_messages(detail: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in detail["request_messages"] if m["role"] == "tool"]


def new_tool_results(detail: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool messages of ``detail``'s request that ``previous``'s request did not hold."""
    return tool_messages(detail)[len(tool_messages(previous)) :]
