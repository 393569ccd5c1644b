"""Long-session benchmark (issue 16 item 5): proxy CPU per call as a coding session grows.

N concurrent rollouts of one long coding session (default 120 turns: a tool call per turn, then
an answer; a system prompt and tool definitions sized like OpenCode's, about 8 KB and 20 KB;
tool outputs sized so that the last prompt is about 57k tokens) through the proxy against the
scripted engine, in both prompt modes, and through the full-render exact-token path (the path
before per-call extension, ``serve --exact-full-render``), all in one run against one engine:

- ``backend_template``: the engine renders the chat template;
- ``exact_tokens``: the proxy extends the parent's ids by the rendering of the new messages;
- ``exact_full_render``: the proxy renders and tokenizes the whole conversation (twice) per call.

Each proxy first serves a short unmeasured session (``--warmup-turns``), so one-off costs do not
count in the first bucket. The rollouts advance in lockstep: at each turn every proxy in turn
serves its N calls while the others idle, so the CPU a proxy process spent over that turn
(``/proc/<pid>/stat``, all threads) divided by N is its CPU per call at that turn. Added
latency: a call's latency as the harness saw it minus the engine's part of it (the call record's
``latency_ms``: from sending the engine request to the end of its answer), so what is left is
the proxy's own work before and after the engine (parsing, linking, rendering, persisting).
Every proxied rollout is checked to be one chain. ``--py-spy MODE`` records that proxy's samples
to a file over the turns (from ``--py-spy-from TURN`` on, to profile a long history alone).

``--template FILE``: the engine and the proxy's tokenizer directory use that chat template (a
published one, e.g. Qwen3's) instead of ours; the report counts the calls rendered whole
(``exact_prompt_full_render``) per mode.

Run: ``.venv/bin/python benchmarks/long_session.py [--rollouts 4] [--turns 120] [--template F]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.services import (  # noqa: E402
    ROOT,
    Service,
    baseline_env,
    cli_command,
    free_port,
    one_process,
    proc_cpu_s,
    raise_fd_limit,
    start_py_spy,
    stop_py_spy,
)
from benchmarks.sessions import pct  # noqa: E402

CAPTURE = "/ng-rollout/{rollout}/training-token-capture/v1/chat/completions"
MODES = ("backend_template", "exact_tokens", "exact_full_render")


def _lines(kb: float, tag: str) -> str:
    out, size, i = [], 0, 0
    while size < kb * 1024:
        line = f"\n{tag} {i}: keep edits small, run the tests after each change ({i * 7 % 101})."
        out.append(line)
        size += len(line)
        i += 1
    return "".join(out)


def tools(total_kb: float) -> list[dict[str, Any]]:
    """Ten tools whose definitions add up to about ``total_kb`` KB (OpenCode: about 20 KB)."""
    names = ["bash", "read", "write", "edit", "glob", "grep", "list", "webfetch", "todo", "task"]
    per = total_kb / len(names)
    return [
        {
            "type": "function",
            "function": {
                "name": n,
                "description": f"The {n} tool." + _lines(per * 0.9, n),
                "parameters": {
                    "type": "object",
                    "properties": {"filePath": {"type": "string", "description": "a path"}},
                },
            },
        }
        for n in names
    ]


def policy(turns: int) -> dict[str, Any]:
    steps = [
        {
            "reasoning": f"Next I read file {i}.",
            "content": "",
            "tool_calls": [{"name": "read", "arguments": {"filePath": f"src/module_{i}.py"}}],
        }
        for i in range(turns - 1)
    ]
    return {"title": "Long session", "steps": steps, "final": "All modules read."}


@dataclass
class Rollout:
    mode: str
    rollout_id: str
    messages: list[dict[str, Any]]
    call_ids: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)


@dataclass
class TurnSample:
    cpu_ms_per_call: float
    added_ms: list[float]


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    t0 = time.perf_counter()
    async with session.post(url, json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {data}")
        return time.perf_counter() - t0, data, resp.headers.get("X-Capture-Call-Id")


def _echo(message: dict[str, Any]) -> dict[str, Any]:
    out = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


async def one_call(
    session: aiohttp.ClientSession,
    proxy_url: str,
    engine_url: str,
    r: Rollout,
    tool_defs: list[dict[str, Any]],
    tool_output_kb: float,
    turn: int,
) -> float:
    body = {"model": "scripted-qwen", "messages": r.messages, "tools": tool_defs}
    latency, data, call_id = await _post(
        session, proxy_url + CAPTURE.format(rollout=r.rollout_id), body
    )
    r.call_ids.append(call_id)
    r.latencies_ms.append(latency * 1000)
    message = data["choices"][0]["message"]
    r.messages.append(_echo(message))
    for tc in message.get("tool_calls") or []:
        out = f"# src/module_{turn}.py" + _lines(tool_output_kb, f"m{turn}")
        r.messages.append({"role": "tool", "tool_call_id": tc["id"], "content": out})
    return latency * 1000


def bucket_of(turn: int, turns: int) -> str | None:
    """1-10, 51-60, 111-120 for 120 turns (first, middle and last ten in general)."""
    mid = turns // 2 - 9 if turns >= 30 else None
    for lo in (1, mid, turns - 9):
        if lo is not None and lo <= turn < lo + 10:
            return f"{lo}-{lo + 9}"
    return None


def _services(args: argparse.Namespace, work: Path) -> tuple[Service, dict[str, Service]]:
    """The engine (the long session's policy) and one proxy per mode, not started. Writes the
    policy and the tokenizer directory for exact_tokens into ``work``."""
    (work / "policy.json").write_text(json.dumps(policy(args.turns)))
    tok = work / "tokenizer"
    template = ["--chat-template", str(Path(args.template).resolve())] if args.template else []
    subprocess.run([*cli_command(), "export-tokenizer", str(tok), *template], check=True, cwd=ROOT)
    engine = Service(
        "engine",
        [
            *cli_command(),
            "scripted-engine",
            "--port",
            str(port := free_port()),
            "--policy",
            str(work / "policy.json"),
            "--max-model-len",
            "262144",
            *template,
        ],
        port,
        work / "engine.log",
    )
    modes = [m for m in MODES if m != "exact_full_render" or not args.no_full_render]
    if args.baseline_src:
        modes += [f"{m}@base" for m in modes]
    proxies: dict[str, Service] = {}
    for mode in modes:
        kind = mode.removesuffix("@base")
        argv = [*cli_command(), "serve", "--backend", engine.url, "--port", str(p := free_port())]
        argv += ["--store", str(work / f"store-{mode}"), "--log-level", "WARNING"]
        argv += ["--store-synchronous", "normal"]
        if kind != "backend_template":
            argv += ["--prompt-mode", "exact_tokens", "--tokenizer", str(tok)]
            argv += ["--max-model-len", "262144"]
        if kind == "exact_full_render":
            argv += ["--exact-full-render"]
        env = baseline_env(args.baseline_src) if mode.endswith("@base") else None
        argv = one_process(argv, args.baseline_src if env is not None else None)
        proxies[mode] = Service(mode, argv, p, work / f"{mode}.log", env=env)
    return engine, proxies


@dataclass
class _Sessions:
    """What every call of the run shares: the client session, the proxies, the tools."""

    session: aiohttp.ClientSession
    engine_url: str
    proxies: dict[str, Service]
    tool_defs: list[dict[str, Any]]
    tool_output_kb: float

    async def call(self, mode: str, r: Rollout, turn: int) -> float:
        return await one_call(
            self.session,
            self.proxies[mode].url,
            self.engine_url,
            r,
            self.tool_defs,
            self.tool_output_kb,
            turn,
        )


async def _measured_turns(
    run: _Sessions,
    args: argparse.Namespace,
    rollouts: dict[str, list[Rollout]],
    samples: dict[str, dict[int, TurnSample]],
    spy_path: Path,
) -> None:
    """Every turn of every mode's rollouts in lockstep, one mode at a time: its CPU per call
    into ``samples``. ``--py-spy``: that proxy sampled from ``--py-spy-from`` on."""
    spy = None
    try:
        for turn in range(1, args.turns + 1):
            if args.py_spy and turn == args.py_spy_from:
                spy = start_py_spy(str(spy_path), run.proxies[args.py_spy].pid)
            for mode, mode_rollouts in rollouts.items():
                pid = run.proxies[mode].pid
                cpu0 = proc_cpu_s(pid)
                await asyncio.gather(*(run.call(mode, r, turn) for r in mode_rollouts))
                cpu1 = proc_cpu_s(pid)
                assert cpu0 is not None and cpu1 is not None
                samples[mode][turn] = TurnSample((cpu1 - cpu0) * 1000 / args.rollouts, [])
            if turn % 10 == 0:
                print(f"  turn {turn} done", file=sys.stderr)
    finally:
        if spy is not None:
            stop_py_spy(spy, str(spy_path))


async def _check_chains(
    run: _Sessions,
    rollouts: dict[str, list[Rollout]],
    samples: dict[str, dict[int, TurnSample]],
) -> tuple[bool, int, dict[str, int]]:
    """Every rollout one chain (added latencies into ``samples``): whether they all are, the
    last exact_tokens prompt's size and, per mode, the calls rendered whole."""
    last_prompt = 0
    whole: dict[str, int] = dict.fromkeys(rollouts, 0)
    for mode, mode_rollouts in rollouts.items():
        for r in mode_rollouts:
            url = f"{run.proxies[mode].url}/captures/rollouts/{r.rollout_id}/chains"
            async with run.session.get(url) as resp:
                chains = await resp.json()
            got = [[c["call_id"] for c in ch["calls"]] for ch in chains["chains"]]
            if got != [r.call_ids]:
                print(f"{mode} {r.rollout_id}: not one chain: {len(got)} chains")
                return False, last_prompt, whole
            for turn, (c, seen) in enumerate(
                zip(chains["chains"][0]["calls"], r.latencies_ms, strict=True), 1
            ):
                samples[mode][turn].added_ms.append(seen - c["latency_ms"])
                kinds = [d["kind"] for d in c.get("diagnostics") or []]
                whole[mode] += "exact_prompt_full_render" in kinds
            if mode.startswith("exact_tokens"):
                last = chains["chains"][0]["calls"][-1]
                last_prompt = len(last["prompt_token_ids"])
    return True, last_prompt, whole


async def run(args: argparse.Namespace) -> int:
    """The benchmark (see the module docstring): 0, or 1 when a rollout is not one chain."""
    raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="long-session-"))
    engine, proxies = _services(args, work)
    modes = list(proxies)
    services = [engine, *proxies.values()]
    system = {"role": "system", "content": "You are a coding agent." + _lines(args.system_kb, "s")}
    user = {"role": "user", "content": "Read every module and summarise the code base."}
    samples: dict[str, dict[int, TurnSample]] = {m: {} for m in modes}
    try:
        for s in services:
            s.start()
        timeout = aiohttp.ClientTimeout(total=args.call_timeout_s)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
            for s in services:
                await s.wait_healthy(session, 120)
            calls = _Sessions(
                session, engine.url, proxies, tools(args.tools_kb), args.tool_output_kb
            )
            rollouts = {
                m: [
                    Rollout(m, f"{m.replace('@', '.')}-{i}", [system, user])
                    for i in range(args.rollouts)
                ]
                for m in modes
            }
            # Warm up every proxy with a short session of its own (not measured), so that
            # one-off costs (first renders, template compilation, store statements) stay out
            # of the first bucket.
            warm = {m: Rollout(m, f"warmup-{m.replace('@', '.')}", [system, user]) for m in modes}
            for turn in range(1, args.warmup_turns + 1):
                for mode in modes:
                    await calls.call(mode, warm[mode], turn)
            spy_path = work / f"py-spy-{args.py_spy}.txt"
            await _measured_turns(calls, args, rollouts, samples, spy_path)
            one_chain, last_prompt, whole = await _check_chains(calls, rollouts, samples)
            if not one_chain:
                return 1
    finally:
        for s in services:
            s.stop()
    report(samples, args, last_prompt)
    print(
        "calls rendered whole (exact_prompt_full_render): "
        + ", ".join(f"{m} {n}" for m, n in whole.items() if not m.startswith("backend_template"))
    )
    return 0


