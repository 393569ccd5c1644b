"""docs/quickstart.md's Python, run as written against the proxy and the scripted engine.

The page's ``python`` code blocks run in order in one namespace (a thread: the SDKs block),
with ``PROXY_URL`` naming a proxy on a loopback port in front of the scripted engine (the
page's ``bash`` block starts the same two). Each SDK loop must leave one exact chain: three
calls, each linked to the one before by the assistant message the SDK returned, echoed back
as it was.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.scripted_engine import ScriptedEngineConfig, build_scripted_engine_app
from capture_proxy.store.sqlite import SQLiteStore

PAGE = Path(__file__).resolve().parent.parent / "docs" / "quickstart.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)


async def test_the_quickstart_runs_as_written_and_captures_one_chain_per_loop(
    aiohttp_server, qwen_tokenizer, tmp_path, monkeypatch, capsys
):
    engine = await aiohttp_server(build_scripted_engine_app(ScriptedEngineConfig(), qwen_tokenizer))
    settings = Settings(backend=str(engine.make_url("/")).rstrip("/"), store=tmp_path / "store")
    proxy = await aiohttp_server(build_proxy_app(settings, SQLiteStore(tmp_path / "store")))
    monkeypatch.setenv("PROXY_URL", str(proxy.make_url("")).rstrip("/"))
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) == 5
    namespace: dict = {}
    code = compile("\n".join(blocks), str(PAGE), "exec")
    await asyncio.wait_for(asyncio.to_thread(exec, code, namespace), 120)

    out = capsys.readouterr().out.splitlines()
    assert "Done: I listed the files and read the README." in out  # both loops' answers
    for rollout_id in ["quickstart-openai", "quickstart-anthropic"]:
        calls = [line.split()[1:3] for line in out if line.startswith(rollout_id + " ")]
        assert [verdict for _, verdict in calls] == ["root", "resolved", "resolved"], out
    [sample] = list(namespace["chains"])
    assert int(sample.arrays["loss_mask"].sum()) > 0
    assert len(namespace["messages"]) == 7  # system, user, 3 answers echoed, 2 tool results
    assert len(namespace["conversation"]) == 6  # user, 3 answers, 2 messages of tool results
