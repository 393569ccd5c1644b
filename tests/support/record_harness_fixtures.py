"""Record a real Codex CLI or Claude Code session against the fake server, as a fixture.

    .venv/bin/python -m tests.support.record_harness_fixtures codex OUT.jsonl
    .venv/bin/python -m tests.support.record_harness_fixtures claude_code OUT.jsonl

Runs the scripted tool session of ``fake_harness_server`` (``codex_tool_session`` /
``claude_tool_session``) in a scratch project holding ``notes.txt``, then writes every request
with the scratch project path replaced by ``/workspace/project``, the scratch home by
``/workspace/home`` (Content-Length recomputed). Options probe the harness: ``--omit EVENT``
(repeatable), ``--fail-first N --fail-status S``, ``--model NAME``, ``--timeout S``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from capture_proxy.harnesses._process import HarnessResult
from capture_proxy.harnesses.claude_code import find_claude, run_claude
from capture_proxy.harnesses.codex import find_codex, run_codex
from tests.support.fake_harness_server import (
    NOTES_TEXT,
    FakeServerConfig,
    claude_tool_session,
    codex_tool_session,
    running,
)

PROJECT_PLACEHOLDER = "/workspace/project"
HOME_PLACEHOLDER = "/workspace/home"
CODEX_TASK = "List the files, mark the TODO in notes.txt as done, then show notes.txt."
CLAUDE_TASK = "List the files, read notes.txt and mark its TODO as done."


async def record(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="harness-rec-") as tmp:
        root = Path(tmp).resolve()
        project, home = root / "project", root / "home"
        project.mkdir()
        (project / "notes.txt").write_text(NOTES_TEXT, encoding="utf-8")
        config = FakeServerConfig(
            codex_steps=codex_tool_session(),
            claude_steps=claude_tool_session(project),
            omit_events=frozenset(args.omit),
            fail_first=args.fail_first,
            fail_status=args.fail_status,
        )
        async with running(config) as server:
            result: HarnessResult
            if args.harness == "codex":
                binary = find_codex()
                assert binary is not None, "codex not installed (scripts/install-harnesses)"
                result = await asyncio.to_thread(
                    run_codex,
                    binary,
                    server.root_url + "/v1",
                    project,
                    CODEX_TASK,
                    model=args.model or "fake-model",
                    timeout_s=args.timeout,
                    home_dir=home,
                )
            else:
                binary = find_claude()
                assert binary is not None, "claude not installed (scripts/install-harnesses)"
                result = await asyncio.to_thread(
                    run_claude,
                    binary,
                    server.root_url,
                    project,
                    CLAUDE_TASK,
                    model=args.model or "fake-model",
                    timeout_s=args.timeout,
                    home_dir=home,
                )
            replacements = [
                (str(project), PROJECT_PLACEHOLDER),
                (str(home), HOME_PLACEHOLDER),
                (f"127.0.0.1:{server.port}", "127.0.0.1:18080"),
            ]
            server.write_jsonl(Path(args.out), replacements)
            print(result.describe(), file=sys.stderr)
            for line in server.lines():
                print(
                    line["seq"],
                    line["method"],
                    line["path"],
                    line["query"],
                    line["classification"],
                    line["status"],
                    len(line["body_raw"]),
                    file=sys.stderr,
                )
            print(
                "notes.txt now:",
                (project / "notes.txt").read_text(encoding="utf-8"),
                file=sys.stderr,
            )
        return 0 if result.ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("harness", choices=["codex", "claude_code"])
    parser.add_argument("out")
    parser.add_argument("--omit", action="append", default=[])
    parser.add_argument("--fail-first", type=int, default=0)
    parser.add_argument("--fail-status", type=int, default=500)
    parser.add_argument("--model", default=None)
    parser.add_argument("--timeout", type=float, default=120)
    return asyncio.run(record(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
