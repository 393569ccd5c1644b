"""Record a real Codex CLI or Claude Code session THROUGH the proxy, as a replay fixture.

    .venv/bin/python -m tests.support.record_proxy_fixtures codex \\
        tests/fixtures/codex/02_through_proxy.jsonl
    .venv/bin/python -m tests.support.record_proxy_fixtures claude_code \\
        tests/fixtures/claude_code/02_through_proxy.jsonl

The stack of the e2e tests (``tests/e2e/harness_stack.py``: scripted engine with the harness's
policy, a real proxy in backend-template mode, the harness's dummy key as the proxy token) with
``record_dir`` set (``serve --record-dir``); the harness runs the e2e task once. The proxy's
recording (the replay format, credentials already ``<redacted>``) is scrubbed like the fake-server
fixtures: the scratch project path -> ``/workspace/project``, the scratch home ->
``/workspace/home``, the scratch root -> ``/workspace``, the proxy port -> 18080
(``Content-Length`` recomputed, original kept).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from capture_proxy.families.qwen_vocab import load_qwen_tokenizer
from capture_proxy.harnesses import claude_code, codex
from capture_proxy.scripted_engine.policy import Policy
from tests.e2e.harness_stack import POLICIES, harness_stack, make_project, run_harness
from tests.support.fake_harness_server import scrub_line

ROLLOUT = {"codex": "rec-codex", "claude_code": "rec-claude-code"}
TASK = {
    "codex": "List the files, show notes.txt and mark its TODO as done.",
    "claude_code": "List the files, read notes.txt and mark its TODO as done.",
}


async def record(harness: str, out: Path, timeout_s: float) -> int:
    tokenizer = load_qwen_tokenizer()
    policy = Policy.load(POLICIES / f"{harness}.json")
    with tempfile.TemporaryDirectory(prefix="proxy-rec-") as tmp:
        root = Path(tmp).resolve()
        record_dir = root / "rec"
        key = codex.API_KEY if harness == "codex" else claude_code.API_KEY
        async with harness_stack(
            tokenizer,
            root,
            policy=policy,
            prompt_mode="backend_template",
            proxy_token=key,
            record_dir=record_dir,
        ) as stack:
            project = make_project(root)
            base = stack.capture_root(ROLLOUT[harness])
            if harness == "codex":
                binary = codex.find_codex()
                assert binary is not None, "codex not installed (scripts/install-harnesses)"
                result = await run_harness(
                    codex.run_codex,
                    binary,
                    base + "/v1",
                    project,
                    TASK[harness],
                    timeout_s=timeout_s,
                    home_dir=root / "home",
                )
            else:
                binary = claude_code.find_claude()
                assert binary is not None, "claude not installed (scripts/install-harnesses)"
                result = await run_harness(
                    claude_code.run_claude,
                    binary,
                    base,
                    project,
                    TASK[harness],
                    timeout_s=timeout_s,
                    home_dir=root / "home",
                )
            port = stack.proxy_port
        print(result.describe(), file=sys.stderr)
        replacements = [
            (str(project), "/workspace/project"),
            (str(root / "home"), "/workspace/home"),
            (str(root), "/workspace"),
            (f"127.0.0.1:{port}", "127.0.0.1:18080"),
        ]
        raw = (record_dir / f"{ROLLOUT[harness]}.jsonl").read_text(encoding="utf-8")
        lines = [scrub_line(json.loads(x), replacements) for x in raw.splitlines() if x]
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        for line in lines:
            print(
                line["seq"], line["path"], line["classification"], line["status"], file=sys.stderr
            )
    return 0 if result.ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("harness", choices=sorted(ROLLOUT))
    parser.add_argument("out", type=Path)
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args()
    return asyncio.run(record(args.harness, args.out, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