def report(samples: dict[str, dict[int, TurnSample]], args: argparse.Namespace, n: int) -> None:
    print(
        f"long session: {args.rollouts} concurrent rollouts x {args.turns} turns, "
        f"last prompt {n} tokens; every rollout one chain"
    )
    buckets: dict[str, list[int]] = {}
    for t in range(1, args.turns + 1):
        b = bucket_of(t, args.turns)
        if b:
            buckets.setdefault(b, []).append(t)
    print("proxy CPU ms per call by turn bucket | added latency p50 / p99 ms")
    header = f"  {'mode':<18}" + "".join(f"{b:>22}" for b in buckets)
    print(header)
    cpu: dict[str, dict[str, float]] = {}
    for mode, per_turn in samples.items():
        cells = []
        for b, ts in buckets.items():
            c = sum(per_turn[t].cpu_ms_per_call for t in ts) / len(ts)
            added = [a for t in ts for a in per_turn[t].added_ms]
            cpu.setdefault(mode, {})[b] = c
            cells.append(f"{c:8.2f} | {pct(added, 50):5.1f} / {pct(added, 99):5.1f}")
        print(f"  {mode:<18}" + "".join(f"{x:>22}" for x in cells))
    first, last = list(buckets)[0], list(buckets)[-1]
    for suffix in ("", "@base") if args.baseline_src else ("",):
        e = cpu["exact_tokens" + suffix]
        print(
            f"exact_tokens{suffix} CPU/call {last} / {first}: {e[last] / e[first]:.2f}x "
            "(target <= 1.5x)"
        )
        if "exact_full_render" + suffix in cpu:
            f = cpu["exact_full_render" + suffix]
            at_end = (
                samples["exact_full_render" + suffix][args.turns].cpu_ms_per_call
                / samples["exact_tokens" + suffix][args.turns].cpu_ms_per_call
            )
            print(
                f"exact_full_render{suffix} / exact_tokens{suffix} CPU/call at {last}: "
                f"{f[last] / e[last]:.1f}x; at turn {args.turns}: {at_end:.1f}x (target >= 20x)"
            )
        b = cpu["backend_template" + suffix]
        print(f"backend_template{suffix} CPU/call {last} / {first}: {b[last] / b[first]:.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rollouts", type=int, default=4, help="concurrent rollouts per mode")
    p.add_argument("--turns", type=int, default=120)
    p.add_argument("--system-kb", type=float, default=8.0, help="system prompt size")
    p.add_argument("--tools-kb", type=float, default=20.0, help="tool definitions size")
    p.add_argument("--tool-output-kb", type=float, default=0.95, help="each tool result's size")
    p.add_argument("--no-full-render", action="store_true", help="skip the full-render path")
    p.add_argument(
        "--template",
        help="a jinja chat template file (e.g. tests/fixtures/chat_templates/qwen3_hybrid.jinja)"
        " that the engine and the proxy's tokenizer render with instead of ours",
    )
    p.add_argument(
        "--warmup-turns",
        type=int,
        default=3,
        help="turns of an unmeasured session per proxy before the measured ones",
    )
    p.add_argument("--call-timeout-s", type=float, default=600)
    p.add_argument(
        "--baseline-src",
        metavar="DIR",
        help="also run every mode from this source tree (e.g. a git archive of the fork point), "
        "as MODE@base, in the same run",
    )
    p.add_argument("--py-spy", help="record py-spy samples of that proxy (a mode's name)")
    p.add_argument(
        "--py-spy-from", type=int, default=1, help="start the py-spy recording at this turn"
    )
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
